"""`python -m minillm serve`: build the engine, serve it over HTTP until SIGINT/SIGTERM, exit 0.

SIGINT or SIGTERM: stop admitting (new requests get 503), give the running
requests `--shutdown-timeout` seconds to finish, abort the rest (their streams
end with finish_reason "abort"), stop the engine thread, exit 0.
"""
from __future__ import annotations

import json
import signal
import sys

from ..engine import LLMEngine, RequestOutput
from .api_server import build_app, make_frontend


def request_record(out: RequestOutput) -> dict:
    """The engine's own record of a finished request, as --request-log writes it."""
    m = out.metrics
    return {"id": out.request_id, "arrival": m.arrival_time, "token_times": m.token_times,
            "finished": m.finished_time, "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "num_preemptions": out.num_preemptions}


def run(args) -> int:
    """`python -m minillm serve`: build the engine, serve until SIGINT/SIGTERM, exit 0."""
    import uvicorn
    from ..scheduler import SchedulerConfig
    from ..checkpoints.tokenizer import load_tokenizer
    from ..checkpoints.load import load_model
    from ..device import resolve_device, resolve_dtype
    device = resolve_device(args.device)
    model = load_model(args.model, device, resolve_dtype(args.dtype, device), args.weights_dir)
    tokenizer = load_tokenizer(args.model, args.weights_dir)
    if getattr(args, "disaggregate", False):
        from .disaggregated import serve_disaggregated
        engine = serve_disaggregated(args, model.config, str(device))
    else:
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
          f"{'on' if args.enable_prefix_caching else 'off'}, {engine.block_manager.num_blocks} KV blocks"
          f"{', prefill and decode on separate workers' if getattr(args, 'disaggregate', False) else ''}); "
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
