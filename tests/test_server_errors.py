"""Every error a client can cause is a 4xx in OpenAI's shape; only a fault of the server is a 5xx.

    {"error": {"message": <one line>, "type": <e.g. "BadRequestError">, "param": <the field or null>,
               "code": <the status>}}

One server takes every fault in turn, through the official `openai` client where the
client can send it, and as raw bytes where it cannot (invalid UTF-8, a lone surrogate,
a body cut short). After all of them the server still serves, no KV block is held,
and its log holds no traceback.
"""
from __future__ import annotations

import json
import logging
import socket

import httpx
import openai
import pytest

from serving_support import (NAME, assert_no_block_leaked, model, post_bytes, raw_http, start,  # noqa: F401
                             tokenizer)

from minillm.serving.errors import MAX_BODY_BYTES


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with start(model, tokenizer) as s:
        yield s


@pytest.fixture
def server_log():
    """Every record the server's loggers write while the test runs (uvicorn's own, and minillm's)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "minillm.server")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def assert_openai_shape(body: dict, status: int, kind: str, param: str | None) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["code"], error["type"], error["param"]) == (status, kind, param), error
    assert error["message"] and "\n" not in error["message"]
    return error["message"]


CLIENT_FAULTS = [  # (what the client sends, status, the openai exception, param, a phrase of the message)
    (dict(model="gpt-4"), 404, openai.NotFoundError, "model", "'gpt-4' does not exist"),
    (dict(prompt=list(range(200))), 400, openai.BadRequestError, "prompt", "n_ctx=128"),
    (dict(max_tokens=500), 400, openai.BadRequestError, "max_tokens", "lower max_tokens to at most 125"),
    (dict(max_tokens=0), 400, openai.BadRequestError, "max_tokens", "max_tokens=0 must be ≥ 1"),
    (dict(top_p=1.5), 400, openai.BadRequestError, "top_p", "top_p=1.5 must be in (0, 1]"),
    (dict(temperature=-1), 400, openai.BadRequestError, "temperature", "temperature=-1"),
    (dict(temperature="hot"), 400, openai.BadRequestError, "temperature", 'is "hot"; it must be a valid number'),
    (dict(prompt=[1, 2, 999]), 400, openai.BadRequestError, "prompt", "outside the vocabulary"),
    (dict(prompt=[1, True]), 400, openai.BadRequestError, "prompt[1]", "is true; it must be a valid integer"),
    (dict(prompt=[[1, 2], [3, 999]]), 400, openai.BadRequestError, "prompt[1]", "prompt[1]: token id 999"),
    (dict(prompt=["ab", ""]), 400, openai.BadRequestError, "prompt[1]", "prompt[1]: the prompt is empty"),
    (dict(prompt=[]), 400, openai.BadRequestError, "prompt", "the prompt is empty"),
    (dict(max_tokens=True), 400, openai.BadRequestError, "max_tokens", "is true; it must be a valid integer"),
    (dict(max_tokens=2.5), 400, openai.BadRequestError, "max_tokens", "is 2.5"),
    (dict(seed=-1), 400, openai.BadRequestError, "seed", "seed=-1"),
    (dict(n=0), 400, openai.BadRequestError, "n", "n=0 must be ≥ 1"),
    (dict(n=2, extra={"best_of": 3}), 400, openai.BadRequestError, "best_of", "best_of=3 with n=2"),
    (dict(n=9), 400, openai.BadRequestError, "n", "n=9 samples run side by side, but max_num_seqs=8"),
    (dict(logprobs=21), 400, openai.BadRequestError, "logprobs", "logprobs=21 is over this server's limit of 20"),
    (dict(logprobs=-1), 400, openai.BadRequestError, "logprobs", "logprobs=-1 must be in [0, 20]"),
    (dict(logprobs=True), 400, openai.BadRequestError, "logprobs", "logprobs=true is a boolean"),
    (dict(echo="yes"), 400, openai.BadRequestError, "echo", "must be a valid boolean"),
    (dict(presence_penalty=2.5), 400, openai.BadRequestError, "presence_penalty",
     "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(extra={"frequency_penalty": -3}), 400, openai.BadRequestError, "frequency_penalty",
     "frequency_penalty=-3 must be in [-2, 2]"),
    (dict(extra={"min_tokens": 9}), 400, openai.BadRequestError, "min_tokens", "at most max_tokens"),
    (dict(extra={"logit_bias": {"1": 5}}), 400, openai.BadRequestError, "logit_bias", "logit_bias is not supported"),
    (dict(extra={"prompt_logprobs": 1}), 400, openai.BadRequestError, "prompt_logprobs", "echo: true and logprobs"),
    (dict(stop=[999]), 400, openai.BadRequestError, "stop", "stop token id 999"),
    (dict(stop=[-1]), 400, openai.BadRequestError, "stop", "stop token id=-1 must be ≥ 0"),
    (dict(stop=[5], extra={"stop_token_ids": [998]}), 400, openai.BadRequestError, "stop_token_ids",
     "stop token id 998"),
    (dict(stop_token_ids=[True]), 400, openai.BadRequestError, "stop_token_ids[0]", "must be a valid integer"),
    (dict(stream="yes"), 400, openai.BadRequestError, "stream", 'is "yes"; it must be a valid boolean'),
    (dict(stream=True, stream_options={"include_usage": "yes"}), 400, openai.BadRequestError,
     "stream_options.include_usage", "must be a valid boolean"),
    (dict(prompt=None), 400, openai.BadRequestError, "prompt", "is null"),
    (dict(max_tokens=10**40), 400, openai.BadRequestError, "max_tokens", "lower max_tokens"),
    (dict(seed=2**64), 400, openai.BadRequestError, "seed", "seed=18446744073709551616"),
    (dict(top_k=-2), 400, openai.BadRequestError, "top_k", "top_k=-2"),
    (dict(stop="x", n=1.0), 400, openai.BadRequestError, "n", "is 1.0; it must be a valid integer"),
    (dict(extra={"repetition_penalty": 0}), 400, openai.BadRequestError, "repetition_penalty",
     "repetition_penalty=0 must be > 0"),
]


@pytest.mark.parametrize("fault, status, exception, param, phrase", CLIENT_FAULTS,
                         ids=[json.dumps(c[0])[1:-1][:40] for c in CLIENT_FAULTS])
def test_the_openai_client_gets_each_error_in_openais_shape(server, server_log, fault, status, exception, param,
                                                            phrase):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    request = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4,
               **{k: v for k, v in fault.items() if k != "extra"}, **fault.get("extra", {})}
    known = {k: request.pop(k) for k in ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "n",
                                         "logprobs", "echo", "presence_penalty", "stop", "stream", "stream_options")
             if k in request}
    with pytest.raises(exception) as caught:
        client.completions.create(**known, extra_body=request or None)
    e = caught.value
    assert e.status_code == status and e.param == param
    message = assert_openai_shape(e.response.json(), status, type(e).__name__, param)
    assert phrase in message, message
    assert client.completions.create(model=NAME, prompt=[4, 5], max_tokens=2).usage.completion_tokens == 2
    assert_no_block_leaked(server)
    assert not [r for r in server_log if r.exc_info], [r.getMessage() for r in server_log]


RAW_FAULTS = [  # (the request's bytes, status, type, param, a phrase of the message)
    (post_bytes("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'), 400, "BadRequestError",
     "prompt", "lone surrogate, '\\ud800', at character 1"),
    (post_bytes("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}'), 400, "BadRequestError",
     "stop[0]", "lone surrogate"),
    (post_bytes("/v1/completions", b'{"model": "\\ud800"}'), 400, "BadRequestError", "model", "lone surrogate"),
    (post_bytes("/v1/completions", b'{"prompt": "caf\xe9"}'), 400, "BadRequestError", None,
     "byte 0xe9 at offset 15"),
    (post_bytes("/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400, "BadRequestError", None,
     "nests arrays or objects deeper"),
    (post_bytes("/v1/completions", b'{"prompt": [1, 2'), 400, "BadRequestError", None, "not valid JSON"),
    (post_bytes("/v1/completions", b'{"prompt": [1], "temperature": NaN}'), 400, "BadRequestError", None,
     "NaN is not a JSON number"),
    (post_bytes("/v1/completions", b'[{"prompt": [1]}]'), 400, "BadRequestError", None,
     "the body is an array, not a JSON object"),
    (post_bytes("/v1/completions", b'{"prompt": [1], "temperature": 1e999}'), 400, "BadRequestError", "temperature",
     "temperature=inf must be a finite number"),
    (post_bytes("/v1/completions", b"null"), 400, "BadRequestError", None, "the body is null, not a JSON object"),
    (post_bytes("/v1/completions", b'{"max_tokens": 2}'), 400, "BadRequestError", "prompt", "prompt is required"),
    (post_bytes("/v1/completions", b"", method="GET"), 405, "MethodNotAllowedError", None,
     "/v1/completions takes POST, not GET"),
    (post_bytes("/v1/chat/completion", b"{}"), 404, "NotFoundError", None, "there is no /v1/chat/completion"),
    (post_bytes("/v1/completions", b"{}").replace(b"Content-Length: 2", f"Content-Length: {MAX_BODY_BYTES + 1}"
                                                  .encode()), 413, "RequestTooLargeError", None,
     f"over {MAX_BODY_BYTES} bytes"),  # answered from the header, before the body is read
    (post_bytes("/v1/completions", b'{"prompt": [1], "n": 1' + b"0" * 5000 + b"}"), 400, "BadRequestError", None,
     "a number Python will not read"),
]


@pytest.mark.parametrize("data, status, kind, param, phrase", RAW_FAULTS,
                         ids=["surrogate-prompt", "surrogate-stop", "surrogate-model", "latin-1", "deep", "cut-json",
                              "nan", "array", "1e999", "null", "missing", "get", "no-route", "too-large", "5000-digits"])
def test_raw_bytes_get_each_error_in_openais_shape(server, server_log, data, status, kind, param, phrase):
    head, _, body = raw_http(server.url, data).partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    assert b"content-type: application/json" in head.lower()
    message = assert_openai_shape(json.loads(body), status, kind, param)
    assert phrase in message, message
    assert not [r for r in server_log if r.exc_info], [r.getMessage() for r in server_log]


def test_a_client_that_hangs_up_mid_body_costs_nothing(server, server_log):
    """Content-Length promises 200 bytes, 20 come, and the client leaves: nothing reaches the engine, nothing
    is logged, and the next request is served."""
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b'Content-Length: 200\r\n\r\n{"prompt": [1, 2, 3],')
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert_no_block_leaked(server)
    assert not [r for r in server_log if r.levelno >= logging.WARNING], [r.getMessage() for r in server_log]


def test_a_fault_of_the_server_is_a_500_in_the_same_shape(model, tokenizer):
    """A step that raises fails the request it ran: 500 InternalServerError when not streamed, an error event
    when streamed, and the server goes on."""
    with start(model, tokenizer) as server:
        engine_step = server.serving.loop.engine.step
        fail_next = []

        def failing_step():
            if fail_next:
                raise fail_next.pop()
            return engine_step()

        server.serving.loop.engine.step = failing_step
        fail_next.append(RuntimeError("the GPU fell off the bus"))
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        assert "the GPU fell off the bus" in assert_openai_shape(r.json(), 500, "InternalServerError", None)
        fail_next.append(RuntimeError("the GPU fell off the bus"))
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": [1, 2], "max_tokens": 2, "stream": True}) as s:
            events = [line[5:].strip() for line in s.iter_lines() if line.startswith("data:")]
        assert_openai_shape(json.loads(events[-1]), 500, "InternalServerError", None)
        assert httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                          timeout=30).status_code == 200
        assert_no_block_leaked(server)
