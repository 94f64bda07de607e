"""A request's life on the server: every client that leaves aborts its request, and admission counts slots.

The engine's steps are slowed to a few milliseconds each (serving_support.slowed), so a
request is surely still running when its client leaves. Each test ends with every KV
block back in the pool.
"""
from __future__ import annotations

import json
import queue
import socket
import threading
import time

import httpx
import openai
import pytest

from models import random_prompts
from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams
from minillm.scheduler import SchedulerConfig
from minillm.serving.engine_loop import Accepted, EngineLoop, Rejected
from serving_support import (NAME, assert_no_block_leaked, metric, model, post_bytes, raw_http,  # noqa: F401
                             running_tokens, start, tokenizer, wait_until)

ABORTED = 'minillm:request_success_total{finished_reason="abort"}'


def test_a_non_streamed_request_whose_client_leaves_is_aborted_within_a_step(model, tokenizer):
    """The client sends a 100-token request without `stream`, waits for a few tokens, and hangs up. Its request
    ends "abort" at once, long before its 100th token, and its blocks return to the pool."""
    finished = []
    with start(model, tokenizer, step_delay=0.02, on_finished=finished.append) as server:
        body = json.dumps({"model": NAME, "prompt": random_prompts(1, [10])[0], "max_tokens": 100,
                           "ignore_eos": True, "temperature": 0}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(post_bytes("/v1/completions", body))
            wait_until(lambda: sum(running_tokens(server)) >= 5, what="the request's 5th token")
            left_at, tokens_then = time.perf_counter(), running_tokens(server)[0]
        wait_until(lambda: finished, timeout=10, what="the request's end")
        (out,) = finished
        assert out.finish_reason == "abort", f"the request ran on to {len(out.output_token_ids)} tokens"
        late = len(out.output_token_ids) - tokens_then
        assert late <= 3, f"{late} tokens were generated after the client left (one step's worth is 1)"
        assert out.metrics.finished_time - left_at < 0.5
        assert_no_block_leaked(server)
        assert metric(httpx.get(server.url + "/metrics").text, ABORTED) == 1.0


@pytest.mark.parametrize("max_num_seqs, max_queue, burst, admitted", [
    (2, 0, 3, 2),    # --max-queue 0: what the two free slots take, and nothing more
    (2, 4, 20, 6),   # two slots, four waiting: six of a burst of 20
    (1, 2, 5, 3),
    (8, 0, 5, 5),    # more slots than requests: none is refused
])
def test_admission_counts_free_slots_then_max_queue_waiting(model, max_num_seqs, max_queue, burst, admitted):
    """With the engine thread held between steps, a burst arrives at once: every request a free batch slot will
    take is admitted, then exactly `max_queue` more, and the rest get 429 (an off-by-one shows here, not in a
    race over HTTP)."""
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs), num_blocks=64)
    loop = EngineLoop(engine, max_queue=max_queue)
    try:
        release, held = threading.Event(), threading.Event()
        blocker = loop.call(lambda e: (held.set(), release.wait(30)))
        assert held.wait(30)
        boxes = [queue.SimpleQueue() for _ in range(burst)]
        for i, box in enumerate(boxes):
            loop.submit(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), time.perf_counter(), box.put)
        release.set()
        blocker.result(timeout=30)
        first = [box.get(timeout=30) for box in boxes]
        assert [type(f) for f in first] == [Accepted] * admitted + [Rejected] * (burst - admitted), first
        assert all(f.status == 429 and f"--max-queue={max_queue}" in f.message for f in first[admitted:])
    finally:
        loop.stop(timeout=30, close=True)


def test_max_queue_0_serves_a_request_on_an_idle_server(model, tokenizer):
    with start(model, tokenizer, max_queue=0, max_num_seqs=2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=3).usage.completion_tokens == 3
