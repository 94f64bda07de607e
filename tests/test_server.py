"""The HTTP server (minillm/serving/) and its load generator (minillm/bench/serve.py).

Every test starts its own server on a free port of 127.0.0.1 and stops it, on a
context-sensitive tiny model, so the greedy text streamed over HTTP can only
equal `kv_cache.generate`'s if every token took the right path.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from models import random_prompts  # noqa: E402
from serving_support import NAME, free_port, model, on_engine, start, tokenizer, wait_idle  # noqa: E402,F401

from minillm.bench.serve import RequestResult, benchmark, meets, parse_goodput, summarize  # noqa: E402
from minillm.kv_cache import generate  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402
from minillm.bench.workloads import Request, Workload, arrivals  # noqa: E402
from minillm.serving.text_stream import TextStream  # noqa: E402

def greedy_text(model, tokenizer, prompt, max_tokens):
    ids = generate(model, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return tokenizer.decode(ids), len(ids)


def stream_text(url, prompt, max_tokens, **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra or None)
    parts, usage, reason = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage
    return "".join(parts), usage, reason


def test_openai_client_streams_the_greedy_tokens(model, tokenizer):
    prompt = random_prompts(1, [9], seed=3)[0]
    want, n = greedy_text(model, tokenizer, prompt, 24)
    with start(model, tokenizer) as server:
        text, usage, reason = stream_text(server.url, prompt, 24)
        assert text == want
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)
        assert reason == ("length" if n == 24 else "stop")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == want and whole.usage.completion_tokens == n
        assert [m.id for m in client.models.list().data] == [NAME]
        assert httpx.get(server.url + "/health").status_code == 200
        metrics = httpx.get(server.url + "/metrics").text
        assert "minillm:time_to_first_token_seconds_count 2.0" in metrics
        assert f"minillm:generation_tokens_total {2.0 * n}" in metrics
    assert not server.thread.is_alive() and not server.serving.loop.alive


@pytest.mark.parametrize("knobs", [dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
                                   dict(enable_prefix_caching=True, block_size=4)],
                         ids=["chunked", "prefix-caching"])
def test_eight_concurrent_streams_each_get_their_greedy_tokens(model, tokenizer, knobs):
    shared = random_prompts(1, [12], seed=5)[0]
    prompts = [shared + p for p in random_prompts(8, range(3, 30), seed=6)]  # a common prefix, then their own
    wants = [greedy_text(model, tokenizer, p, 20)[0] for p in prompts]

    async def clients(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def one(p):
            parts = []
            async for chunk in await client.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0,
                                                               stream=True):
                parts.append(chunk.choices[0].text)
            return "".join(parts)

        return await asyncio.gather(*(one(p) for p in prompts))

    with start(model, tokenizer, **knobs) as server:
        assert asyncio.run(clients(server.url)) == wants
        wait_idle(server)
        on_engine(server, lambda e: e.check_invariants())
        if knobs.get("enable_prefix_caching"):
            assert on_engine(server, lambda e: e.prefix_cache_hit_rate) > 0  # the shared prefix was reused
        else:
            chunks = on_engine(server, lambda e: max(s.num_prefill_tokens for s in e.timeline))
            assert chunks <= 16  # prompts of up to 41 tokens were cut into chunks


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(model, tokenizer):
    with start(model, tokenizer) as server:
        body = {"model": NAME, "prompt": random_prompts(1, [20])[0], "max_tokens": 100, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions",
                                                                json=body) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break  # leave with 97 tokens to go
        wait_idle(server)
        on_engine(server, lambda e: e.check_invariants())
        free, total = on_engine(server, lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
        assert free == total
        metrics = httpx.get(server.url + "/metrics").text
        assert 'minillm:request_success_total{finished_reason="abort"} 1.0' in metrics  # aborted, not run to its end
        assert stream_text(server.url, [1, 2, 3], 4)[1].completion_tokens == 4  # and the server goes on


def test_overload_past_max_queue_gets_429_with_retry_after(model, tokenizer):
    with start(model, tokenizer, max_queue=1, max_num_seqs=1) as server:
        body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=60),
                                      range(6)))
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and set(codes) <= {200, 429, 503} and (429 in codes or 503 in codes), codes
        refused = next(r for r in responses if r.status_code != 200)
        assert refused.headers["Retry-After"] and "--max-queue=1" in refused.json()["error"]["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses if r.status_code == 200)
        wait_idle(server)
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("body, message", [
    ('{"prompt": [1, 2', "not valid JSON"),
    (json.dumps({"prompt": list(range(200))}), "n_ctx=128"),
    (json.dumps({"prompt": [1, 2], "top_p": 1.5}), "top_p=1.5 must be in (0, 1]"),
    (json.dumps({"prompt": [1, 2, 999]}), "outside the vocabulary"),
    (json.dumps({"prompt": [1, 2], "n": 0}), "n=0 must be ≥ 1"),
    (json.dumps({"prompt": [1, 2], "temperature": "hot"}), "temperature"),
])
def test_bad_input_gets_400_with_the_engine_message_and_the_server_goes_on(model, tokenizer, body, message):
    with start(model, tokenizer) as server:
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]["message"]
        assert message in error and "\n" not in error
        assert stream_text(server.url, [4, 5], 3)[1].completion_tokens == 3


def test_a_stop_string_ends_the_text_before_it(model, tokenizer):
    prompt = random_prompts(1, [7], seed=11)[0]
    want, _ = greedy_text(model, tokenizer, prompt, 30)
    stop = want[10:13]
    with start(model, tokenizer) as server:
        text, _, reason = stream_text(server.url, prompt, 30, stop=[stop])
        wait_idle(server)
        on_engine(server, lambda e: e.check_invariants())
    assert text == want[:want.index(stop)] and reason == "stop"


def test_text_stream_holds_back_a_split_character_and_a_possible_stop():
    utf8 = list("é…".encode())
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    text = TextStream(decode, [])
    deltas = [text.update(utf8[:k], k == len(utf8)) for k in range(1, len(utf8) + 1)]
    assert "".join(deltas) == "é…" and "\ufffd" not in "".join(deltas)
    text = TextStream(decode, ["END"])
    ids = list(b"abEN")
    assert [text.update(ids[:k], False) for k in range(1, 5)] == ["a", "b", "", ""]
    assert text.update(list(b"abENX"), False) == "ENX" and not text.stopped
    assert text.update(list(b"abENXEND!"), False) == "" and text.stopped


def test_bench_serve_reports_percentiles_and_goodput(model, tokenizer):
    pairs = Workload("lognormal", 12, 512, 128, prompt_median=16, output_median=8)
    requests = [Request(p, o, t) for (p, o), t in zip(pairs, arrivals(12, 40.0))]
    with start(model, tokenizer) as server:
        results, duration = asyncio.run(benchmark(server.url, requests, show_progress=False))
    assert all(r.success for r in results) and [r.output_tokens for r in results] == [o for _, o in pairs]
    assert len({r.id for r in results}) == 12
    impossible = summarize(results, duration, parse_goodput(["ttft:0.001", "itl:0.001"]))
    assert summarize(results, duration, parse_goodput(["itl:0.001"]))["goodput_share"] == 0
    loose = summarize(results, duration, parse_goodput(["ttft:60000", "itl:60000"]))
    assert impossible["goodput_share"] == 0 and impossible["request_goodput"] == 0
    assert loose["goodput_share"] == 1 and loose["request_goodput"] == pytest.approx(12 / duration)
    for name in ("ttft", "itl", "e2el", "tpot"):
        assert 0 < loose[f"p50_{name}_ms"] <= loose[f"p90_{name}_ms"] <= loose[f"p99_{name}_ms"]
    assert loose["total_output_tokens"] == sum(o for _, o in pairs) and loose["failed"] == 0
    with pytest.raises(ValueError, match="ttft, tpot, itl, e2el"):
        parse_goodput(["latency:5"])


def test_the_itl_target_is_met_only_when_every_gap_meets_it():
    stall = RequestResult(True, 4, start=0.0, token_times=[0.010, 0.011, 0.012, 0.013, 0.043], output_tokens=5)
    assert meets(stall, {"ttft": 0.020}) and meets(stall, {"tpot": 0.010})  # mean gap 8 ms
    assert not meets(stall, {"itl": 0.010})  # one 30 ms stall
    assert not meets(RequestResult(False, 4), {})  # a failed request meets no target


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_the_serve_command_shuts_down_cleanly_with_exit_0(tmp_path, sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", "tiny", "--port", str(port),
                             "--max-num-batched-tokens", "256", "--max-queue", "4", "--num-gpu-blocks-override", "64",
                             "--request-log", str(tmp_path / "requests.jsonl"), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MINILLM_WEIGHTS_DIR": str(tmp_path)})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert "torch threads: 1 thread, as asked (--threads)" in proc.stdout.read()  # the flag its message names
        (record,) = map(json.loads, (tmp_path / "requests.jsonl").read_text().splitlines())
        assert record["id"] == r.json()["id"] and len(record["token_times"]) == 3  # the engine's own record
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_stop_string_automaton_cuts_where_a_scan_of_every_string_cuts():
    """One automaton over all the stop strings, fed only the new characters, against the plain rule (after each
    update whose text is settled, cut at the first place any stop string starts in all the text so far), on
    seeded random texts split into random runs of tokens."""
    import random
    rng = random.Random(0)
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    for _ in range(3000):
        stops = ["".join(rng.choice("abé") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        ids = list("".join(rng.choice("abcé") for _ in range(rng.randint(0, 20))).encode())
        text, sent, k, want, cut = TextStream(decode, stops), [], 0, decode(ids), False
        while k < len(ids) and not text.stopped:
            k = min(len(ids), k + rng.randint(1, 3))
            sent.append(text.update(ids[:k], k == len(ids)))
            settled = decode(ids[:k])
            if not cut and (k == len(ids) or not settled.endswith("\ufffd")):
                cuts = [i for i in (settled.find(s) for s in stops) if i >= 0]
                want, cut = (settled[:min(cuts)], True) if cuts else (want, False)
        assert "".join(sent) == want and text.stopped == cut, (stops, decode(ids), sent)
