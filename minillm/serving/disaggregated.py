"""Engines in worker processes: one colocated engine, or a prefill and a decode worker joined by a KV connector.

    workers = Workers.disaggregated(factory)    # prefill on core 0, decode on core 1, KV over torch.distributed
    workers = Workers.colocated(factory, threads=2)   # one engine on every core: the baseline
    workers.add_request(prompt, SamplingParams(max_tokens=32, temperature=0))
    while workers.has_unfinished_requests():
        for out in workers.step():              # RequestOutput, as LLMEngine.step returns them
            ...
    workers.close()

`factory` is a picklable callable that builds the model in the worker (e.g. a
`functools.partial` of `random_model`), so every worker holds the same weights.
Each worker runs one `LLMEngine` in a loop: commands come in on its inbox queue,
outputs go out on one outbox queue. Disaggregated, the router registers each
request with the decode worker (`KVConsumer.add_request`) before it hands the
prompt to the prefill worker (`KVProducer.add_request`), so the KV's header always
finds its request there. The decode worker's first token of a request is the
prefill worker's, made available when the KV has landed; every later token is
the decode worker's own. Token times are `time.perf_counter()` in the worker that
made them: on Linux one clock (CLOCK_MONOTONIC) for every process.

`Workers` answers what the server's engine thread asks of an `LLMEngine`
(`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `config`, the
queue and block counts, `close`), so `python -m minillm serve --disaggregate`
serves it over the same OpenAI API (`launch.py`). Processes start from a fork
server that imported torch once (a fresh interpreter per worker costs seconds).
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable

from ..sampling_params import FINISH_ABORT, SamplingParams
from ..kv_pool import CacheConfig
from ..scheduler import SchedulerConfig
from ..sequence import CompletionOutput, RequestMetrics, RequestOutput

START_TIMEOUT_S = 300  # a worker must have built its model and joined the group by then (imports on a busy machine)
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


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "minillm.engine", "minillm.kv_producer", "minillm.kv_consumer"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cores() -> tuple[list[int], list[int]]:
    """Two disjoint halves of the cores this process may use, for the prefill and the decode worker."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError(f"disaggregation pins its two workers to separate cores, and this process may use only "
                           f"{cpus}; run it where at least 2 cores are available")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def _worker(role: str, factory: Callable, cfg: WorkerConfig, init_method: str | None, inbox, outbox) -> None:
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
        outbox.put(("ready", role, engine.block_manager.num_blocks))
        _serve(role, engine, connector, inbox, outbox)
    except BaseException:  # the router raises it, naming the worker
        outbox.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)


def _serve(role, engine, connector, inbox, outbox) -> None:
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
            _handle(role, engine, connector, command, outbox)
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
            outbox.put(("outputs", outputs, dict(failures)))
            failures.clear()


