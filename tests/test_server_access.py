"""Who may use the server, and for how long a connection may sit idle.

With an API key (`--api-key`, or $MINILLM_API_KEY), every path but /health and
/metrics needs `Authorization: Bearer <key>`; without it the answer is 401 in
OpenAI's shape. /docs and /openapi.json exist only when asked for. A connection
with no request in progress is closed `--timeout-keep-alive` seconds after it
opened or after its last response, whatever half a request it has sent.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serving_support import NAME, free_port, model, start, tokenizer  # noqa: F401
from test_server_errors import assert_openai_shape

from minillm.serving.api_server import ServerConfig
from minillm.serving.cli import add_serve_arguments

KEY = "sk-minillm-test"


def test_with_an_api_key_only_the_right_bearer_gets_through(model, tokenizer):
    with start(model, tokenizer, server=dict(api_key=KEY)) as server:
        for key in ("wrong", KEY + "x", KEY[:-1]):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2)
            assert "Authorization: Bearer" in assert_openai_shape(caught.value.response.json(), 401,
                                                                   "AuthenticationError", None)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        for path in ("/v1/completions", "/v1/nothing", "/tokenize"):  # no header at all; an unknown path too
            assert httpx.post(server.url + path, json={}).status_code == 401
        assert httpx.post(server.url + "/v1/completions", json={}, headers={"Authorization": KEY}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2).usage.completion_tokens == 2


def test_the_key_comes_from_the_flag_or_else_from_minillm_api_key(monkeypatch):
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    monkeypatch.setenv("MINILLM_API_KEY", "from-env")
    assert ServerConfig.from_args(parser.parse_args([])).api_key == "from-env"
    assert ServerConfig.from_args(parser.parse_args(["--api-key", "from-flag"])).api_key == "from-flag"
    assert "from-flag" not in repr(ServerConfig.from_args(parser.parse_args(["--api-key", "from-flag"])))
    monkeypatch.delenv("MINILLM_API_KEY")
    assert ServerConfig.from_args(parser.parse_args([])).api_key is None


def test_docs_are_off_unless_asked_for(model, tokenizer):
    with start(model, tokenizer) as server:
        for path in ("/docs", "/openapi.json", "/redoc"):
            r = httpx.get(server.url + path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with start(model, tokenizer, server=dict(enable_docs=True)) as server:
        assert httpx.get(server.url + "/docs").status_code == 200
        assert "/v1/completions" in httpx.get(server.url + "/openapi.json").json()["paths"]


def closed_within(url: str, sent: bytes, seconds: float) -> float | None:
    """Connect, send `sent`, and wait: the seconds until the server closed the connection, or None."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as s:
        began = time.monotonic()
        s.sendall(sent)
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            return None
        return time.monotonic() - began


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"], ids=["silent", "half-head"])
def test_a_connection_that_never_completes_a_request_is_closed(model, tokenizer, sent):
    with start(model, tokenizer, server=dict(timeout_keep_alive=0.5)) as server:
        after = closed_within(server.url, sent, seconds=10)
        assert after is not None and after < 5, "the server kept an idle connection open for 10 s"


def test_the_idle_timeout_never_cuts_a_request_in_progress(model, tokenizer):
    """A stream that lasts four times the idle timeout gets every token; the idle keep-alive connection it
    leaves is then closed."""
    with start(model, tokenizer, step_delay=0.02, server=dict(timeout_keep_alive=0.25)) as server:
        with httpx.Client(timeout=30) as client:
            began = time.monotonic()
            with client.stream("POST", server.url + "/v1/completions",
                               json={"prompt": [1, 2], "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            assert time.monotonic() - began > 1.0 and len(events) == 51  # 50 tokens, then [DONE]
            time.sleep(1.0)
            assert client.get(server.url + "/health").status_code == 200  # httpx reconnects: the old one closed


def test_serve_refuses_a_negative_timeout_before_loading_anything():
    out = subprocess.run([sys.executable, "-m", "minillm", "serve", "--model", "tiny", "--port", str(free_port()),
                          "--timeout-keep-alive", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--timeout-keep-alive -1.0 must be a number of seconds ≥ 0" in out.stderr


def test_serve_refuses_zero_threads_before_loading_anything():
    out = subprocess.run([sys.executable, "-m", "minillm", "serve", "--model", "tiny", "--port", str(free_port()),
                          "--threads", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--threads 0 must be at least 1" in out.stderr and "Traceback" not in out.stderr
