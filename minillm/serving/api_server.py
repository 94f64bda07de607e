"""Serving over HTTP: an OpenAI-compatible server around one engine thread.

    python -m minillm serve --model gpt2 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gpt2", "prompt": "The KV cache", "max_tokens": 20, "stream": true}'

Routes, as vLLM's `vllm serve` offers them:

    POST /v1/completions       one completion; `stream: true` sends it as server-sent events,
                               one event per generated token, then `data: [DONE]`
    POST /v1/chat/completions  the same, for messages rendered by --chat-template (GPT-2 has
                               no template of its own: without one, 400 saying so)
    GET  /v1/models            the one model served (`id`, `root`, `max_model_len`)
    POST /tokenize, /detokenize  text (or messages) to token ids, and back
    GET  /tokenizer_info       the tokenizer's special tokens and chat template, in vLLM's shape
    GET  /health               200 while the engine thread is alive (503 while draining)
    GET  /metrics              Prometheus text, under vLLM's names (`vllm:`) and ours (`minillm:`):
                               running/waiting requests, KV use, token counters, prefix-cache hits,
                               preemptions, queue/prefill/decode/TTFT/ITL/end-to-end histograms
    GET  /v1/engine/events     every engine step as a server-sent event; GET /live draws them
                               (batch rows, budget, KV block map, queues, roofline): `live.py`

This file only routes, as vLLM's `api_server` does: the request and response
types are `protocol.py`'s, the work behind each route is `serving.py`'s, the
error shape and the reading of a body `errors.py`'s, the one thread that calls
the engine is `engine_loop.py`'s, the text of each event is `text_stream.py`'s,
the metrics `prometheus.py`'s, and the listening and the shutdown `launch.py`'s.

- Every number a request sends that sets its cost (n, logprobs, prompts, stop
  strings, the body, a prompt's length, the answer's size) is checked before
  any work is done for it: `limits.py`, a 400 naming the flag that raises it.
- A body's prompts are admitted together: those a free batch slot will take,
  and beyond them at most `--max-queue` waiting; a body that could fit later
  gets 429 with `Retry-After`, one that never could a 400 saying why.
- A client that disconnects, streamed or not, aborts its request within a
  step (a stop string that ends the text too): the engine frees its blocks.
- Every error, on any route, is OpenAI's {"error": {"message", "type",
  "param", "code"}}: 4xx for what a client sent (errors.py lists them), 500
  only for a fault of the server.
- `Gate` answers before any route: 401 without the API key (`--api-key`),
  503 with `Retry-After` while the server drains for shutdown.

What it costs: per token, one hop between threads, one incremental decode, one
JSON event; lesson 12 measures the total against the engine's own records.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine import LLMEngine, RequestOutput
from .engine_loop import RETRY_AFTER_S, EngineLoop
from .errors import APIError, error_response, read_body
from .limits import ServerLimits
from .live import feed_router, make_live, page_router
from .chat_template import ChatTemplate
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import OpenAIServing, cancelled_when_client_leaves


ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
          "GET /tokenizer_info, GET /health, GET /metrics")


@dataclass(frozen=True)
class ServerConfig:
    """The server's own knobs (the engine's are LLMEngine's): where it listens, and how it shuts down."""
    host: str = "127.0.0.1"
    port: int = 0
    shutdown_timeout: float = 5.0    # seconds running requests get after SIGINT/SIGTERM; then they are aborted
    timeout_keep_alive: float = 5.0  # a connection with no request in progress is closed after this many seconds
    api_key: str | None = field(default=None, repr=False)  # every route but OPEN_PATHS needs it
    enable_docs: bool = False        # /docs and /openapi.json

    def __post_init__(self):
        for name in ("shutdown_timeout", "timeout_keep_alive"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} must be a number of seconds ≥ 0")

    @classmethod
    def from_args(cls, args) -> "ServerConfig":
        """The flags of `serve`; the key from --api-key, else from $MINILLM_API_KEY (as vLLM's VLLM_API_KEY)."""
        return cls(args.host, args.port, args.shutdown_timeout, args.timeout_keep_alive,
                   args.api_key or os.environ.get("MINILLM_API_KEY") or None, args.enable_fastapi_docs)


