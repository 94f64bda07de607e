"""The flags of `python -m minillm serve` and `bench-serve`, kept apart from the server's imports.

FastAPI, uvicorn, prometheus-client, Jinja and httpx come with the `[serve]` extra.
`python -m minillm --help` works without them; running either command
without them is one `error:` line that says what to install.
"""
from __future__ import annotations

import argparse
import importlib

SERVE_EXTRA = 'python -m pip install -e ".[serve]"'
SERVE_MODULES = ("fastapi", "starlette", "uvicorn", "prometheus_client", "jinja2", "httpx")


def _needs_serve_extra(module: str):
    try:
        return importlib.import_module(f"minillm.{module}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in SERVE_MODULES:
            raise ValueError(f"{e.name} is not installed; serving needs the [serve] extra: {SERVE_EXTRA}") from None
        raise


def run_serve(args: argparse.Namespace) -> int:
    return _needs_serve_extra("serving.launch").run(args)


def run_bench_serve(args: argparse.Namespace) -> int:
    _needs_serve_extra("serving.api_server")  # the same extra: httpx, and the rest with it
    from ..bench import serve as bench_serve
    return bench_serve.run(args)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's knobs under vLLM's flag names, and the server's own."""
    from ..checkpoints.load import add_model_arguments, add_quantization_argument
    from ..scheduler import SchedulerConfig
    d = SchedulerConfig()
    add_model_arguments(parser)
    add_quantization_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=d.enable_chunked_prefill)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="the KV pool in blocks, whatever the memory (also on the CPU, where the default is 1 GiB)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: the cores free as the server starts)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests that may wait for a slot in the batch; past it, 429 with Retry-After")
    from .limits import ServerLimits
    limits = ServerLimits()
    group = parser.add_argument_group("limits on one request", "each checked before any work is done for the "
                                      "request; past one, a 400 naming the field, the value, the limit and the flag "
                                      "(n is bounded by --max-num-seqs, the prompts of one body by --max-num-seqs + "
                                      "--max-queue, a prompt by the model's context)")
    group.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                       help="the largest request body read, in bytes; past it, 413 (default: %(default)s)")
    group.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                       help="stop strings one request may send (default: %(default)s)")
    group.add_argument("--max-stop-chars", type=int, default=limits.max_stop_chars,
                       help="characters of all a request's stop strings together (default: %(default)s)")
    group.add_argument("--max-logprobs", type=int, default=limits.max_logprobs,
                       help="top log-probabilities per token (logprobs, top_logprobs), as vLLM's (default: "
                            "%(default)s, also the engine's most)")
    group.add_argument("--max-logprob-entries", type=int, default=limits.max_logprob_entries,
                       help="log-probability entries one answer may carry: choices x positions (generated, and the "
                            "prompt's with echo) x (1 + logprobs) (default: %(default)s)")
    group.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                       help="seconds a request's body may take to arrive whole; past them, 408 (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds running requests get to finish after SIGINT/SIGTERM; the rest are aborted")
    parser.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="close a connection with no request in progress this many seconds after it opened "
                             "or after its last response")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every path but /health, /metrics and /live "
                             "(default: $MINILLM_API_KEY; neither: no key needed)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template for /v1/chat/completions (GPT-2 has none: without it, 400)")
    parser.add_argument("--enable-fastapi-docs", action="store_true", help="serve /docs and /openapi.json")
    parser.add_argument("--disaggregate", action="store_true",
                        help="prefill and decode on two worker processes, each on its own half of the cores, the KV "
                             "moved between them over torch.distributed (minillm/kv_connector.py, lesson 15)")
    parser.add_argument("--request-log", default=None,
                        help="append the engine's record of each finished request to this file as JSON lines "
                             "(arrival and token times in time.perf_counter seconds; lesson 12 reads it)")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, streamed or not)",
                              description="Serve the engine over HTTP: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /tokenize, /detokenize, /health, /metrics. Needs the "
                                          "[serve] extra.")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    p = subparsers.add_parser("bench-serve", help="load an OpenAI-compatible server; TTFT/ITL percentiles, goodput",
                              description="Replay a workload against --base-url, timing each streamed token on "
                                          "the client, like `vllm bench serve`. Needs the [serve] extra.")
    from ..bench.serve import add_arguments
    add_arguments(p)
    p.set_defaults(func=run_bench_serve)
