"""What an adversary who has read the server found: a value that turns one request's logits to NaN, and a
step that fails for one request failing every other stream beside it.

The tiny server (tests/serving_support.py); each test runs an innocent stream beside the hostile request
and asks that it end as it would alone, with no block left behind.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

import minillm.engine
from minillm.sampling import NonFiniteLogitsError
from serving_support import assert_no_block_leaked, model, start, tokenizer, wait_until  # noqa: F401


def innocent_stream(url: str, lines: list) -> threading.Thread:
    """A stream of 40 tokens on a thread; its data lines land in `lines`."""
    def run():
        body = {"prompt": [1, 2], "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def finish_reasons(lines: list) -> list:
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e308, 1e39])
def test_a_repetition_penalty_that_overflows_the_logits_is_a_400_and_harms_no_other_stream(model, tokenizer,
                                                                                           penalty, caplog):
    with start(model, tokenizer, step_delay=0.01) as server:
        lines = []
        thread = innocent_stream(server.url, lines)
        wait_until(lambda: server.serving.loop.num_running == 1, what="the innocent stream running")
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": [5, 6, 5, 6], "repetition_penalty": penalty, "max_tokens": 4})
        thread.join()
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "repetition_penalty" and f"{penalty:g}" in error["message"], error
        assert finish_reasons(lines) == ["length"], lines[-3:]
        assert "Traceback" not in caplog.text
        assert_no_block_leaked(server)


def test_a_step_that_fails_for_one_request_fails_only_that_request(model, tokenizer, monkeypatch, caplog):
    """The engine aborts only the rows whose logits are not finite; the server tells only their clients."""
    sample = minillm.engine.sample_sequences

    def poisoned(logits, samplers, eos):  # the request seeded 666 draws from NaN logits
        bad = [i for i, s in enumerate(samplers) if s.params.seed == 666]
        if bad:
            raise NonFiniteLogitsError(bad)
        return sample(logits, samplers, eos)
    monkeypatch.setattr(minillm.engine, "sample_sequences", poisoned)
    with start(model, tokenizer, step_delay=0.01) as server:
        lines = []
        thread = innocent_stream(server.url, lines)
        wait_until(lambda: server.serving.loop.num_running == 1, what="the innocent stream running")
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": [5, 6], "seed": 666, "max_tokens": 4})
        thread.join()
        assert r.status_code == 500 and "NonFiniteLogitsError" in r.json()["error"]["message"], r.text
        assert finish_reasons(lines) == ["length"], lines[-3:]
        assert_no_block_leaked(server)


def test_a_request_failing_alone_leaves_nothing_behind(model, tokenizer, monkeypatch):
    sample = minillm.engine.sample_sequences

    def poisoned(logits, samplers, eos):
        bad = [i for i, s in enumerate(samplers) if s.params.seed == 666]
        if bad:
            raise NonFiniteLogitsError(bad)
        return sample(logits, samplers, eos)
    monkeypatch.setattr(minillm.engine, "sample_sequences", poisoned)
    with start(model, tokenizer) as server:
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"prompt": [5, 6], "seed": 666, "n": 2, "max_tokens": 4, "stream": stream})
            assert ("NonFiniteLogitsError" in r.text) and (r.status_code == (200 if stream else 500)), r.text
            assert_no_block_leaked(server)
        assert httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200


WRONG_ITEMS = [  # (endpoint, a body whose list holds 300,000 items of the wrong type, the param named)
    ("/v1/completions", {"prompt": [1.5] * 300_000}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1] * 299_999 + [1.5]}, "prompt[299999]"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": ["x"] * 300_000}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "a", "stop": [True] * 300_000}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [5] * 300_000}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [5] * 300_000}]}, "messages[0].content[0]"),
    ("/detokenize", {"tokens": [None] * 300_000}, "tokens[0]"),
]


@pytest.mark.parametrize("path, body, param", WRONG_ITEMS, ids=[p for _, _, p in WRONG_ITEMS])
def test_a_list_of_wrong_items_is_one_error_naming_the_first(model, tokenizer, path, body, param):
    """Validation stops at a list's first wrong item: a million of them cost one error, not a million Python
    dicts built with the GIL held (seconds in which no other stream moves)."""
    from pydantic import ValidationError
    from minillm.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
    kind = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
            "/detokenize": DetokenizeRequest}[path]
    with pytest.raises(ValidationError) as caught:
        kind.model_validate({"prompt": "a", **body} if "messages" in body else body, strict=True)
    assert caught.value.error_count() <= 4, caught.value.error_count()  # one per branch of a union
    with start(model, tokenizer) as server:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("messages, phrase", [(60_000, "60000 messages"), (100, "characters as rendered")])
def test_messages_that_render_past_the_context_are_refused_before_tokenizing(model, tokenizer, monkeypatch,
                                                                           messages, phrase):
    """60,000 empty messages are 0 characters of content, but the template renders each with its markers:
    1.7 million characters. More messages than the context has tokens are refused before rendering; fewer
    that render past it are counted as rendered and refused, never tokenized (a GIL-bound pass over
    megabytes, in which no other stream moves)."""
    from minillm.serving.chat_template import ChatTemplate
    from test_server_chat import CHATML
    encoded = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k))
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "x" * 10}] * messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and phrase in error["message"], error
        assert max(encoded, default=0) < 100_000, f"tokenized {max(encoded)} characters before refusing"
        assert httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
        assert_no_block_leaked(server)


@pytest.mark.parametrize("fields", [{"stop_token_ids": list(range(512))},
                                    {"stop": list(range(511)), "stop_token_ids": [511]},
                                    {"stop_token_ids": list(range(511)) + [511], "top_k": 1}])
def test_min_tokens_with_every_token_a_stop_is_a_400_not_nan_logits(model, tokenizer, fields):
    """min_tokens masks every stop token until it is met: with all 512 tokens stops, no token is left."""
    with start(model, tokenizer) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": "a", "min_tokens": 5, "max_tokens": 8, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "min_tokens" and "all 512 tokens" in error["message"], error
        assert httpx.post(server.url + "/v1/completions", timeout=30, json={
            "prompt": "a", "min_tokens": 5, "max_tokens": 8, "stop_token_ids": list(range(511))}).status_code == 200
        assert_no_block_leaked(server)


def test_shutdown_with_clients_that_read_nothing_logs_no_traceback(model, tokenizer, caplog):
    import logging
    """Streams whose clients stopped reading cannot send their last bytes: the shutdown lets those clients
    go (as if they had left), so their handlers end instead of being cancelled by uvicorn, which logs each
    cancellation with a traceback."""
    import socket
    from serving_support import post_bytes
    body = json.dumps({"prompt": [1] * 120, "n": 64, "echo": True, "logprobs": 20, "max_tokens": 1,
                       "stream": True}).encode()  # about 4 MB of events: more than the sockets buffer
    clients = []
    logging.getLogger("uvicorn").addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    with start(model, tokenizer, max_num_seqs=64, num_blocks=1024) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(3):
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect((host, int(port)))
            client.sendall(post_bytes("/v1/completions", body))
            clients.append(client)
        connections = server.server.server_state.connections
        wait_until(lambda: len(connections) == 3 and all(c.cycle is not None and c.cycle.flow.write_paused
                                                          for c in list(connections)),
                   what="three answers waiting on clients that read nothing")
    logging.getLogger("uvicorn").removeHandler(caplog.handler)
    for client in clients:
        client.close()
    assert "Traceback" not in caplog.text and "Exception in ASGI application" not in caplog.text, caplog.text[-2000:]
