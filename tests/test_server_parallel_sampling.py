"""`n` samples over HTTP, through the official `openai` client: n choices by index, each the text its seed gives
alone (sample j of seed s is the request with seed s + j), streamed or not, completion or chat; usage counts
every sample's tokens; a client that leaves aborts every sample and leaks no block."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from models import random_prompts
from serving_support import NAME, assert_no_block_leaked, metric, model, start, tokenizer  # noqa: F401
from test_server_chat import CHATML, MESSAGES

from minillm.serving.chat_template import ChatTemplate

SAMPLE = dict(temperature=1.0, seed=21, max_tokens=10, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML), block_size=4) as s:
        yield s


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
