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
    GET  /v1/engine/events every engine step as a server-sent event; GET /live draws
                           them (batch rows, budget, KV block map, queues, roofline): `live.py`

GPT-2 has no chat template, so there is no /v1/chat/completions (it answers 404).
The request body and its checks are `protocol.py`'s; the one thread that calls
the engine is `engine_loop.py`'s; the text of each event is `text_stream.py`'s.

- At most `--max-queue` requests wait for a slot; one more gets 429 and a
  `Retry-After` header. While shutting down, 503.
- A client that disconnects (or a stop string that ends the text) aborts its
  request: the engine frees its blocks at once.
- Bad input (malformed JSON, a wrong type, a prompt longer than the context, a
  token id out of the vocabulary, top_p outside (0, 1]) gets 400 with the
  engine's own message, and the server keeps serving.

What it costs: per token, one hop between threads, one incremental decode, one
JSON event; lesson 12 measures the total against the engine's own records.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import LLMEngine, RequestOutput
from .engine_loop import RETRY_AFTER_S, EngineLoop, Failed, Rejected
from .live import feed_router, make_live, page_router
from .protocol import BadRequest, CompletionRequest, error_response, unsupported
from ..sampling_params import FINISH_ABORT, FINISH_STOP, SamplingParams
from .text_stream import TextStream


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
        problem = unsupported(body)
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

    app.include_router(feed_router(fe.live))  # GET /v1/engine/events
    app.include_router(page_router())         # GET /live
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
    fe.live = make_live(engine, loop, model_name)  # the step recorder behind /live
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
