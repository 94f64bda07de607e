"""Watch the engine think: every step it takes, streamed to a page beside the API.

    python -m minillm serve --model gpt2 --enable-prefix-caching
    open http://127.0.0.1:8000/live            (then run bench-serve, or lesson 12's workload)
    curl -N http://127.0.0.1:8000/v1/engine/events

Prometheus gauges (`/metrics`) say how full the batch and the pool are on
average. They cannot say what the scheduler *decided*. This page shows each
decision as it is made, from the real engine, not a simulator:

    the step's rows      which requests fed a prefill chunk and which a decode token, and how many
                         tokens each: chunked prefill shows as "prefill 64 + decode 3", a long
                         prompt cut into budget-sized pieces beside the requests still decoding
    the token budget     Σ tokens of the step against `max_num_batched_tokens`: prefill fills it,
                         decode alone barely dents it (one token per running request)
    the KV block map     one cell per block of the pool, coloured by the request whose table holds
                         it; a block two tables hold (prefix caching shared it) is marked, and one
                         no table holds but whose hash is kept (evictable, still a cache hit) is grey
                         (a pool of more than 2,048 blocks: only the blocks held or cached)
    the queues           running and waiting requests; a request preempted for room goes back to
                         the front of the waiting queue, loses its blocks, and is recomputed: it
                         reappears as a prefill of prompt + output
    time vs roofline     the step's measured time beside the least time its shape allows: its
                         analytic FLOPs and bytes (`bench/cost.py`) against the device's measured
                         peak FLOP/s and bandwidth (`bench/roofline.py`), whichever is slower.
                         It is a floor: a step close to it is held back by the hardware, one far
                         above it by something else (Python, kernel launches, a small model's many
                         small operations; lesson 03)

How it is recorded, and why it costs the engine nothing it would notice
-------------------------------------------------------------------------
With `record_steps` on, the engine keeps `last_step`, a `StepStats` with the
step's rows. After each step the engine thread (`engine_loop.py`, the only one
that may read the engine) hands the engine to `StepRecorder.record`, which
copies the rows, the queues (`engine.stats()`, never the engine's own fields)
and the prefix-cache hits into one slot of a fixed
ring of `capacity` slots and bumps a counter; while a page watches, also each
running request's block table and the cached blocks (the block map is the pool
as it is now, and a large pool is too much to copy every step for nobody). No
lock: one writer, and a reader checks that the slot it read still holds the
step it wanted (a reader a whole ring behind loses those steps, never gets a
wrong one). Turning a record into JSON and predicting its roofline time happen
on the HTTP side, only for someone watching.

    cost per step, nobody watching ≈ one tuple per row (in the engine) + the running and waiting ids

`python -m minillm.serving.recording` measures it: the engine's time with
recording and without, in interleaved rounds; the claim is at most 1%.

The feed, `GET /v1/engine/events`, is server-sent events: first an `engine`
event (the pool, the budget, the model), then a `ceilings` event once the
device's ceilings are measured (the first watcher triggers it, quick mode on a
CPU, once per process: nobody watching, nobody pays; measured beside a running
engine they read low, and the predictions high), then one `step` event per
step with its number as the event id, so a browser that reconnects resumes
where it left off (`Last-Event-ID`: anything but a step number is a 400). At shutdown every feed gets
an `end` event and its stream ends (`close`). A new watcher first gets the last
`HISTORY` steps, so the page opens on a timeline, not a blank.

The feed is a /v1 route like the completions: `feed_router` is included with
the dependencies that guard the other /v1 routes (an API key). The page (`page_router`) is one static
file, `live.html`, plain JavaScript and `EventSource`, no build step; it holds
no data, so it is served to anyone, and it reads a key from its own address
(`/live#key=...`, a fragment never sent to the server) to open the feed.
"""
from __future__ import annotations

import asyncio
import json
import time
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from ..bench.cost import step_cost
from ..bench.roofline import Ceilings, measure_ceilings
from ..engine import LLMEngine
from ..quantize import quantization_of
from ..sequence import StepStats
from .engine_loop import EngineLoop
from .errors import APIError

CAPACITY = 4096       # steps the ring keeps: a minute or more of a busy server at 50+ steps/s
HISTORY = 600         # steps a new watcher gets first
MAX_WAITING_IDS = 64  # waiting requests named per step (the count is always exact)
MAX_CACHED_IDS = 4096  # evictable blocks named per step, while someone watches
POLL_S = 0.05         # how often the feed looks for new steps: 20 updates a second is smooth for an eye


