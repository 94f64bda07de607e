"""`n` samples over HTTP, through the official `openai` client: n choices by index, each the text its seed gives
alone (sample j of seed s is the request with seed s + j), streamed or not, completion or chat; usage counts
every sample's tokens; a client that leaves aborts every sample and leaks no block."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from models import random_prompts
from serving_support import NAME, assert_no_block_leaked, metric, model, start, tokenizer  # noqa: F401
from test_server_chat import CHATML, MESSAGES

from minillm import SamplingParams
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from minillm.serving.chat_template import ChatTemplate

SAMPLE = dict(temperature=1.0, seed=21, max_tokens=10, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML), block_size=4) as s:
        yield s


def full_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def alone(create, n: int, **kw) -> list:
    """Each sample's choice as the request with n=1 and seed + j answers it."""
    return [create(**{**SAMPLE, **kw, "seed": SAMPLE["seed"] + j}).choices[0] for j in range(n)]


def test_completions_return_n_choices_each_its_seed_alone(server):
    client, prompt = client_for(server), random_prompts(1, [9], seed=2)[0]
    whole = client.completions.create(model=NAME, prompt=prompt, n=3, **SAMPLE)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    singles = alone(client.completions.create, 3, model=NAME, prompt=prompt)
    assert [c.text for c in whole.choices] == [c.text for c in singles]
    assert len({c.text for c in whole.choices}) == 3
    assert whole.usage.completion_tokens == 30 and whole.usage.prompt_tokens == len(prompt)
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in client.completions.create(model=NAME, prompt=prompt, n=3, stream=True,
                                           stream_options={"include_usage": True}, **SAMPLE):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices] and reasons == ["length"] * 3
    assert usage.completion_tokens == 30
    assert_no_block_leaked(server)


def test_chat_returns_n_choices_streamed_or_not(server):
    client = client_for(server)
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, n=2, **SAMPLE)
    singles = alone(client.chat.completions.create, 2, model=NAME, messages=MESSAGES)
    assert [(c.index, c.message.content) for c in whole.choices] == [(j, s.message.content)
                                                                     for j, s in enumerate(singles)]
    assert whole.usage.completion_tokens == 20
    texts, roles = ["", ""], [None, None]
    for chunk in client.chat.completions.create(model=NAME, messages=MESSAGES, n=2, stream=True, **SAMPLE):
        for c in chunk.choices:
            roles[c.index] = c.delta.role or roles[c.index]
            texts[c.index] += c.delta.content or ""
    assert roles == ["assistant"] * 2 and texts == [c.message.content for c in whole.choices]
    assert_no_block_leaked(server)


