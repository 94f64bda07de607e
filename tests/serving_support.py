"""What the server's tests share: a server on a free port around a tiny engine, and ways to look inside it.

Every server runs the context-sensitive tiny model (tests/models.py) on the
CPU. `start(..., step_delay=s)` makes each engine step last at least `s`
seconds, so a test can act while a request is surely still running (a client
leaving, a shutdown) instead of racing a model that finishes in milliseconds.
"""
from __future__ import annotations

import re
import socket
import time

import pytest

from minillm.checkpoints.tokenizer import load_tokenizer
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from minillm.serving.api_server import make_serving
from minillm.serving.launch import BackgroundServer
from minillm.serving.limits import ServerLimits
from models import context_model

NAME = "tiny"


@pytest.fixture(scope="module")
def model():
    return context_model()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(NAME)


def slowed(engine: LLMEngine, step_delay: float) -> LLMEngine:
    """The engine, each of whose steps now lasts at least `step_delay` seconds."""
    step = engine.step

    def slow_step():
        began = time.perf_counter()
        out = step()
        time.sleep(max(0.0, step_delay - (time.perf_counter() - began)))
        return out

    engine.step = slow_step
    return engine


def start(model, tokenizer, max_queue=64, num_blocks=128, step_delay=0.0, on_finished=None, server=None,
          chat_template=None, limits=None, **engine_kwargs) -> BackgroundServer:
    """A BackgroundServer (not yet entered) around a fresh engine; `server` holds ServerConfig fields, `limits`
    ServerLimits fields."""
    sched = {k: engine_kwargs.pop(k) for k in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")
             if k in engine_kwargs}
    cache = {k: engine_kwargs.pop(k) for k in ("block_size", "enable_prefix_caching") if k in engine_kwargs}
    engine = LLMEngine(model, SchedulerConfig(**{"max_num_batched_tokens": 256, "max_num_seqs": 8, **sched}),
                       CacheConfig(num_gpu_blocks_override=num_blocks, **cache), **engine_kwargs)
    if step_delay:
        slowed(engine, step_delay)
    serving = make_serving(engine, tokenizer, NAME, max_queue, on_finished, chat_template=chat_template,
                           limits=ServerLimits(**(limits or {})))
    return BackgroundServer(serving, **(server or {}))


def on_engine(server, fn):
    """Run fn(engine) on the engine's own thread (the only one that may touch it)."""
    return server.serving.loop.call(fn).result(timeout=30)


def wait_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while on_engine(server, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.02)


def assert_no_block_leaked(server) -> None:
    """Idle, whole, and every KV block back in the pool."""
    wait_idle(server)
    on_engine(server, lambda e: e.check_invariants())
    free, total = on_engine(server, lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
    assert free == total, f"{total - free} of {total} KV blocks still held"


def running_tokens(server) -> list[int]:
    """How many tokens each running request has generated so far."""
    return on_engine(server, lambda e: [len(s.output_token_ids) for s in e.scheduler.running])


def wait_until(predicate, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)


def metric(text: str, name: str) -> float:
    """One sample's value from Prometheus text, e.g. metric(t, 'minillm:request_success_total{finished_reason="abort"}')."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_http(url: str, data: bytes, read: bool = True, timeout: float = 30) -> bytes:
    """Send `data` as it is on a fresh connection to the server at `url`; the whole answer, until it closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def post_bytes(path: str, body: bytes, method: str = "POST", headers: str = "") -> bytes:
    """An HTTP/1.1 request with this exact body, asking the server to close after answering."""
    return (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