class StepRecord:
    """What the page needs of one step, copied on the engine thread right after it."""
    __slots__ = ("step", "stats", "running", "waiting", "num_waiting", "tables", "cached", "prefix_hits")

    def __init__(self, step, stats, running, waiting, num_waiting, tables, cached, prefix_hits):
        self.step, self.stats, self.running, self.waiting = step, stats, running, waiting
        self.num_waiting, self.tables, self.cached, self.prefix_hits = num_waiting, tables, cached, prefix_hits


class StepRecorder:
    """A ring of the last `capacity` steps: the engine thread writes, any thread reads, no lock.

    `record(engine)` runs on the engine thread after each step; `since(n)` returns the records of step n
    onwards that are still in the ring, and the number to ask for next."""

    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: the ring needs at least one slot")
        self.capacity = capacity
        self._slots: list[StepRecord | None] = [None] * capacity
        self.count = 0                  # steps recorded so far; the next step's number
        self._seen: StepStats | None = None
        self._running: tuple[str, ...] = ()  # the previous step's running requests
        self.watchers = 0               # feeds open now (changed on the HTTP side, read here)

    def record(self, engine: LLMEngine) -> None:
        """Copy the engine's latest step into the ring (engine thread only; cheap, never blocks)."""
        stats = engine.last_step
        if stats is None or stats is self._seen:  # a step that planned nothing (only reported aborts)
            return
        self._seen = stats
        # The block map is the pool as it is now: copied only while a page watches. Prefix caching's evictable
        # blocks (no holder, still findable by their hash) may be the whole pool: the oldest MAX_CACHED_IDS.
        now = engine.stats(MAX_WAITING_IDS, tables=bool(self.watchers), cached_ids=MAX_CACHED_IDS)
        # A prefill row of a request that was not running before this step was admitted by it; where it starts
        # past 0, the prefix cache held its first `start` tokens.
        hits = tuple((request_id, start) for request_id, is_decode, _, start in stats.rows
                     if start and not is_decode and request_id not in self._running)
        self._running = now.running
        n = self.count
        self._slots[n % self.capacity] = StepRecord(n, stats, now.running, now.waiting, now.num_waiting,
                                                    now.block_tables, now.cached, hits)
        self.count = n + 1  # published last: a reader never sees a number whose slot is not written

    def since(self, step: int) -> tuple[list[StepRecord], int]:
        """The records of steps `step`, `step` + 1, ... still in the ring, and the step to ask for next."""
        end = self.count
        out = []
        for n in range(max(step, end - self.capacity), end):
            record = self._slots[n % self.capacity]
            if record is not None and record.step == n:  # else the writer lapped this reader: that step is gone
                out.append(record)
        return out, end