def test_a_client_that_leaves_aborts_every_sample(server):
    before = metric(httpx.get(server.url + "/metrics").text, 'minillm:request_success_total{finished_reason="abort"}')

    async def leave():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        stream = await client.completions.create(model=NAME, prompt=[1, 2, 3, 4, 5], n=3, stream=True,
                                                 temperature=1.0, seed=0, max_tokens=100,
                                                 extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 6:  # two tokens of each sample, 94 to go
                break
        await stream.close()

    asyncio.run(leave())
    assert_no_block_leaked(server)
    after = metric(httpx.get(server.url + "/metrics").text, 'minillm:request_success_total{finished_reason="abort"}')
    assert after - before == 3  # every sample of the request was aborted, none ran to its end


def test_a_stop_string_ends_its_own_sample_and_the_others_go_on(server):
    client, prompt = client_for(server), random_prompts(1, [6], seed=4)[0]
    free = client.completions.create(model=NAME, prompt=prompt, n=2, **{**SAMPLE, "max_tokens": 40})
    first, second = (c.text for c in free.choices)
    stop = next(first[i:i + 3] for i in range(4, len(first) - 3) if first[i:i + 3] not in second)
    abort = 'minillm:request_success_total{finished_reason="abort"}'
    before = metric(httpx.get(server.url + "/metrics").text, abort)
    cut = client.completions.create(model=NAME, prompt=prompt, n=2, stop=[stop], **{**SAMPLE, "max_tokens": 40})
    assert [(c.text, c.finish_reason) for c in cut.choices] == [(first[:first.index(stop)], "stop"),
                                                                (second, "length")]
    assert_no_block_leaked(server)
    # the engine stopped the sample the stop string ended, and only that one, rather than run it to 40 tokens
    assert metric(httpx.get(server.url + "/metrics").text, abort) - before == 1


def reference_samples(model, prompt: list[int], n: int, **knobs) -> list[list[int]]:
    """Sample j's token ids: the n=1 request seeded seed + j, in an engine like the server's."""
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8),
                       CacheConfig(num_gpu_blocks_override=128, block_size=4))
    return [engine.generate([prompt], SamplingParams(**{**knobs, "seed": knobs["seed"] + j}))[0].output_token_ids
            for j in range(n)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_samples_of_a_batch_of_prompts_with_logprobs(server, model, tokenizer, stream):
    client, prompts = client_for(server), [random_prompts(1, [k], seed=8)[0] for k in (7, 9)]
    kw = dict(model=NAME, prompt=prompts, n=2, logprobs=1, **SAMPLE)
    texts, reasons, lps, usage = {}, {}, {}, None
    if stream:
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
                got = lps.setdefault(c.index, {"tokens": [], "token_logprobs": [], "text_offset": []})
                for key in got:
                    got[key] += getattr(c.logprobs, key)
            usage = chunk.usage or usage
    else:
        out = client.completions.create(**kw)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        for c in out.choices:
            texts[c.index], reasons[c.index] = c.text, c.finish_reason
            lps[c.index] = {k: getattr(c.logprobs, k) for k in ("tokens", "token_logprobs", "text_offset")}
        usage = out.usage
    assert sorted(texts) == [0, 1, 2, 3] and set(reasons.values()) == {"length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (7 + 9, 4 * 10)  # each prompt counted once
    for i, prompt in enumerate(prompts):
        for j, ids in enumerate(reference_samples(model, prompt, 2, temperature=1.0, seed=SAMPLE["seed"],
                                                  max_tokens=10, ignore_eos=True)):
            index, ref = i * 2 + j, full_logprobs(model, prompt + ids)  # vLLM's prompt_index · n + sample_index
            assert texts[index] == tokenizer.decode(ids)
            assert lps[index]["tokens"] == [tokenizer.decode([t]) for t in ids]
            assert lps[index]["text_offset"] == [len(tokenizer.decode(ids[:k])) for k in range(len(ids))]
            want = [ref[len(prompt) + k - 1, t].item() for k, t in enumerate(ids)]
            assert lps[index]["token_logprobs"] == pytest.approx(want, abs=1e-4)
    assert_no_block_leaked(server)


def test_echo_puts_the_prompt_in_each_samples_choice(server, tokenizer):
    client, prompt = client_for(server), random_prompts(1, [6], seed=3)[0]
    out = client.completions.create(model=NAME, prompt=prompt, n=2, echo=True, logprobs=0, **SAMPLE)
    head = tokenizer.decode(prompt)
    for c in out.choices:
        assert c.text.startswith(head) and len(c.logprobs.tokens) == len(prompt) + 10
        assert c.logprobs.token_logprobs[0] is None
    assert out.choices[0].logprobs.token_logprobs[:6] == out.choices[1].logprobs.token_logprobs[:6]
    assert_no_block_leaked(server)


def test_penalties_apply_to_each_sample_as_to_its_seed_alone(server):
    client, prompt = client_for(server), random_prompts(1, [9], seed=2)[0]
    penalties = dict(presence_penalty=1.5, frequency_penalty=1.0)
    whole = client.completions.create(model=NAME, prompt=prompt, n=2, **SAMPLE, **penalties)
    singles = alone(client.completions.create, 2, model=NAME, prompt=prompt, **penalties)
    assert [c.text for c in whole.choices] == [c.text for c in singles]
    plain = alone(client.completions.create, 2, model=NAME, prompt=prompt)
    assert [c.text for c in whole.choices] != [c.text for c in plain]  # the penalties did act
    assert_no_block_leaked(server)
