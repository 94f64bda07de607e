"""No request stalls the rest: every limit checked before any work, admission that tells the truth, no 500 from
a header, and the context bound, `echo` scoring and `max_tokens: null` as vLLM has them.

The tiny server: max_num_seqs=8, --max-queue 64, a context of 128 tokens, and a byte tokenizer whose longest
token (the end-of-text marker's text) is 13 characters.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from serving_support import (NAME, assert_no_block_leaked, model, post_bytes, raw_http, start,  # noqa: F401
                             tokenizer, wait_idle)

MAX_NUM_SEQS, MAX_QUEUE, N_CTX = 8, 64, 128


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with start(model, tokenizer, max_queue=MAX_QUEUE, max_num_seqs=MAX_NUM_SEQS,
               limits={"max_logprob_entries": 100_000}) as s:
        yield s


HOSTILE = [  # (the body's fields over a limit, param, phrases the message must hold: the value, the limit, the flag)
    ({"n": 10**9}, "n", ["n=1000000000", "max_num_seqs=8", "--max-num-seqs"]),
    ({"n": 10**30}, "n", ["n=1" + "0" * 30, "--max-num-seqs"]),
    ({"n": 9, "best_of": 9}, "n", ["n=9", "max_num_seqs=8"]),
    ({"logprobs": 10**9}, "logprobs", ["logprobs=1000000000", "limit of 20", "--max-logprobs"]),
    ({"prompt": [[1]] * (MAX_NUM_SEQS + MAX_QUEUE + 1)}, "prompt",
     ["73 prompts", "max_num_seqs=8", "--max-queue=64", "could never be admitted"]),
    ({"stop": ["x"] * 100_000}, "stop", ["[100000 strings]", "limit of 64", "--max-stop-strings"]),
    ({"stop": ["x" * 5000]}, "stop", ["[5000 characters]", "limit of 4096", "--max-stop-chars"]),
    ({"prompt": "a" * 3_600_000}, "prompt", ["3600000 characters", "n_ctx=128"]),
    ({"prompt": [1] * 200_000}, "prompt", ["200000 tokens", "n_ctx=128"]),
    ({"prompt": [[1] * 100] * 8, "echo": True, "logprobs": 20, "n": 8, "max_tokens": 28}, "logprobs",
     ["logprobs=20", "172032 log-probability entries", "limit of 100000", "--max-logprob-entries"]),
    ({"max_tokens": 10**40}, "max_tokens", ["max_tokens (100000000000... (41 digits))", "at most 125"]),
]


@pytest.mark.parametrize("fields, param, phrases", HOSTILE, ids=[p + str(i) for i, (_, p, _) in enumerate(HOSTILE)])
def test_each_limit_is_a_400_at_once_naming_the_value_the_limit_and_the_flag(server, fields, param, phrases):
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4, **fields}
    began = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    took = time.perf_counter() - began
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    assert all(p in error["message"] for p in phrases), error["message"]
    assert took < 5, f"{took:.1f} s to refuse: the work was done before the check"  # milliseconds, on a quiet machine
    assert httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                      timeout=30).status_code == 200
    assert_no_block_leaked(server)


def test_the_same_limits_hold_for_chat(model, tokenizer):
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    from minillm.serving.chat_template import ChatTemplate
    with start(model, tokenizer, chat_template=ChatTemplate(template)) as server:
        for fields, param in [({"n": 10**9}, "n"), ({"logprobs": True, "top_logprobs": 10**9}, "top_logprobs"),
                              ({"messages": [{"role": "user", "content": "a" * 2_000_000}]}, "messages")]:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("value", ["²".encode(), b"9" * 5000, b"-1", b"1e3"])
def test_a_last_event_id_that_is_no_step_number_is_a_400_not_a_500(server, value):
    request = b"GET /v1/engine/events HTTP/1.1\r\nHost: t\r\nLast-Event-ID: " + value + b"\r\nConnection: close\r\n\r\n"
    head, _, body = raw_http(server.url, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), head + body[:300]
    assert "is not a step number" in json.loads(body)["error"]["message"]


def test_a_body_that_can_never_fit_is_a_400_and_one_that_can_is_admitted_whole(server):
    """A body's prompts are admitted together: on an idle server, max_num_seqs + max_queue prompts of 4 samples
    each are all taken (the samples run as slots free), one more prompt can never be."""
    most = MAX_NUM_SEQS + MAX_QUEUE
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": [[1, 2, 3]] * most, "n": 4, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == most * 4 and r.json()["usage"]["completion_tokens"] == most * 4 * 2
    assert_no_block_leaked(server)


def test_a_body_that_can_fit_later_gets_429_and_its_retry_after_is_met(model, tokenizer):
    with start(model, tokenizer, max_queue=0, max_num_seqs=2, step_delay=0.01) as server:
        long = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {"prompt": [1, 2], "n": 2, "max_tokens": 40, "ignore_eos": True},
                                        "timeout": 60})
        long.start()
        deadline = time.monotonic() + 30
        while server.serving.loop.num_running < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "RateLimitError", refused.text
        wait = float(refused.headers["Retry-After"])
        long.join(timeout=60)
        time.sleep(wait)
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert_no_block_leaked(server)


def test_echo_with_max_tokens_0_returns_the_scored_prompt_and_no_new_token(server):
    """What lm-eval and OpenAI's legacy API send to score a text: the prompt's text, each token's logprob (the
    first null), finish_reason "length", no completion token; the scores equal those of `max_tokens: 1`."""
    prompt = list(range(10, 10 + N_CTX))  # a whole context: nothing is generated, so it fits
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    (choice,), usage = r.json()["choices"], r.json()["usage"]
    assert usage == {"prompt_tokens": N_CTX, "completion_tokens": 0, "total_tokens": N_CTX}
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == N_CTX
    assert choice["logprobs"]["token_logprobs"][0] is None
    one = httpx.post(server.url + "/v1/completions", timeout=60,
                     json={"prompt": prompt[:-1], "echo": True, "max_tokens": 1, "logprobs": 1,
                           "temperature": 0}).json()["choices"][0]
    assert choice["logprobs"]["token_logprobs"][:N_CTX - 1] == pytest.approx(
        one["logprobs"]["token_logprobs"][:N_CTX - 1], abs=1e-4)  # fp32, prefilled in other chunks
    text = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "hello", "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert text["text"] == "hello" and text["logprobs"] is None
    streamed = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": "hello", "echo": True, "max_tokens": 0, "stream": True}).text
    data = [json.loads(line[5:]) for line in streamed.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    assert "".join(d["choices"][0]["text"] for d in data) == "hello"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 0},
                      timeout=30).status_code == 400, "without echo, max_tokens 0 asks for nothing"


def test_the_context_holds_prompt_plus_max_tokens_as_vllm_bounds_it(server):
    prompt = list(range(10, 110))  # 100 tokens: 28 more fill the context of 128
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"prompt": prompt, "max_tokens": 28, "ignore_eos": True}).json()
    assert ok["usage"]["total_tokens"] == N_CTX
    over = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 29})
    assert over.status_code == 400 and "at most 28" in over.json()["error"]["message"]
    rest = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": None, "ignore_eos": True}).json()
    assert rest["usage"]["completion_tokens"] == 28 and rest["usage"]["total_tokens"] == N_CTX
    full = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": prompt + [1] * 28, "max_tokens": None})
    assert full.status_code == 400 and "no room for a new token" in full.json()["error"]["message"]
    wait_idle(server)


def test_the_hostile_benchmark_sends_each_attack_beside_running_streams(server):
    """bench.hostile's run, shrunk: each attack answered (400s, and the scoring request served), the streams timed
    in both windows. What it measures is judged by its own rounds, not here."""
    import asyncio

    from minillm.bench.hostile import measure
    result = asyncio.run(measure(server.url, streams=2, rounds=1, seconds=0.2, scoring_n=2))
    statuses = {name: s["status"] for name, s in result["attacks"].items()}
    assert statuses == {"n=10^9": [400], "n=10^6": [400], "100k stop strings": [400], "3.6 MB text prompt": [400],
                        "10k prompts": [400], "echo+logprobs 20+n 2": [200], "Last-Event-ID: 5000 digits": [400]}
    assert all(s["itl_p50_quiet_s"] > 0 for s in result["attacks"].values())
    assert_no_block_leaked(server)


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro",
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFF\r\n{\"pro"],
    ids=["short", "chunked"])
def test_a_body_that_trickles_in_is_a_408_after_body_timeout(model, tokenizer, head):
    """A client that sends part of its body and waits holds a socket: after --body-timeout it gets a 408 and
    the connection is closed (uvicorn alone would wait for the rest forever)."""
    with start(model, tokenizer, limits={"body_timeout": 0.5}) as server:
        began = time.perf_counter()
        answer = raw_http(server.url, head, timeout=20)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert time.perf_counter() - began < 10
        assert "--body-timeout" in json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_a_burst_of_small_requests_mixed_with_scoring_and_leavers_gets_only_200s_and_429s(model, tokenizer):
    """300 requests at once (plain, streamed, echo-scored, and streams whose clients leave after two events) on
    a server of 8 slots and a queue of 64: each is served or told 429 with a Retry-After, /health answers
    meanwhile, and nothing is left behind."""
    import asyncio

    async def one(client, i: int):
        kind = i % 4
        body = {"prompt": [1 + i % 50, 2, 3], "max_tokens": 8, "ignore_eos": True}
        if kind == 1:
            body.update(echo=True, max_tokens=0, logprobs=5)
        if kind in (2, 3):
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    return r.status_code, r.headers.get("Retry-After")
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if kind == 3 and seen == 2:
                        return "left", None
                return r.status_code, None
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.headers.get("Retry-After")

    async def burst(url):
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=400)) as client:
            answers = asyncio.gather(*(one(client, i) for i in range(300)))
            await asyncio.sleep(0.05)
            began = time.perf_counter()
            health = await client.get("/health")
            return await answers, health.status_code, time.perf_counter() - began

    with start(model, tokenizer, max_queue=64, max_num_seqs=8) as server:
        answers, health, health_s = asyncio.run(burst(server.url))
        assert_no_block_leaked(server)
    assert health == 200 and health_s < 5, health_s
    statuses = {status for status, _ in answers}
    assert statuses <= {200, 429, "left"} and 200 in statuses, statuses
    assert all(retry == "1" for status, retry in answers if status == 429)