class LiveFeed:
    """The recorder, what the page needs to know of the engine once, and the roofline to judge each step by.

    Built on the thread that built the engine, before it serves: the engine's shape is read here, once, and
    never again from the HTTP side (only the engine thread touches the engine)."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, model_name: str, recorder: StepRecorder | None = None,
                 ceilings: Ceilings | None = None):
        self.loop = loop
        self.recorder = recorder or StepRecorder()
        self.config, self.device, self.dtype = engine.config, engine.model.device, engine.model.dtype
        self.quantization = quantization_of(engine.model)  # the ceilings are measured in its weight format too
        sc, cc = engine.scheduler_config, engine.cache_config
        self.engine_info = {
            "model": model_name, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "n_layer": self.config.n_layer, "n_embd": self.config.n_embd,
            "num_blocks": engine.stats().num_blocks, "block_size": cc.block_size,
            "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "chunked_prefill": sc.enable_chunked_prefill, "prefix_caching": cc.enable_prefix_caching,
            "capacity": self.recorder.capacity}
        self.t0 = time.perf_counter()
        self._ceilings = ceilings
        self._measuring: asyncio.Future | None = None
        self.closed = False
        # one step's event, written once however many watch (a thousand feeds must not mean a thousand dumps)
        # (a feed reaches its steps only once the ceilings are measured, `self._ceilings`)
        self.step_event = lru_cache(maxsize=HISTORY)(lambda record: format_sse_event(
            event="step", id=str(record.step), data_str=json.dumps(self.step_json(record, self._ceilings))))

    async def ceilings(self) -> Ceilings:
        """The device's measured ceilings, measured by the first watcher (in a worker thread), then kept."""
        if self._ceilings is None:
            if self._measuring is None:
                self._measuring = asyncio.ensure_future(asyncio.to_thread(
                    measure_ceilings, self.device, self.dtype, quick=self.device.type == "cpu",
                    quantization=self.quantization))
            self._ceilings = await asyncio.shield(self._measuring)
        return self._ceilings

    def predicted_s(self, stats: StepStats, ceilings: Ceilings) -> float:
        """The least time this step's shape allows: its FLOPs at the measured peak or its bytes at the
        measured bandwidth, whichever takes longer (the roofline, read as time)."""
        cost = step_cost(self.config, [n for _, _, n, _ in stats.rows], [start for *_, start in stats.rows],
                         self.dtype, lm_head_rows=stats.num_sampled)
        return max(cost.flops / ceilings.matmul_flops, cost.bytes / ceilings.bandwidth)

    def step_json(self, record: StepRecord, ceilings: Ceilings) -> dict:
        """One step as the page reads it."""
        s = record.stats
        return {"step": record.step, "t": round(s.start - self.t0, 6), "duration_s": s.duration,
                "predicted_s": self.predicted_s(s, ceilings),
                "prefill_tokens": s.num_prefill_tokens, "decode_tokens": s.num_decode_tokens,
                "blocks_free": s.num_free_blocks, "blocks_used": self.engine_info["num_blocks"] - s.num_free_blocks,
                "rows": [{"id": request_id, "kind": "decode" if is_decode else "prefill", "tokens": n, "start": start}
                         for request_id, is_decode, n, start in s.rows], "sampled": s.num_sampled,
                "running": list(record.running), "waiting": list(record.waiting), "num_waiting": record.num_waiting,
                "preempted": list(s.preempted),
                "prefix_hits": [{"id": rid, "tokens": n} for rid, n in record.prefix_hits],
                "tables": None if record.tables is None else {rid: list(t) for rid, t in record.tables.items()},
                "cached": list(record.cached)}

    async def events(self, first: int | None, request: Request):
        """The feed: `engine`, `ceilings`, then `step` events from step `first` (default: the last HISTORY),
        until the watcher leaves or the engine thread stops. (uvicorn drops what is sent to a client that has
        gone, so a feed that never ends must ask.)"""
        yield format_sse_event(event="engine", data_str=json.dumps(self.engine_info))
        ceilings = await self.ceilings()
        yield format_sse_event(event="ceilings", data_str=json.dumps(
            {**ceilings.as_dict(), "predicted_by": "max(FLOPs / peak FLOP/s, bytes / bandwidth)"}))
        n = max(0, self.recorder.count - HISTORY) if first is None else first
        self.recorder.watchers += 1
        try:
            async for event in self._steps(n, request, ceilings):
                yield event
        finally:
            self.recorder.watchers -= 1
        if self.closed or not self.loop.alive:  # the server is going: say so, then end the feed cleanly
            yield format_sse_event(event="end", data_str=json.dumps({"reason": "the server is shutting down"}))

    def close(self) -> None:
        """End every feed after its current step (shutdown): each gets an `end` event, then its stream ends."""
        self.closed = True

    async def _steps(self, n: int, request: Request, ceilings: Ceilings):
        while self.loop.alive and not self.closed:
            records, n = self.recorder.since(n)
            for record in records:
                if await request.is_disconnected():
                    return
                yield self.step_event(record)
            if await request.is_disconnected():
                return
            await asyncio.sleep(POLL_S)


def make_live(engine: LLMEngine, loop: EngineLoop, model_name: str, **kwargs) -> LiveFeed:
    """A feed for this engine, its recorder hooked to the engine thread (call before the first request)."""
    feed = LiveFeed(engine, loop, model_name, **kwargs)
    engine.record_steps = True  # the engine keeps each step's rows in `last_step`
    loop.on_step = feed.recorder.record
    return feed


def feed_router(feed: LiveFeed) -> APIRouter:
    """`GET /v1/engine/events`: include it with the dependencies (an API key) that guard the other /v1 routes."""
    router = APIRouter()

    @router.get("/v1/engine/events")
    async def engine_events(request: Request):
        last = request.headers.get("last-event-id", "")  # a reconnecting EventSource resumes after it
        if last and not (last.isascii() and last.isdigit() and len(last) <= 18):
            raise APIError(400, f"Last-Event-ID {last[:24]!r}{'...' if len(last) > 24 else ''} is not a step "
                                "number this feed sent (at most 18 ASCII digits); leave it out to start from the "
                                "latest steps")
        first = int(last) + 1 if last else None
        return EventSourceResponse(feed.events(first, request), headers={"Cache-Control": "no-cache"})

    return router


PAGE = "live.html"


def page_router() -> APIRouter:
    """`GET /live`: the one static page, read once from the package."""
    router = APIRouter()
    page = resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")

    @router.get("/live", response_class=HTMLResponse)
    async def live():
        return HTMLResponse(page)

    return router
