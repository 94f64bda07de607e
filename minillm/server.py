"""Serving over HTTP: an OpenAI-compatible server around one engine thread.

    python -m minillm serve --model gpt2 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gpt2", "prompt": "The KV cache", "max_tokens": 20, "stream": true}'

Endpoints, as vLLM's `vllm serve` offers them:

    POST /v1/completions   one completion; `stream: true` sends it as server-sent events,
                           one event per generated token, then `data: [DONE]`
    GET  /v1/models        the one model served
    GET  /health           200 while the engine thread is alive
    GET  /metrics          Prometheus text: running/waiting requests, KV use, token
                           counters, TTFT/ITL/end-to-end histograms

GPT-2 has no chat template, so there is no /v1/chat/completions (it answers 404).

The request fields mean what they mean in the OpenAI and vLLM APIs: `prompt`
(text, or a list of token ids), `max_tokens` (default 16), `temperature`,
`top_p`, `top_k`, `seed`, `stop` (strings, or token ids), `stop_token_ids`,
`ignore_eos`, `stream`, `stream_options.include_usage`. `n` must be 1, and the
fields this engine cannot honour (`logprobs`, `echo`, `best_of` > 1, penalties,
`logit_bias`, `suffix`) are refused, not ignored: a client gets what it asked
for, or a 400 that says why.

One engine thread
-----------------
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

Back-pressure, faults and shutdown
----------------------------------
- At most `--max-queue` requests wait for a slot in the running batch; one
  more gets 429 and a `Retry-After` header. While shutting down, 503.
- A client that disconnects (or a stop string that ends the text) aborts its
  request: the engine frees its blocks at once.
- Bad input (malformed JSON, a wrong type, a prompt longer than the context, a
  token id out of the vocabulary, top_p outside (0, 1]) gets 400 with the
  engine's own message, and the server keeps serving.
- SIGINT or SIGTERM: stop admitting (new requests get 503), give the running
  requests `--shutdown-timeout` seconds to finish, abort the rest (their
  streams end with finish_reason "abort"), stop the engine thread, exit 0.

Text as it streams: each event carries the text its token added, decoded
from all the tokens so far, so the events concatenate to exactly the decoded
completion. A token that ends inside a UTF-8 character, or text that may be
the start of a stop string, is held back until the next token settles it; its
event then carries "" (so a client can still time every token).

What it costs: per token, one hop between threads, one incremental decode, one
JSON event; lesson 12 measures the total against the engine's own records.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from .engine import LLMEngine, RequestOutput
from .sampling import FINISH_ABORT, FINISH_STOP, SamplingParams

log = logging.getLogger("minillm.server")

RETRY_AFTER_S = 1  # the hint sent with 429/503: a queue slot frees whenever a running request finishes


# ---- the engine thread ---------------------------------------------------------------


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
                             "for a slot in the running batch (0: refuse any request that cannot start at once)")
        self.engine = engine  # read by nobody else: the name is for the docs and for `call`
        self.max_queue = max_queue
        self.on_finished = on_finished  # runs on the engine thread for each finished request (metrics, logs)
        self.num_running = self.num_waiting = self.num_blocks_used = 0
        self.num_blocks = engine.block_manager.num_blocks
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
        if not self.accepting or not self.alive:
            put(Rejected(503, "the server is shutting down and admits no new request"))
            return
        self._inbox.put(_Add(request_id, prompt, params, arrival_time, put))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

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
        if isinstance(command, _Add):
            if not self.accepting:
                command.put(Rejected(503, "the server is shutting down and admits no new request"))
            elif len(engine.scheduler.waiting) >= self.max_queue:
                command.put(Rejected(429, f"{len(engine.scheduler.waiting)} requests are already waiting, the "
                                          f"most --max-queue={self.max_queue} allows; retry after "
                                          f"{RETRY_AFTER_S} s, or start the server with a larger --max-queue"))
            else:
                try:
                    engine.add_request(command.prompt, command.params, command.request_id, command.arrival_time)
                except ValueError as e:
                    command.put(Rejected(400, str(e)))
                else:
                    self._streams[command.request_id] = command.put
                    command.put(Accepted())
                    self.num_waiting = len(engine.scheduler.waiting)
            return False
        if command[0] == "abort":
            engine.abort_request(command[1])  # False for one already finished: nothing to do
            return False
        if command[0] == "call":
            _, fn, future = command
            try:
                future.set_result(fn(engine))
            except BaseException as e:  # handed to the caller, who re-raises it in its own thread
                future.set_exception(e)
            return False
        return True  # stop

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
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
        self.num_running = len(engine.scheduler.running)
        self.num_waiting = len(engine.scheduler.waiting)
        self.num_blocks_used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks

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


# ---- text, as tokens arrive ------------------------------------------------------------


class TextStream:
    """One completion's text, delta by delta: decode every token so far, hand out only what is settled.

    Held back: a trailing U+FFFD (the token ended inside a UTF-8 character) and a tail that may be the start
    of a stop string. A stop string ends the text before it, as in the OpenAI API.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.sent = 0        # characters handed out
        self.stopped = False  # a stop string was found

    def update(self, token_ids: list[int], finished: bool) -> str:
        text = self.decode(token_ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped, finished = text[:min(hits)], True, True
        end = len(text)
        if not finished:
            if text.endswith("\ufffd"):
                end -= 1
            for k in range(min(end, max((len(s) for s in self.stops), default=1) - 1), 0, -1):
                if any(s.startswith(text[end - k:end]) for s in self.stops):
                    end -= k
                    break
        end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


# ---- the HTTP API ----------------------------------------------------------------------------


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's fields, and vLLM's `top_k`, `stop_token_ids`, `ignore_eos`)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    # Fields this engine cannot honour: refused when set, never silently ignored.
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "code"}}."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(status, "ServiceUnavailable")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=headers)


