"""A request's life on the server: every client that leaves aborts its request, and admission counts slots.

The engine's steps are slowed to a few milliseconds each (serving_support.slowed), so a
request is surely still running when its client leaves. Each test ends with every KV
block back in the pool.
"""
from __future__ import annotations

import json
import socket
import time

import httpx

from models import random_prompts
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
