"""A worker process: one `LLMEngine` (and, disaggregated, its KV connector) serving a router's commands.

    WorkerConfig(scheduler_config, cache_config, device, cores, threads)   one worker's engine, and where it runs

`run_worker` is a process's whole life: pin to its cores, build the model with
the router's picklable `factory` (so every worker holds the same weights), join
the torch.distributed group of a prefill and a decode worker, then serve. Its
loop (`serve_commands`) takes commands from its inbox queue (add, abort, stats,
stop), steps the engine while it holds a request, and puts what came out on the
one outbox queue: each step's outputs with the engine's `stats()` (the router
reads the decoding worker's blocks from them), a prefill's first tokens, a
rejection, a failed step. The router is `disaggregated.py`.

    cost per step: one put of the step's outputs and an EngineStats (a few counts) on the outbox

Invariant held by the tests: a step that raises fails its requests and the
worker goes on serving; on "stop" the prefill worker's closing header ends the
decode worker's receiver, and no block is left held.
"""
from __future__ import annotations

import os
import queue
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from ..kv_pool import CacheConfig
from ..scheduler import SchedulerConfig

# Every receive of the group waits this long at most, and the decode worker's receiver waits for the next header as
# long as the server is idle: a week, not gloo's default of 30 minutes. A worker that dies is noticed by the router.
GROUP_TIMEOUT = timedelta(days=7)


@dataclass
class WorkerConfig:
    """One worker's engine and where it runs."""
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    device: str = "cpu"
    cores: list[int] | None = None  # os.sched_setaffinity; None: every core this process may use
    threads: int = 1                # torch threads


def split_cores() -> tuple[list[int], list[int]]:
    """Two disjoint halves of the cores this process may use, for the prefill and the decode worker."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError(f"disaggregation pins its two workers to separate cores, and this process may use only "
                           f"{cpus}; run it where at least 2 cores are available")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def run_worker(role: str, factory: Callable, cfg: WorkerConfig, init_method: str | None, inbox, outbox) -> None:
    """A worker's whole life: pin, build, join the group, then serve commands until ("stop",)."""
    try:
        if cfg.cores is not None:
            os.sched_setaffinity(0, cfg.cores)
        from ..device import set_num_threads
        set_num_threads(cfg.threads)
        from ..engine import LLMEngine
        engine = LLMEngine(factory(), cfg.scheduler_config, cfg.cache_config)
        connector = None
        if role != "colocated":
            import torch.distributed as dist
            from .. import kv_connector as kv
            from ..kv_consumer import KVConsumer
            from ..kv_producer import KVProducer
            dist.init_process_group(kv.backend_for(cfg.device), init_method=init_method,
                                    rank=kv.PREFILL_RANK if role == "prefill" else kv.DECODE_RANK, world_size=2,
                                    timeout=GROUP_TIMEOUT)
            connector = (KVProducer(engine) if role == "prefill"
                         else KVConsumer(engine, notify=lambda: inbox.put(("kv",))))
        outbox.put(("ready", role, engine.stats()))
        serve_commands(role, engine, connector, inbox, outbox)
    except BaseException:  # the router raises it, naming the worker
        outbox.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)


def serve_commands(role, engine, connector, inbox, outbox) -> None:
    """Take the inbox's commands, step while a request is held (the decode worker first starts what landed), and
    put each step's outputs on the outbox with the engine's stats; return on ("stop",)."""
    while True:
        commands = []
        try:
            if engine.has_unfinished_requests():
                commands.append(inbox.get_nowait())
            elif role == "decode" and connector.waiting_for_room:  # for room, or for a registration in the inbox
                commands.append(inbox.get(timeout=0.005))
            else:
                commands.append(inbox.get())
            while True:
                commands.append(inbox.get_nowait())
        except queue.Empty:
            pass
        for command in commands:
            if command[0] == "stop":
                if connector is not None:
                    import torch.distributed as dist
                    connector.close()  # the producer's closing header ends the consumer's receiver
                    dist.destroy_process_group()
                outbox.put(("stopped", role))
                return
            handle(role, engine, connector, command, outbox)
        outputs = connector.start_load_kv() if role == "decode" else []
        if engine.has_unfinished_requests():
            try:
                stepped = engine.step()
            except Exception as e:  # noqa: BLE001  (the step's requests fail; the worker goes on serving)
                if role == "prefill":
                    connector.wait_for_save(None)
                outbox.put(("failed", role, f"{type(e).__name__}: {e}"))
                continue
            if role == "prefill":
                done = [(o.request_id, o.metrics.token_times[0]) for o in stepped if o.metrics.token_times]
                if done:
                    outbox.put(("prefilled", done))
                connector.wait_for_save(stepped)
                stepped = [o for o in stepped if connector.reports(o)]
            outputs += stepped
        if outputs:
            failures = connector.failures if role == "decode" else {}
            outbox.put(("outputs", outputs, dict(failures), role, engine.stats()))
            failures.clear()


def handle(role, engine, connector, command, outbox) -> None:
    """One command: add a request (through the connector when disaggregated), abort one, or report stats."""
    kind = command[0]
    if kind == "add":
        _, key, prompt, params, request_id, arrival = command
        try:
            if connector is not None:
                connector.add_request(key, prompt, params, request_id, arrival)
            else:
                engine.add_request(prompt, params, request_id, arrival)
        except ValueError as e:
            outbox.put(("rejected", request_id, str(e)))
    elif kind == "abort":
        request_id = command[1]
        if role == "decode":
            if not connector.request_finished(request_id):
                engine.abort_request(request_id)
        else:
            engine.abort_request(request_id)
            if role == "prefill":
                connector.forget(request_id)
    elif kind == "stats":
        engine.check_invariants()
        now = engine.stats()
        stats = {"num_blocks": now.num_blocks, "free_blocks": now.num_free_blocks, "running": now.num_running,
                 "waiting": now.num_waiting}
        if role == "prefill":
            stats |= {"bytes_sent": connector.bytes_sent, "requests_sent": connector.requests_sent}
        elif role == "decode":
            stats |= {"bytes_received": connector.bytes_received, "in_flight": len(connector.in_flight),
                      "expected": len(connector.expected)}
        outbox.put(("stats", role, stats))
