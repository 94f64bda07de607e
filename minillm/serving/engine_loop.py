"""The one engine thread: the only caller of an `LLMEngine`, fed by a queue, answering through callbacks.

The engine is not thread-safe, and need not be: exactly one thread, the
`EngineLoop`'s, ever calls it. Request handlers (coroutines on uvicorn's event
loop) hand it commands through one queue, and it hands each request's outputs
back through that request's own asyncio queue:

    handler ──add/abort──▶ inbox ──▶ engine thread: add_request, abort_request, step()
    handler ◀── per-request queue ◀── RequestOutput after each step (loop.call_soon_threadsafe)

While any request is unfinished the thread steps without pause, taking what
the inbox holds between steps; when the engine is idle it sleeps on the inbox.
Even `add_request` runs on that thread, so its own checks (prompt length,
token ids, the pool) give the 400's one-line message. A test that must look at
the engine (its invariants) asks the thread to do it: `EngineLoop.call(fn)`.

Back-pressure and faults: a body's requests come in one command
(`submit_all`) and are admitted or refused together. Those that free slots of
the running batch will take at the next step are always admitted; beyond them,
at most `max_queue` requests wait for a slot, and a body that would pass that is
Rejected with 429 (503 once stopping). So `max_queue=0` admits only what can start now. A step
that raises fails every request it could have touched, and the thread goes on
serving. `stop()` aborts what is unfinished, so no request is left without an end.

The gauges are copied from `engine.stats()` after each step (O(running)); the
thread never reads the engine's queues or private fields.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from ..engine import LLMEngine, RequestOutput
from ..sampling import NonFiniteLogitsError
from ..sampling_params import SamplingParams

log = logging.getLogger("minillm.server")

RETRY_AFTER_S = 1  # the hint sent with 429/503: a queue slot frees whenever a running request finishes


@dataclass
class Accepted:
    """The engine took the request; its outputs follow."""


@dataclass
class Rejected:
    """The engine refused the request: `status` 400 (bad input), 429 (queue full) or 503 (shutting down)."""
    status: int
    message: str


@dataclass
class Failed:
    """The engine failed while running the request; the stream ends with this message."""
    message: str


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    put: Callable[[object], None]  # hands an item to the request's handler, from the engine thread


class EngineLoop:
    """The one thread that owns an `LLMEngine`: it adds, aborts and steps, and nothing else touches the engine.

    `submit`, `abort`, `call` and `stop` may be called from any thread; each only puts a command in the inbox.
    The counters (`num_running`, `num_waiting`, `num_blocks_used`) are copied from the engine after every step,
    for /metrics to read without calling the engine.
    """

    def __init__(self, engine: LLMEngine, max_queue: int = 256,
                 on_finished: Callable[[RequestOutput], None] | None = None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an integer ≥ 0: the most requests that may wait "
                             "for a slot in the running batch (0: admit only what can start at once)")
        self.engine = engine  # read by nobody else: the name is for the docs and for `call`
        self.max_queue = max_queue
        self.on_finished = on_finished  # runs on the engine thread for each finished request (metrics, logs)
        self.on_step: Callable[[LLMEngine], None] | None = None  # runs on it after each step (the live page)
        self.num_running = self.num_waiting = self.num_blocks_used = 0
        self.num_blocks = engine.stats().num_blocks
        self.accepting = True
        self._close = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Callable[[object], None]] = {}
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float,
               put: Callable[[object], None]) -> None:
        """Ask for a request to be added; `put` receives Accepted or Rejected, then each RequestOutput."""
        self.submit_all([(request_id, prompt, params, arrival_time, put)])

    def submit_all(self, requests: list[tuple]) -> None:
        """Submit a body's requests, (request_id, prompt, params, arrival_time, put) each, all or none: the
        queue admits them together or refuses them all (429), so no body is half admitted."""
        if not self.accepting or not self.alive:
            for *_, put in requests:
                put(Rejected(503, "the server is shutting down and admits no new request"))
            return
        self._inbox.put([_Add(*r) for r in requests])

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request, or only its sample `index` (one whose text a stop string ended)."""
        self._inbox.put(("abort", request_id, index))

    def abort_all(self, why: str) -> Future:
        """Abort every unfinished request, logging one line for each; the future holds their ids. Each
        request's handler gets its last output (finish_reason "abort") as usual, so its stream can end."""
        future: Future = Future()
        self._inbox.put(("abort_all", why, future))
        return future

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the engine thread, between steps; the future holds its result or exception."""
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float | None = None, close: bool = False) -> None:
        """Abort whatever is unfinished, report it, and end the thread; with close=True the thread then
        closes the engine too (frees its pool), so that even that call comes from the engine's own thread."""
        self.accepting = False
        self._close = close
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # ---- on the engine thread ----

    def _run(self) -> None:
        engine, stopping = self.engine, False
        while not stopping:
            commands = []
            try:  # sleep on the inbox while idle; between steps only take what is there
                commands.append(self._inbox.get(block=not engine.has_unfinished_requests()))
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                stopping = self._handle(command) or stopping
            if stopping:
                for request_id in list(self._streams):
                    engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                self._step()
                if not stopping:
                    break
        self.num_running = self.num_waiting = self.num_blocks_used = 0
        if self._close:
            engine.close()

    def _handle(self, command) -> bool:
        """Carry out one command; True for stop."""
        engine = self.engine
        if isinstance(command, list):  # one body's requests (`submit_all`)
            refusal = None
            if not self.accepting:
                refusal = Rejected(503, "the server is shutting down and admits no new request")
            elif self.queued_beyond_slots(joining=len(command)) > self.max_queue:
                slots = engine.scheduler_config.max_num_seqs
                refusal = Rejected(429, f"the batch's {slots} slots are taken and {self.queued_beyond_slots()} "
                                        f"requests already wait for one; {len(command)} more would pass the most "
                                        f"--max-queue={self.max_queue} allows; retry after {RETRY_AFTER_S} s, or "
                                        "start the server with a larger --max-queue")
            for add in command:
                if refusal is not None:  # the HTTP side aborts those of the body already added
                    add.put(refusal)
                    continue
                try:
                    engine.add_request(add.prompt, add.params, add.request_id, add.arrival_time)
                except ValueError as e:
                    refusal = Rejected(400, str(e))
                    add.put(refusal)
                else:
                    self._streams[add.request_id] = add.put
                    add.put(Accepted())
            self.num_waiting = engine.stats().num_waiting
            return False
        if command[0] == "abort":
            engine.abort_request(command[1], command[2])  # False for one already finished: nothing to do
            return False
        if command[0] == "abort_all":
            _, why, future = command
            for request_id in list(self._streams):
                seq = engine.requests.get(request_id)
                if engine.abort_request(request_id):
                    log.warning("request %s aborted (%s) after %d tokens", request_id, why,
                                len(seq.output_token_ids))
            future.set_result(list(self._streams))
            return False
        if command[0] == "call":
            _, fn, future = command
            try:
                future.set_result(fn(engine))
            except BaseException as e:  # handed to the caller, who re-raises it in its own thread
                future.set_exception(e)
            return False
        return True  # stop

    def queued_beyond_slots(self, joining: int = 0) -> int:
        """Waiting requests (and `joining` more) that no free batch slot will take at the next step: what
        --max-queue bounds."""
        now = self.engine.stats()
        free_slots = self.engine.scheduler_config.max_num_seqs - now.num_running
        return max(0, now.num_waiting + joining - free_slots)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except NonFiniteLogitsError as e:  # the engine aborted those rows' requests, and the rest go on
            self._fail(e.request_ids, e)
            return
        except Exception as e:  # noqa: BLE001  (a step that fails must not kill the thread that serves)
            self._fail_all(e)
            return
        for out in outputs:
            put = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.on_finished is not None:
                    try:
                        self.on_finished(out)
                    except Exception:  # noqa: BLE001  (a metric or a log line must not stop the serving)
                        log.error("recording request %s failed\n%s", out.request_id, traceback.format_exc())
            if put is not None:
                put(out)
        time.sleep(0)  # let go of the GIL, so the event loop sends these tokens before the next step begins
        now = engine.stats()  # the engine's public read surface: counts, never its queues
        self.num_running, self.num_waiting = now.num_running, now.num_waiting
        self.num_blocks_used = now.num_blocks - now.num_free_blocks
        if self.on_step is not None:
            try:
                self.on_step(engine)
            except Exception:  # noqa: BLE001  (watching must not stop the serving)
                log.error("recording a step failed\n%s", traceback.format_exc())

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """The engine aborted these requests (and no other) in a step that raised: tell their clients only."""
        log.error("engine step failed for %d request(s), aborted: %s", len(request_ids), error)
        for request_id in request_ids:
            put = self._streams.pop(request_id, None)
            if put is not None:
                put(Failed(f"the engine failed: {type(error).__name__}: {error}"))

    def _fail_all(self, error: Exception) -> None:
        """A step raised: abort every request it could have touched, tell their clients, keep serving."""
        log.error("engine step failed; aborting %d requests\n%s", len(self._streams), traceback.format_exc())
        message = f"the engine failed: {type(error).__name__}: {error}"
        for request_id, put in list(self._streams.items()):
            self.engine.abort_request(request_id)
            put(Failed(message))
        self._streams.clear()
        try:
            self.engine.step()  # reports the aborts, so the engine forgets them
        except Exception:  # noqa: BLE001
            log.error("the engine could not report the aborted requests\n%s", traceback.format_exc())