def _unsupported(body: CompletionRequest) -> str | None:
    if body.n != 1:
        return f"n={body.n}: this server returns one completion per request (n=1); send {body.n} requests instead"
    if body.best_of not in (None, 1):
        return f"best_of={body.best_of} is not supported; only best_of=1 (one sample, returned)"
    if body.logprobs is not None:
        return "logprobs are not supported by this server; leave the field out"
    if body.echo:
        return "echo=true is not supported; the prompt you sent is yours already"
    if body.suffix is not None:
        return "suffix is not supported (GPT-2 has no fill-in-the-middle)"
    if body.presence_penalty or body.frequency_penalty or body.logit_bias:
        return "presence_penalty, frequency_penalty and logit_bias are not supported; leave them out or at 0"
    return None


class Frontend:
    """What a request handler needs: the engine loop, the tokenizer, the model's name, and the metrics."""

    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, max_model_len: int):
        self.loop, self.tokenizer, self.model_name, self.max_model_len = loop, tokenizer, model_name, max_model_len
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("minillm:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: loop.num_running)
        Gauge("minillm:num_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            lambda: loop.num_waiting)
        Gauge("minillm:kv_cache_usage_perc", "Share of KV blocks in use (0 to 1)", registry=r).set_function(
            lambda: loop.num_blocks_used / loop.num_blocks)
        self.prompt_tokens = Counter("minillm:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minillm:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("minillm:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.rejected = Counter("minillm:request_rejected", "Requests refused", ["status"], registry=r)
        buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Arrival to first token, engine-side",
                              buckets=buckets, registry=r)
        self.itl = Histogram("minillm:inter_token_latency_seconds", "Gap between two tokens, engine-side",
                             buckets=buckets, registry=r)
        self.e2e = Histogram("minillm:e2e_request_latency_seconds", "Arrival to finish, engine-side",
                             buckets=buckets, registry=r)

    def record(self, out: RequestOutput) -> None:
        """The engine's own record of a finished request, into the metrics (runs on the engine thread)."""
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.output_token_ids))
        self.finished.labels(out.finish_reason).inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise BadRequest(400, f"the prompt is a batch of {len(prompt)} prompts; this server takes one "
                                      "prompt per request: send one request for each")
            prompt = prompt[0]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def params(self, body: CompletionRequest) -> tuple[SamplingParams, list[str]]:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_strings = [s for s in stops if isinstance(s, str)]
        stop_ids = [s for s in stops if not isinstance(s, str)] + list(body.stop_token_ids or [])
        try:
            return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  max_tokens=body.max_tokens, seed=body.seed, stop_token_ids=tuple(stop_ids),
                                  ignore_eos=body.ignore_eos), stop_strings
        except ValueError as e:
            raise BadRequest(400, str(e)) from None

    async def start(self, body: CompletionRequest, arrival: float) -> tuple[str, list[int], SamplingParams,
                                                                           list[str], asyncio.Queue]:
        """Check the request, hand it to the engine thread, and wait for its answer (Accepted or Rejected)."""
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(404, f"the model {body.model!r} does not exist; this server serves "
                                  f"{self.model_name!r} (GET /v1/models)")
        problem = _unsupported(body)
        if problem:
            raise BadRequest(400, problem)
        prompt = self.prompt_ids(body.prompt)
        params, stops = self.params(body)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the handler is gone, nobody to tell
                pass

        request_id = f"cmpl-{uuid.uuid4().hex}"
        self.loop.submit(request_id, prompt, params, arrival, put)
        try:
            answer = await outputs.get()
        except asyncio.CancelledError:  # the client left before the engine answered
            self.loop.abort(request_id)
            raise
        if isinstance(answer, Rejected):
            self.rejected.labels(str(answer.status)).inc()
            headers = {"Retry-After": str(RETRY_AFTER_S)} if answer.status in (429, 503) else None
            raise BadRequest(answer.status, answer.message, headers)
        return request_id, prompt, params, stops, outputs


