"""Shutdown keeps its word: `python -m minillm serve`, sent SIGTERM with 20 streams open.

The server runs in a process of its own, on a checkpoint folder written here: the
tiny shape with a context of 1,024 tokens, so that 20 streams of 900 tokens are
surely still running when the signal comes and after the --shutdown-timeout it
grants them.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serving_support import free_port

from minillm.checkpoints.load import random_model, save_pretrained
from minillm.config import PRESETS

STREAMS, MAX_TOKENS, GRACE_S = 20, 900, 1.0


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ctx1024")
    config = PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "n_ctx": 1024})
    save_pretrained(random_model(config, "cpu", "fp32"), folder)
    return folder


def serve(folder, port, tmp_path, *flags) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--port", str(port),
                             "--num-gpu-blocks-override", "1400", "--request-log", str(tmp_path / "requests.jsonl"),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def read_stream(url: str, record: dict) -> None:
    """One streamed request; `record` gets each data line with the time it arrived."""
    body = {"prompt": "hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    record["events"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            record["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    record["events"].append((time.monotonic(), line[5:].strip()))
    except httpx.HTTPError as e:
        record["error"] = f"{type(e).__name__}: {e}"


def test_sigterm_ends_every_open_stream_with_abort_then_done_and_exits_0(long_context_checkpoint, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(long_context_checkpoint, port, tmp_path, "--shutdown-timeout", str(GRACE_S))
    try:
        records = [{} for _ in range(STREAMS)]
        threads = [threading.Thread(target=read_stream, args=(url, r)) for r in records]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(len(r.get("events", ())) >= 2 for r in records):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.01)
        with httpx.Client(base_url=url, timeout=10) as open_connection:
            assert open_connection.get("/health").status_code == 200  # a keep-alive connection, opened before
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            late = open_connection.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        fresh = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for refused in (late, fresh):  # while draining: 503 in OpenAI's shape, on an open connection or a new one
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "shutting down" in refused.json()["error"]["message"]
    for r in records:
        assert r.get("status") == 200 and "error" not in r, r.get("error")
        events = [data for _, data in r["events"]]
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-3])["choices"][0]
        usage = json.loads(events[-2])["usage"]
        assert last["finish_reason"] == "abort" and 0 < usage["completion_tokens"] < MAX_TOKENS
        granted = [t for t, data in r["events"] if t > signalled]
        assert granted[-1] - signalled >= GRACE_S * 0.9, "aborted before --shutdown-timeout passed"
    assert "Traceback" not in log and "CancelledError" not in log, log
    aborted = [line for line in log.splitlines() if "aborted (the server is shutting down" in line]
    assert len(aborted) == STREAMS, log
    records_logged = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sorted(x["finish_reason"] for x in records_logged) == ["abort"] * STREAMS


def test_sigterm_ends_the_engine_events_feed_with_an_end_event_and_no_traceback(long_context_checkpoint, tmp_path):
    """A watcher of /v1/engine/events, a feed that never ends by itself, gets an `end` event when the server
    is told to stop, and its stream closes; uvicorn need not cancel it (which it logs as a traceback)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(long_context_checkpoint, port, tmp_path, "--shutdown-timeout", "0")
    kinds = []
    try:
        with httpx.stream("GET", url + "/v1/engine/events", timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("event:"):
                    kinds.append(line[6:].strip())
                    if kinds[-1] == "ceilings":  # the feed is past its start: now in its loop over steps
                        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert kinds[:2] == ["engine", "ceilings"] and kinds[-1] == "end", kinds
    assert "Traceback" not in log and "CancelledError" not in log, log
