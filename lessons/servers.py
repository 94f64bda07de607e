"""Lesson 12's servers: `python -m minillm serve` in processes of their own on 127.0.0.1, and their request logs.

Each server logs the engine's own record of every finished request (`--request-log`), so the lesson can set
its client's timings beside the engine's. On a CPU each server gets one torch thread: the servers and the client
share the cores.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import REPO_ROOT
from minillm.device import resolve_device


def read_records(log: Path) -> dict:
    """The engine's record of each finished request, by id, as the server logged it (--request-log)."""
    return {r["id"]: r for r in map(json.loads, log.read_text().splitlines())} if log.exists() else {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, chunked: bool, budget: int, log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m minillm serve` in a process of its own; returns it and its URL once /health answers."""
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", args.model, "--device", args.device, "--dtype",
           args.dtype, "--port", str(port), "--max-num-seqs", "32", "--max-num-batched-tokens", str(budget),
           "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill", "--num-gpu-blocks-override",
           "1024", "--max-queue", "4096", "--request-log", str(log)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if resolve_device(args.device).type == "cpu":  # the servers and the client share the cores
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not answer /health within 180 s")
        time.sleep(0.2)


@contextlib.contextmanager
def servers(args, budgets: dict[str, tuple[bool, int]], logs: Path):
    """One server per name, {name: (chunked, max_num_batched_tokens)}, each in a process of its own, logging its
    requests to `logs/<name>.jsonl`: {name: URL}; every one is stopped however the block ends."""
    procs = []
    try:
        urls = {}
        for name, (chunked, budget) in budgets.items():
            proc, urls[name] = launch(args, chunked, budget, logs / f"{name}.jsonl")
            procs.append(proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