OPEN_PATHS = ("/health", "/metrics", "/live")  # a load balancer's, Prometheus' and the live page's static file:
# open even with an API key (the page holds no data; the feed it reads, /v1/engine/events, needs the key)


class Gate:
    """ASGI middleware that answers before any route. With an API key, a request to any path but OPEN_PATHS
    without `Authorization: Bearer <key>` gets 401. While the server drains for shutdown,
    every request but /metrics gets 503 with Retry-After, and its connection is closed after it."""

    def __init__(self, app, serving: OpenAIServing, api_key: str | None):
        self.app, self.serving = app, serving
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # in constant time: no timing hints
                refusal = error_response(401, "a valid API key is required: send the header 'Authorization: "
                                              "Bearer <key>' with the key the server was started with "
                                              "(--api-key or MINILLM_API_KEY)",
                                         headers={"WWW-Authenticate": "Bearer"})
                return await refusal(scope, receive, send)
        if not self.serving.loop.accepting and scope["path"] != "/metrics":
            refusal = error_response(503, "the server is shutting down and admits no new request; retry on "
                                          "another replica, or here once it is back",
                                     headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(serving: OpenAIServing, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app: the routes, and OpenAI-shaped errors for everything that goes wrong."""
    docs = config.enable_docs
    app = FastAPI(title="minillm", description="An OpenAI-compatible server for minillm's engine",
                  docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.serving = serving
    max_bytes, timeout = serving.limits.max_body_bytes, serving.limits.body_timeout
    app.add_middleware(Gate, serving=serving, api_key=config.api_key)

    @app.exception_handler(APIError)
    async def refused(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(HTTPException)
    async def no_such_route(request: Request, exc: HTTPException):  # Starlette's 404 and 405
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = f"there is no {path} here; the routes are {ROUTES}"
        elif exc.status_code == 405:
            message = f"{path} takes {exc.headers.get('Allow', 'another method')}, not {method}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):  # it hung up mid-body: nobody to answer
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception):  # a bug: 500 in the same shape, and a traceback
        return error_response(500, f"the server failed: {type(exc).__name__}: {exc}; this is a bug in the "
                                   "server, not in the request")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if serving.loop.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest, max_bytes, timeout)  # all of it, before listening for a disconnect
        return await cancelled_when_client_leaves(serving.completion(body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest, max_bytes, timeout)
        return await cancelled_when_client_leaves(serving.chat(body), request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(await read_body(request, TokenizeRequest, max_bytes, timeout))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.detokenize(await read_body(request, DetokenizeRequest, max_bytes, timeout))

    if serving.live is not None:  # an engine in this process: its steps can be watched
        app.include_router(feed_router(serving.live))  # GET /v1/engine/events
        app.include_router(page_router())              # GET /live
    return app


# ---- running it --------------------------------------------------------------------------------


def make_serving(engine: LLMEngine, tokenizer, model_name: str, max_queue: int = 256,
                 on_finished: Callable[[RequestOutput], None] | None = None, root: str | None = None,
                 chat_template: ChatTemplate | None = None, limits: ServerLimits = ServerLimits()) -> OpenAIServing:
    """An engine thread for `engine`, and the serving object that talks to it; `on_finished(out)` also sees
    each finished request's output, on the engine thread (the server's --request-log)."""
    loop = EngineLoop(engine, max_queue)
    serving = OpenAIServing(loop, tokenizer, model_name, engine.config.n_ctx, root, chat_template, limits,
                            engine.scheduler_config.max_num_seqs)

    def finished(out: RequestOutput) -> None:
        serving.metrics.record(out)
        if on_finished is not None:
            on_finished(out)

    loop.on_finished = finished  # before any request: none can arrive until the serving object is returned
    # The step recorder behind /live watches an engine in this process; workers in others (`serve --disaggregate`)
    # step where it cannot see, so that server has no live page.
    serving.live = make_live(engine, loop, model_name) if isinstance(engine, LLMEngine) else None
    return serving
