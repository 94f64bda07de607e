"""The lessons' servers. Lesson 12's: `python -m minillm serve` in processes of their own on 127.0.0.1, and their
request logs; lesson 15's: engines in worker processes, colocated and disaggregated (`start_workers`).

Each server logs the engine's own record of every finished request (`--request-log`), so the lesson can set
its client's timings beside the engine's (`http_cost`), and read its step costs from them (`step_costs`). On a CPU each server gets one torch thread: the servers and the client
share the cores.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import statistics
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import REPO_ROOT, ms
from minillm.bench.disagg import build_model
from minillm.bench.serve import benchmark
from minillm.bench.workloads import Request, Workload
from minillm.device import resolve_device
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from minillm.serving.disaggregated import WorkerConfig, Workers, split_cores


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


def step_costs(url: str, log: Path, work: Workload, s: dict, n_streams: int) -> dict:
    """What the served engine's own records show, through the unchunked server: a decode step of `n_streams`
    sequences (the median gap between their tokens), the long prompt's prefill served alone, each the least of
    3 rounds (a cost: load only ever adds to it), and the capacity: requests per second when the whole trace
    is sent at once."""
    def served(requests):
        results, duration = asyncio.run(benchmark(url, requests, show_progress=False))
        records = read_records(log)
        return [records[r.id] for r in results], duration

    decode, prefill = [], []
    for i in range(3):
        streams, _ = served([Request([1 + i + j] * s["short"], 32) for j in range(n_streams)])
        decode.append(statistics.median(b - a for rec in streams
                                        for a, b in zip(rec["token_times"][1:], rec["token_times"][2:])))
        (rec,), _ = served([Request([2 + i] * s["long"], 1)])
        prefill.append(rec["token_times"][0] - rec["arrival"])
    burst, duration = served(work.requests(float("inf")))
    return {"decode": min(decode), "prefill_long": min(prefill), "capacity": len(burst) / duration}


def http_cost(results, records: dict) -> dict:
    """Client against engine for the same requests: TTFT difference, and each token's delivery delay."""
    ttft, delay, client_itl, engine_itl = [], [], [], []
    for r in results:
        rec = records.get(r.id)
        if not (r.success and rec and len(rec["token_times"]) == len(r.token_times)):
            continue
        ttft.append(r.ttft - (rec["token_times"][0] - rec["arrival"]))
        delay += [c - e for c, e in zip(r.token_times, rec["token_times"])]
        client_itl += r.itls
        engine_itl += [b - a for a, b in zip(rec["token_times"], rec["token_times"][1:])]
    q = lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    return {"requests": len(ttft), "ttft_added_p50_s": q(ttft, 50), "delivery_p50_s": q(delay, 50),
            "delivery_p99_s": q(delay, 99), "client_itl_p50_s": q(client_itl, 50), "engine_itl_p50_s": q(engine_itl, 50),
            "client_itl_p99_s": q(client_itl, 99), "engine_itl_p99_s": q(engine_itl, 99)}


NEEDED_CORES = 2  # the client and the server it is timing run at once, and each needs a core of its own


def free_cores(load) -> float | None:
    """Cores' worth of CPU that other programs left free over the lesson (None: unknown on this system)."""
    return None if load.share is None else load.cores * (1 - load.share)


def starved(load, itl_target_s: float) -> str:
    """Why the sweep cannot decide the claim, or "": when other programs leave fewer free cores than the client
    and the server need, the OS shares a core between them in time slices of milliseconds, as long as the ITL
    target, and goodput then measures the OS's scheduler rather than the engine's."""
    free = free_cores(load)
    if free is None or free >= NEEDED_CORES - 0.5:
        return ""
    return (f"other programs left {free:.1f} of the {load.cores} cores free while this lesson measured, and the "
            f"client and the server need {NEEDED_CORES}: the OS's time slices (milliseconds) then stall tokens as "
            f"long as the ITL target {ms(itl_target_s)}, so the sweep times the OS's scheduler, not the engine's; "
            f"rerun on a quieter machine")


def start_workers(args, config, device: str, names: list[str]) -> dict[str, Workers]:
    """Lesson 15's three servers, each in processes of its own, built from the same seeded model: colocated on
    both cores with 1 and with 2 threads, and disaggregated (a prefill and a decode worker, one core each)."""
    factory = functools.partial(build_model, args.model, device, args.dtype)
    first, second = split_cores()
    both = sorted(first + second)
    # the engine's default budget: a long prompt shares one step with the decodes
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16)
    cache = CacheConfig(num_gpu_blocks_override=256)  # 4,096 tokens of KV per worker: every request of a round at once
    gpu = device.startswith("cuda")
    coloc = functools.partial(WorkerConfig, sched, cache, device=device, cores=both)
    return dict(zip(names, [Workers.colocated(factory, config, coloc()),
                            Workers.colocated(factory, config, coloc(threads=2)),
                            Workers.disaggregated(factory, config,
                                                  WorkerConfig(sched, cache, device="cuda:0" if gpu else device,
                                                               cores=first),
                                                  WorkerConfig(sched, cache, device="cuda:1" if gpu else device,
                                                               cores=second))]))