def _handle(role, engine, connector, command, outbox) -> None:
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
        stats = {"num_blocks": engine.block_manager.num_blocks, "free_blocks": engine.block_manager.num_free_blocks,
                 "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting)}
        if role == "prefill":
            stats |= {"bytes_sent": connector.bytes_sent, "requests_sent": connector.requests_sent}
        elif role == "decode":
            stats |= {"bytes_received": connector.bytes_received, "in_flight": len(connector.in_flight),
                      "expected": len(connector.expected)}
        outbox.put(("stats", role, stats))


def aborted(out: RequestOutput) -> RequestOutput:
    """`out`, finished: every sample not yet ended ends "abort"."""
    out.finished = True
    for sample in out.outputs:
        sample.finish_reason = sample.finish_reason or FINISH_ABORT
    return out


class Workers:
    """The router: requests in, outputs out, over one colocated worker or a prefill and a decode worker.

    It answers what the server's engine thread asks of an `LLMEngine`, so the HTTP front end serves it as is."""

    def __init__(self, factory: Callable, roles: dict[str, WorkerConfig], config):
        self.config = config  # the model's GPT2Config (the front end reads n_ctx)
        ctx = _context()
        self.roles = roles
        init_method = f"tcp://127.0.0.1:{_free_port()}" if len(roles) == 2 else None
        self._outbox = ctx.Queue()
        self._inboxes = {role: ctx.Queue() for role in roles}
        self._procs = {role: ctx.Process(target=_worker, name=f"minillm-{role}", daemon=True,
                                         args=(role, factory, cfg, init_method, self._inboxes[role], self._outbox))
                       for role, cfg in roles.items()}
        for p in self._procs.values():
            p.start()
        self.requests: dict[str, RequestOutput] = {}  # each unfinished request's latest output, as the engine's
        self._ready: list[RequestOutput] = []
        self.prefilled_at: dict[str, float] = {}  # request_id → when the prefill worker sampled its first token
        self.failures: dict[str, str] = {}         # request_id → why it failed in a worker
        self._next_key = 0
        self._closed = False
        self.step_timeout = START_TIMEOUT_S
        blocks = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(blocks) < len(roles):
            kind, role, *rest = self._get(deadline - time.monotonic())
            if kind == "ready":
                blocks[role] = rest[0]
        self.num_blocks = blocks
        self.scheduler_config = roles["decode" if "decode" in roles else "colocated"].scheduler_config
        self.scheduler = SimpleNamespace(waiting=[], running=[])  # what the server's engine thread counts
        self.block_manager = SimpleNamespace(num_blocks=blocks["decode" if "decode" in blocks else "colocated"],
                                             num_free_blocks=0)

    @classmethod
    def colocated(cls, factory: Callable, config, worker: WorkerConfig | None = None) -> "Workers":
        """One engine doing prefill and decode, in one process (by default on every core, one torch thread)."""
        return cls(factory, {"colocated": worker or WorkerConfig()}, config)

    @classmethod
    def disaggregated(cls, factory: Callable, config, prefill: WorkerConfig | None = None,
                      decode: WorkerConfig | None = None) -> "Workers":
        """A prefill worker and a decode worker, by default each on its own half of the cores."""
        if prefill is None or decode is None:
            p_cores, d_cores = split_cores()
            prefill = prefill or WorkerConfig(cores=p_cores)
            decode = decode or WorkerConfig(cores=d_cores)
        if prefill.device.startswith("cuda") and prefill.device == decode.device:
            raise ValueError(f"NCCL needs a GPU per worker, and both would run on {prefill.device}; give the "
                             "decode worker another (device='cuda:1') or run both on the CPU (gloo)")
        return cls(factory, {"prefill": prefill, "decode": decode}, config)

    # ---- what an engine is asked ----

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Hand a request to the workers; its outputs come from `step()`. Refusals come back as a finished
        output with finish_reason "abort" and the reason in `failures`."""
        if self._closed:
            raise RuntimeError("these workers were closed; start new ones")
        key, self._next_key = self._next_key, self._next_key + 1
        request_id = str(key) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a new one")
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        params = params or SamplingParams()
        if "decode" in self._inboxes:
            from ..kv_connector import check_transferable
            check_transferable(params)
        command = ("add", key, list(prompt_token_ids), params, request_id, arrival)
        for role in ("decode", "prefill", "colocated"):  # the decode worker first: the KV's header must find it
            if role in self._inboxes:
                self._inboxes[role].put(command)
        self.requests[request_id] = RequestOutput(request_id, tuple(command[2]), [CompletionOutput(0, [], None)],
                                                  False, RequestMetrics(arrival))
        self.scheduler.waiting = list(self.requests)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request on every worker; its "abort" output comes from the next `step()`."""
        out = self.requests.pop(request_id, None)
        if out is None:
            return False
        for inbox in self._inboxes.values():
            inbox.put(("abort", request_id))
        out.metrics.finished_time = time.perf_counter()
        self._ready.append(aborted(out))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._ready)

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """The outputs the workers made since the last call; while requests are unfinished, waits for at least
        one, up to `timeout` seconds (by default `step_timeout`: long for a driver, short for a server's thread,
        which must get back to its inbox)."""
        timeout = self.step_timeout if timeout is None else timeout
        outputs, self._ready = self._ready, []
        wait = timeout if self.requests and not outputs else 0.0
        deadline = time.monotonic() + wait
        while True:
            try:
                item = self._get(max(0.0, deadline - time.monotonic()), quiet=True)
            except queue.Empty:
                break
            outputs += self._take(item)
            wait = 0.0
            deadline = time.monotonic()
        self.scheduler.waiting = list(self.requests)
        return outputs

    def _take(self, item) -> list[RequestOutput]:
        kind = item[0]
        if kind == "prefilled":
            self.prefilled_at.update(item[1])
            return []
        if kind == "rejected":
            _, request_id, message = item
            self.failures[request_id] = message
            for inbox in self._inboxes.values():  # the other worker may hold it: drop it there too
                inbox.put(("abort", request_id))
            out = self.requests.pop(request_id, None)
            if out is None:
                return []
            return [aborted(out)]
        if kind == "failed":
            self.failures[f"{item[1]} worker"] = item[2]
            return []
        if kind == "outputs":
            _, outs, failures = item
            self.failures.update(failures)
            kept = []
            for out in outs:
                if out.request_id not in self.requests:
                    continue  # aborted here already: its "abort" was reported then
                self.requests[out.request_id] = out
                if out.finished:
                    del self.requests[out.request_id]
                kept.append(out)
            return kept
        return []

    def _get(self, timeout: float, quiet: bool = False):
        """One item of the outbox; a worker's error, or its death, raises here naming the worker."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._outbox.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in self._procs.items() if not p.is_alive()]
                if dead and not self._closed:
                    raise RuntimeError(f"worker {dead[0][0]} exited with status {dead[0][1]} without a word; "
                                       "see its output above") from None
                if time.monotonic() >= deadline:
                    if quiet:
                        raise
                    raise RuntimeError(f"the workers said nothing for {timeout:.0f} s") from None
                continue
            if item[0] == "error":
                self.close()
                raise RuntimeError(f"the {item[1]} worker failed:\n{item[2]}")
            return item

    def stats(self) -> dict[str, dict]:
        """Each worker's blocks (free of all), queues and bytes moved, after checking its engine's invariants."""
        for inbox in self._inboxes.values():
            inbox.put(("stats",))
        out, pending = {}, []
        while len(out) < len(self._inboxes):
            item = self._get(60)
            if item[0] == "stats":
                out[item[1]] = item[2]
            else:
                pending.append(item)
        for item in pending:  # outputs that came meanwhile: the next step() returns them
            self._ready += self._take(item)
        return out

    def close(self) -> None:
        """Stop every worker (the prefill worker first tells the decode worker's receiver to stop) and join them."""
        if self._closed:
            return
        self._closed = True
        for role in ("prefill", "decode", "colocated"):
            if role in self._inboxes:
                self._inboxes[role].put(("stop",))
        for p in self._procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (torch or multiprocessing already torn down at exit)
            pass


def serve_disaggregated(args, config, device: str) -> Workers:
    """`serve --disaggregate`: the server's engine flags for both workers, each on its own half of the cores."""
    import functools

    from ..bench.disagg import build_model
    if args.enable_prefix_caching:
        raise ValueError("--disaggregate with --enable-prefix-caching: a decode worker cannot hash blocks whose KV "
                         "arrives from elsewhere; drop one of the two flags")
    if args.threads is not None:
        raise ValueError(f"--disaggregate with --threads {args.threads}: each worker takes its own half of the "
                         "cores (split_cores); drop --threads")
    first, second = split_cores()
    sched = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            enable_chunked_prefill=args.enable_chunked_prefill)
    cache = CacheConfig(block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks_override,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    gpu = device.startswith("cuda")
    workers = Workers.disaggregated(
        functools.partial(build_model, args.model, device, args.dtype), config,
        WorkerConfig(sched, cache, "cuda:0" if gpu else device, first),
        WorkerConfig(sched, cache, "cuda:1" if gpu else device, second))
    workers.step_timeout = 0.005  # the server's engine thread takes its inbox between steps
    return workers