def build_app(frontend: Frontend) -> FastAPI:
    """The FastAPI app: the four endpoints, and OpenAI-shaped errors for everything that goes wrong."""
    app = FastAPI(title="minillm", description="An OpenAI-compatible server for minillm's engine")
    app.state.frontend = frontend
    fe = frontend

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        message = f"{where}: {first.get('msg')}" if first.get("type") != "json_invalid" else \
            f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
        return error_response(400, message.replace("\n", " "))

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        return error_response(exc.status, exc.message, exc.headers)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if fe.loop.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(fe.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "minillm", "max_model_len": fe.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        request_id, prompt, params, stops, outputs = await fe.start(body, arrival)
        text = TextStream(fe.tokenizer.decode, stops)
        created = int(time.time())

        def chunk(delta: str, reason: str | None) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": fe.model_name,
                    "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}

        def usage(num_generated: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": num_generated,
                    "total_tokens": len(prompt) + num_generated}

        async def events():
            """One event per generated token, as the engine makes them; abort the request if the client leaves."""
            done, generated = False, []
            try:
                while not done:
                    out = await outputs.get()
                    if isinstance(out, Failed):
                        yield format_sse_event(data_str=json.dumps({"error": {"message": out.message,
                                                                              "type": "InternalServerError",
                                                                              "code": 500}}))
                        return
                    new, generated = out.output_token_ids[len(generated):], out.output_token_ids
                    for k in range(len(new)):
                        last = out.finished and k == len(new) - 1
                        delta = text.update(generated[:len(generated) - len(new) + k + 1], last)
                        done = last or text.stopped
                        yield format_sse_event(data_str=json.dumps(chunk(delta, _reason(out, text) if done
                                                                         else None)))
                        if done:
                            break
                    if out.finished and not new:  # aborted before another token
                        done = True
                        yield format_sse_event(data_str=json.dumps(chunk(text.update(generated, True),
                                                                         _reason(out, text))))
                if (body.stream_options or {}).get("include_usage"):
                    yield format_sse_event(data_str=json.dumps(
                        {**chunk("", None), "choices": [], "usage": usage(len(generated))}))
                yield format_sse_event(data_str="[DONE]")
            finally:
                if not done or text.stopped:  # the client left, or a stop string ended the text early
                    fe.loop.abort(request_id)

        if body.stream:
            return EventSourceResponse(events(), headers={"Cache-Control": "no-cache"})

        parts = []  # not streamed: wait for the end, and notice a client that stops waiting
        try:
            while True:
                try:
                    out = await asyncio.wait_for(outputs.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        fe.loop.abort(request_id)
                        return Response(status_code=499)
                    continue
                if isinstance(out, Failed):
                    return error_response(500, out.message)
                parts.append(text.update(out.output_token_ids, out.finished))
                if out.finished or text.stopped:
                    break
        except asyncio.CancelledError:
            fe.loop.abort(request_id)
            raise
        if text.stopped and not out.finished:
            fe.loop.abort(request_id)
        return {**chunk("".join(parts), _reason(out, text)), "usage": usage(len(out.output_token_ids))}

    return app


def _reason(out: RequestOutput, text: TextStream) -> str:
    return FINISH_STOP if text.stopped else (out.finish_reason or FINISH_ABORT)


# ---- running it --------------------------------------------------------------------------------


def make_frontend(engine: LLMEngine, tokenizer, model_name: str, max_queue: int = 256,
                  on_finished: Callable[[RequestOutput], None] | None = None) -> Frontend:
    """An engine thread for `engine`, and the frontend that talks to it; `on_finished(out)` also sees each
    finished request's output, on the engine thread (the server's --request-log)."""
    loop = EngineLoop(engine, max_queue)
    fe = Frontend(loop, tokenizer, model_name, engine.config.n_ctx)

    def finished(out: RequestOutput) -> None:
        fe.record(out)
        if on_finished is not None:
            on_finished(out)

    loop.on_finished = finished  # before any request: none can arrive until the frontend is returned
    return fe


class BackgroundServer:
    """The server on a thread of this process, on a free port of 127.0.0.1 (tests, lessons, notebooks).

        with BackgroundServer(make_frontend(engine, tokenizer, "tiny")) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, frontend: Frontend, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.frontend = frontend
        config = uvicorn.Config(build_app(frontend), host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="minillm-http", daemon=True)

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.frontend.loop.accepting = False
        self.server.should_exit = True
        self.thread.join()
        self.frontend.loop.stop()


def request_record(out: RequestOutput) -> dict:
    """The engine's own record of a finished request, as --request-log writes it."""
    m = out.metrics
    return {"id": out.request_id, "arrival": m.arrival_time, "token_times": m.token_times,
            "finished": m.finished_time, "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "num_preemptions": out.num_preemptions}


def run(args) -> int:
    """`python -m minillm serve`: build the engine, serve until SIGINT/SIGTERM, exit 0."""
    import uvicorn
    from .scheduler import SchedulerConfig
    from .tokenizer import load_tokenizer
    from .weights import load_model, resolve_device, resolve_dtype
    device = resolve_device(args.device)
    model = load_model(args.model, device, resolve_dtype(args.dtype, device), args.weights_dir)
    tokenizer = load_tokenizer(args.model, args.weights_dir)
    engine = LLMEngine(model, SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs,
                                              args.enable_chunked_prefill),
                       block_size=args.block_size, num_blocks=args.num_gpu_blocks_override,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
                       record_timeline=False)
    log_file = open(args.request_log, "a") if args.request_log else None

    def write_record(out: RequestOutput) -> None:
        log_file.write(json.dumps(request_record(out)) + "\n")
        log_file.flush()

    name = args.served_model_name or args.model
    fe = make_frontend(engine, tokenizer, name, args.max_queue, write_record if log_file else None)
    app = build_app(fe)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: from now on every new request gets 503
            fe.loop.accepting = False
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it shut down for: make that a no-op
        signal.signal(sig, lambda s, frame: caught.append(s))
    print(f"serving {name} ({model.weights_source}) on {device} at http://{args.host}:{args.port}/v1 "
          f"(max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"chunked prefill {'on' if args.enable_chunked_prefill else 'off'}, prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'}, {engine.block_manager.num_blocks} KV blocks); "
          "Ctrl-C stops", flush=True)
    try:
        server.run()
    finally:
        fe.loop.stop(close=True)
        if log_file:
            log_file.close()
    if not server.started:
        return 2  # could not bind the port: uvicorn has said why
    print("server stopped", file=sys.stderr)
    return 0
