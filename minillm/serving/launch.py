"""`python -m minillm serve`: build the engine, serve it over HTTP until SIGINT/SIGTERM, exit 0.

Shutdown keeps its word, in this order:

  1. SIGINT or SIGTERM: admission stops. The listener stays open while the
     server drains: any new request, on a new connection or an open one, gets
     503 with `Retry-After` and `Connection: close` (/metrics still answers).
  2. The requests already running get `--shutdown-timeout` seconds to finish.
  3. The rest are aborted: one log line each (id, tokens generated), and each
     stream ends with an event whose finish_reason is "abort", then [DONE]; a
     request not streamed gets its text so far, with finish_reason "abort".
  4. uvicorn closes the listener and the connections, the engine thread stops,
     and the process exits 0. A second signal skips the wait of step 2.

uvicorn alone would do step 4 at once and cancel the handlers mid-stream, so
no stream would get its last event. The same sequence ends a `BackgroundServer`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..cpu_layout import lm_head_layout
from ..engine import LLMEngine, RequestOutput
from ..kv_pool import CacheConfig
from .api_server import ServerConfig, build_app, make_serving
from .chat_template import ChatTemplate
from .limits import ServerLimits
from .serving import OpenAIServing

log = logging.getLogger("minillm.server")
LAST_BYTES_S = 2.0  # after the aborts, how long the handlers get to send their last events before uvicorn cancels


class IdleClosingH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, which also closes a connection that never completes a request.

    uvicorn starts its keep-alive clock only after a response, and stops it at the first byte received, so a
    client that connects and sends nothing, or half a request head, holds its socket forever. Here the clock
    (`--timeout-keep-alive`) also starts when the connection opens, and only a whole request head stops it:
    a connection with no request in progress is closed that many seconds after it opened or after its last
    response. A request in progress (a long stream included) is never cut."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        clock, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None  # so uvicorn does not stop it
        super().data_received(data)
        if clock is None:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            clock.cancel()  # a request began: it runs as long as it needs
        elif self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = clock  # still no whole request head: the clock runs on


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown drains the engine first (the module's steps 1 to 3)."""

    def __init__(self, serving: OpenAIServing, config: ServerConfig):
        super().__init__(uvicorn.Config(build_app(serving, config), host=config.host, port=config.port,
                                        log_level="warning", lifespan="off", http=IdleClosingH11Protocol,
                                        timeout_keep_alive=config.timeout_keep_alive,
                                        timeout_graceful_shutdown=LAST_BYTES_S))
        self.serving, self.shutdown_timeout = serving, config.shutdown_timeout
        self.draining = False
        self.hurry = threading.Event()  # a second signal: abort the running requests without waiting
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    async def startup(self, sockets=None) -> None:
        self.event_loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:  # SIGINT/SIGTERM, in the main thread
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """Stop admitting and start draining; a second call skips the wait for running requests.
        Safe from a signal handler and from any thread."""
        self.serving.loop.accepting = False
        if not self.started:
            self.should_exit = True  # nothing was served yet: nothing to drain
        elif self.draining:
            self.hurry.set()
        else:
            self.draining = True
            self.event_loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        task = self.event_loop.create_task(self.drain())
        self._tasks.add(task)  # held, so it is not collected while it runs
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Steps 2 and 3: wait for the running requests, abort the rest, then let uvicorn close."""
        loop = self.serving.loop

        async def busy() -> bool:  # asked of the engine thread; a dead one has nothing left to finish
            return loop.alive and await asyncio.wrap_future(loop.call(lambda e: e.has_unfinished_requests()))

        deadline = time.monotonic() + self.shutdown_timeout
        while await busy() and time.monotonic() < deadline and not self.hurry.is_set():
            await asyncio.sleep(0.02)
        if loop.alive:
            why = "a second signal" if self.hurry.is_set() else f"--shutdown-timeout={self.shutdown_timeout:g} s passed"
            await asyncio.wrap_future(loop.abort_all(f"the server is shutting down; {why}"))
        while await busy():
            await asyncio.sleep(0.01)  # the aborts reach their handlers with the next step's outputs
        live = self.serving.live
        if live is not None:  # end the step feeds with their last event, before uvicorn would cancel them
            live.close()
            deadline = time.monotonic() + LAST_BYTES_S / 2
            while live.recorder.watchers and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self.should_exit = True
        await asyncio.sleep(LAST_BYTES_S / 2)  # every stream has ended; a client that reads none of its last
        for connection in list(self.server_state.connections):  # bytes is let go, so its handler ends (as if it
            if connection.cycle is not None and not connection.cycle.response_complete:  # left), not cancelled
                connection.transport.abort()  # by uvicorn with a traceback in the log


class BackgroundServer:
    """The server on a thread of this process, on a free port of 127.0.0.1 (tests, lessons, notebooks).

        with BackgroundServer(make_serving(engine, tokenizer, "tiny")) as server:
            httpx.get(server.url + "/health")

    Leaving the `with` shuts it down as a signal would (the module's steps), then stops the engine thread.
    """

    def __init__(self, serving: OpenAIServing, **config):
        self.serving = serving
        self.server = Server(serving, ServerConfig(**config))
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
        self.server.begin_shutdown()
        self.thread.join()
        self.serving.loop.stop()
        self.serving.text.close()


def request_record(out: RequestOutput) -> dict:
    """The engine's own record of a finished request, as --request-log writes it."""
    m = out.metrics
    return {"id": out.request_id, "arrival": m.arrival_time, "token_times": m.token_times,
            "finished": m.finished_time, "finish_reason": [c.finish_reason for c in out.outputs] if len(out.outputs) > 1
            else out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "num_preemptions": out.num_preemptions}


def run(args) -> int:
    """`python -m minillm serve`: build the engine, serve until SIGINT/SIGTERM, exit 0."""
    from ..scheduler import SchedulerConfig
    from ..checkpoints.tokenizer import load_tokenizer
    from ..checkpoints.load import load_model
    from ..device import resolve_device, resolve_dtype
    config = ServerConfig.from_args(args)  # its checks first: a bad flag costs no model load
    limits = ServerLimits.from_args(args)
    chat_template = ChatTemplate.from_file(args.chat_template) if args.chat_template else None
    from ..bench.threads import apply_threads, choose_threads
    threads = apply_threads(choose_threads(args.threads))  # the free cores or --threads, as bench and lessons
    device = resolve_device(args.device)
    if args.disaggregate and args.quantization:
        raise ValueError(f"--quantization {args.quantization} with --disaggregate: the workers load the weights in "
                         f"--dtype; serve {args.quantization} weights without --disaggregate")
    model = load_model(args.model, device, resolve_dtype(args.dtype, device), args.weights_dir,
                       quantization=args.quantization)
    tokenizer = load_tokenizer(args.model, args.weights_dir)
    if args.disaggregate:
        from .disaggregated import serve_disaggregated
        engine = serve_disaggregated(args, model.config, str(device))
    else:
        engine = LLMEngine(model,
                           SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                           max_num_seqs=args.max_num_seqs,
                                           enable_chunked_prefill=args.enable_chunked_prefill),
                           cache_config=CacheConfig(block_size=args.block_size,
                                                    num_gpu_blocks_override=args.num_gpu_blocks_override,
                                                    gpu_memory_utilization=args.gpu_memory_utilization,
                                                    enable_prefix_caching=args.enable_prefix_caching),
                           enforce_eager=args.enforce_eager, record_timeline=False)
    log_file = open(args.request_log, "a") if args.request_log else None

    def write_record(out: RequestOutput) -> None:
        log_file.write(json.dumps(request_record(out)) + "\n")
        log_file.flush()

    name = args.served_model_name or args.model
    serving = make_serving(engine, tokenizer, name, args.max_queue, write_record if log_file else None,
                           root=args.model, chat_template=chat_template, limits=limits)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s minillm: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    server = Server(serving, config)
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it shut down for: make that a no-op
        signal.signal(sig, lambda s, frame: caught.append(s))
    weights = f"{str(model.dtype).removeprefix('torch.')}{f', {args.quantization} weights' * bool(args.quantization)}"
    print(f"serving {name} ({model.weights_source}, {weights}) on {device} at http://{args.host}:{args.port}/v1 "
          f"(max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, "
          f"chunked prefill {'on' if args.enable_chunked_prefill else 'off'}, prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'}, {engine.stats().num_blocks} KV blocks"
          f"{', prefill and decode on separate workers' if args.disaggregate else ''}; "
          f"torch threads: {threads.reason}, {lm_head_layout(model)}); "
          "Ctrl-C stops", flush=True)
    try:
        server.run()
    finally:
        serving.loop.stop(close=True)
        serving.text.close()
        if log_file:
            log_file.close()
    if not server.started:
        return 2  # could not bind the port: uvicorn has said why
    print("server stopped", file=sys.stderr)
    return 0
