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
Each worker runs one `LLMEngine` in a loop (`worker.py`): commands come in on its
inbox queue, outputs go out on one outbox queue. Disaggregated, the router registers each
request with the decode worker (`KVConsumer.add_request`) before it hands the
prompt to the prefill worker (`KVProducer.add_request`), so the KV's header always
finds its request there. The decode worker's first token of a request is the
prefill worker's, made available when the KV has landed; every later token is
the decode worker's own. Token times are `time.perf_counter()` in the worker that
made them: on Linux one clock (CLOCK_MONOTONIC) for every process.

`Workers` answers what the server's engine thread asks of an `LLMEngine`
(`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `config`,
`stats()`, `close`), so `python -m minillm serve --disaggregate`
serves it over the same OpenAI API (`launch.py`). Processes start from a fork
server that imported torch once (a fresh interpreter per worker costs seconds).

    cost per request: its prompt and params to each worker, its outputs back, pickled through queues

Invariant held by the tests: a request gets exactly the tokens one engine gives
it, and no block is left held on either side, whatever ends it.
"""
from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from typing import Callable

from ..kv_pool import CacheConfig
from ..sampling_params import FINISH_ABORT, SamplingParams
from ..scheduler import SchedulerConfig
from ..sequence import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from .worker import WorkerConfig, run_worker, split_cores

START_TIMEOUT_S = 300  # a worker must have built its model and joined the group by then (imports on a busy machine)


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "minillm.engine", "minillm.kv_producer", "minillm.kv_consumer"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self._procs = {role: ctx.Process(target=run_worker, name=f"minillm-{role}", daemon=True,
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
        self._decoder = "decode" if "decode" in roles else "colocated"  # whose pool the server's gauges show
        self._latest: dict[str, EngineStats] = {}  # each worker's engine.stats(), as of its latest outputs
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self._latest) < len(roles):
            kind, role, *rest = self._get(deadline - time.monotonic())
            if kind == "ready":
                self._latest[role] = rest[0]
        self.num_blocks = {role: stats.num_blocks for role, stats in self._latest.items()}
        self.scheduler_config = roles[self._decoder].scheduler_config

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

    def stats(self, waiting_ids: int = 0, tables: bool = False, cached_ids: int = 0) -> EngineStats:
        """`LLMEngine.stats()` as the router sees it: a request with a token so far runs, the others wait; the
        blocks are the decoding worker's as of its latest outputs. No block tables: they live in another process."""
        started = {rid for rid, out in self.requests.items() if any(o.token_ids for o in out.outputs)}
        waiting = [rid for rid in self.requests if rid not in started]
        pool = self._latest[self._decoder]
        return EngineStats(tuple(rid for rid in self.requests if rid in started), len(waiting), pool.num_blocks,
                           pool.num_free_blocks, tuple(waiting[:waiting_ids]))

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
            _, outs, failures, role, stats = item
            self.failures.update(failures)
            self._latest[role] = stats
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

    def worker_stats(self) -> dict[str, dict]:
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
