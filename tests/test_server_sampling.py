"""The sampling fields real clients send, over HTTP: `echo` with `logprobs` (the prompt's log-probabilities, which
loglikelihood scoring reads), chat's `logprobs`/`top_logprobs`, penalties, and a batch of prompts, one choice each.
Every log-probability is checked against log_softmax of the model's full forward pass (fp32: 1e-4)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from models import random_prompts
from serving_support import NAME, assert_no_block_leaked, model, start, tokenizer  # noqa: F401
from test_server_chat import CHATML, MESSAGES

from minillm import SamplingParams
from minillm.kv_cache import generate
from minillm.serving.chat_template import ChatTemplate

ATOL = 1e-4


def full_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("knobs", [{}, dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
                                   dict(enable_prefix_caching=True, block_size=4)],
                         ids=["whole", "chunked", "prefix-caching"])
def test_echo_with_logprobs_gives_the_prompts_log_probabilities(model, tokenizer, knobs):
    prompt = random_prompts(1, [40], seed=11)[0]  # 40 tokens: more than a 16-token step, and 10 blocks of 4
    with start(model, tokenizer, **knobs) as server:
        c = client(server)
        c.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)  # fills the prefix cache
        out = c.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
        assert_no_block_leaked(server)
    choice = out.choices[0]
    gen = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    ref = full_logprobs(model, prompt + gen)
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(gen)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + len(gen)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    ids = prompt + gen
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < ATOL, pos
        top = lp.top_logprobs[pos]
        # the 2 most likely and the token itself, keyed by text (two ids that decode alike, as lone bytes to
        # U+FFFD, share a key: OpenAI's shape, and vLLM's); the engine's tests check the top ids themselves
        assert lp.tokens[pos] in top and 1 <= len(top) <= 3
        assert max(top.values()) <= ref[pos - 1].max().item() + ATOL
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_streamed_logprobs_cover_each_token_once(model, tokenizer):
    prompt = random_prompts(1, [9], seed=12)[0]
    with start(model, tokenizer) as server:
        stream = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                                   logprobs=1, echo=True, stream=True)
        chunks = [ch for ch in stream if ch.choices]
    gen = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    ref = full_logprobs(model, prompt + gen)
    tokens, logprobs, offsets = [], [], []
    for ch in chunks:
        tokens += ch.choices[0].logprobs.tokens
        logprobs += ch.choices[0].logprobs.token_logprobs
        offsets += ch.choices[0].logprobs.text_offset
    assert len(chunks) == 6 and len(tokens) == len(prompt) + 6  # the first event carries the echoed prompt
    assert "".join(ch.choices[0].text for ch in chunks) == tokenizer.decode(prompt + gen)
    assert logprobs[0] is None and all(abs(logprobs[p] - ref[p - 1, (prompt + gen)[p]].item()) < ATOL
                                       for p in range(1, len(tokens)))
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_a_batch_of_prompts_is_one_choice_per_prompt_streamed_or_not(model, tokenizer):
    prompts = random_prompts(3, [4, 9, 15], seed=13)
    wants = [tokenizer.decode(ids) for ids in generate(model, prompts, SamplingParams(temperature=0, max_tokens=8))]
    texts = ["The KV cache", "Prefill is compute-bound; decode"]
    text_wants = [tokenizer.decode(ids) for ids in generate(model, [tokenizer.encode(t) for t in texts],
                                                             SamplingParams(temperature=0, max_tokens=8))]
    with start(model, tokenizer) as server:
        c = client(server)
        whole = c.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0)
        assert [ch.index for ch in whole.choices] == [0, 1, 2]
        assert [ch.text for ch in whole.choices] == wants
        assert whole.usage.prompt_tokens == sum(map(len, prompts)) and whole.usage.completion_tokens == 24
        parts = {}
        for chunk in c.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, stream=True):
            for ch in chunk.choices:
                parts[ch.index] = parts.get(ch.index, "") + ch.text
        assert parts == dict(enumerate(wants))
        as_text = c.completions.create(model=NAME, prompt=texts, max_tokens=8, temperature=0)
        assert [ch.text for ch in as_text.choices] == text_wants
        with pytest.raises(openai.BadRequestError) as caught:
            c.completions.create(model=NAME, prompt=[prompts[0], [1, 999]], max_tokens=8)
        assert caught.value.param == "prompt[1]" and "prompt[1]: token id 999" in caught.value.message
        assert_no_block_leaked(server)


def test_penalties_over_http_are_the_engines(model, tokenizer):
    prompt = random_prompts(1, [10], seed=14)[0]
    with start(model, tokenizer) as server:
        c = client(server)
        plain = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        penalized = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                         frequency_penalty=2.0, presence_penalty=1.0,
                                         extra_body={"repetition_penalty": 1.3, "min_tokens": 4})
    sp = SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0,
                        repetition_penalty=1.3, min_tokens=4)
    from minillm.engine import LLMEngine
    want = LLMEngine(model).generate([prompt], sp)[0].output_token_ids
    assert penalized.choices[0].text == tokenizer.decode(want) != plain.choices[0].text


def test_chat_logprobs_in_the_chat_shape(model, tokenizer):
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML)) as server:
        out = client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                                     logprobs=True, top_logprobs=3)
        streamed = client(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                                          temperature=0, logprobs=True, stream=True)
        events = [e for e in streamed if e.choices and e.choices[0].logprobs]
        bad = httpx.post(server.url + "/v1/chat/completions",
                         json={"messages": MESSAGES, "top_logprobs": 2}).json()
        too_many = httpx.post(server.url + "/v1/chat/completions",
                              json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}).json()
    prompt = tokenizer.encode(ChatTemplate(CHATML).render(MESSAGES, True))
    gen = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=5))[0]
    ref = full_logprobs(model, prompt + gen)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in gen]
    for i, e in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert abs(e.logprob - row[gen[i]].item()) < ATOL and e.bytes == list(e.token.encode())
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([t]) for t in row.topk(3).indices.tolist()]
    assert [len(e.choices[0].logprobs.content) for e in events] == [1] * 5
    assert all(e.choices[0].logprobs.content[0].top_logprobs == [] for e in events)
    assert bad["error"]["param"] == "top_logprobs" and "needs logprobs=true" in bad["error"]["message"]
    assert too_many["error"]["param"] == "top_logprobs" and "top_logprobs=21 is over this server's limit of 20" in \
        too_many["error"]["message"]


def test_a_raw_body_shows_the_legacy_logprobs_fields(model, tokenizer):
    with start(model, tokenizer) as server:
        body = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                                "logprobs": 0}).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, json.dumps(lp)
    assert len(lp["tokens"]) == 2 and all(len(top) == 1 for top in lp["top_logprobs"])


# ---- one mapping from a body to SamplingParams, which cannot drop a field ----------------------------------

CARRIED = {  # every SamplingParams field a body carries under its own name, and a value that is not its default
    "temperature": 0.5, "top_k": 7, "top_p": 0.9, "seed": 3, "ignore_eos": True, "min_tokens": 2,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "n": 2}


def test_every_sampling_field_a_body_sends_reaches_the_engine(model, tokenizer):
    """A SamplingParams field added without a way in fails here until it is carried (or listed as derived) and
    given a value above."""
    from dataclasses import fields

    from minillm.serving.protocol import DERIVED
    assert {f.name for f in fields(SamplingParams)} - set(DERIVED) == set(CARRIED), \
        "a SamplingParams field that no request carries: give the request types a field of its name"
    with start(model, tokenizer) as server:
        loop, seen = server.serving.loop, []
        submit_all = loop.submit_all
        loop.submit_all = lambda requests: (seen.extend(params for _, _, params, _, _ in requests),
                                            submit_all(requests))
        body = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 5, "logprobs": 2, "echo": True, "stop": [7],
                "stop_token_ids": [9], **CARRIED}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert_no_block_leaked(server)
    assert len(seen) == 2
    for params in seen:
        assert {k: getattr(params, k) for k in CARRIED} == CARRIED
        assert (params.max_tokens, params.logprobs, params.prompt_logprobs, params.stop_token_ids) == (5, 2, 2, (7, 9))


def test_a_new_sampling_field_is_carried_by_the_mapping_or_stops_the_server_from_starting():
    from dataclasses import dataclass

    from minillm.serving.protocol import CompletionRequest, check_carried, to_sampling_params

    @dataclass(frozen=True)
    class Wider(SamplingParams):
        typical_p: float = 1.0

    with pytest.raises(TypeError, match=r"\['typical_p'\] are carried by no field of CompletionRequest"):
        check_carried(Wider)

    class WiderRequest(CompletionRequest):
        typical_p: float | None = None

    check_carried(Wider, [WiderRequest])
    derived = {"max_tokens": 4, "logprobs": None, "prompt_logprobs": None, "stop_token_ids": (), "best_of": None}
    body = WiderRequest.model_validate({"prompt": [1], "typical_p": 0.5, "temperature": 0.7})
    params = to_sampling_params(body, derived, Wider)
    assert (params.typical_p, params.temperature, params.max_tokens) == (0.5, 0.7, 4)
