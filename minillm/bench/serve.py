"""`python -m minillm bench-serve`: load an OpenAI-compatible server, and time it as its clients see it.

    python -m minillm serve --model gpt2 &
    python -m minillm bench-serve --base-url http://127.0.0.1:8000 --workload lognormal \\
        --num-prompts 50 --request-rate 4 --goodput ttft:500 itl:100 --save-result

Modelled on vLLM's `vllm bench serve`, with its flag and metric names; it only
speaks the OpenAI API, so it measures a vLLM server too. It draws a seeded
workload (`workloads.py`), sends each request at its arrival time, streams
every completion, and times it on the client with `time.perf_counter`:

    TTFT   send → the first token's event
    ITL    every gap between two token events (the server sends one event per token)
    TPOT   (E2E − TTFT) / (output tokens − 1), a request's mean time per output token
    E2E    send → the last event

It reports mean, median, p50, p90, p99 of each (ms), request and token
throughput, and goodput: the requests per second that met every `--goodput`
target (`ttft:MS`, `tpot:MS`, `e2el:MS`, and `itl:MS`, met when *every* gap is
within MS: a stall is what a user sees), and the share that met them; a failed
request meets none. Every request is greedy with `ignore_eos` (vLLM's field),
so each generates exactly its drawn number of tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import goodput
from .workloads import SHAPES, Request, Workload

GOODPUT_KEYS = ("ttft", "tpot", "itl", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw of one request; times are time.perf_counter seconds."""
    success: bool
    prompt_len: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each token's event arrived
    output_tokens: int = 0  # the server's usage count when it sent one, else the events counted
    id: str | None = None   # the completion's id, as the server named it
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = max(self.output_tokens, len(self.token_times))
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "itl:100"] → {"ttft": 0.5, "itl": 0.1} in seconds; a bad item is a ValueError saying why."""
    targets = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(GOODPUT_KEYS)} (as ttft:500)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the target must be milliseconds, as {key}:500") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the target must be > 0 ms")
        targets[key] = ms / 1e3
    return targets


# ---- the client --------------------------------------------------------------------------------


async def send(client, url: str, model: str, req: Request, extra: dict | None = None) -> RequestResult:
    """Stream one completion and time each token's event as it arrives."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    result = RequestResult(False, len(req.prompt), start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines between events, keep-alive comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now, event = time.perf_counter(), json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", str(event["error"]))
                    return result
                result.id = event.get("id", result.id)
                if event.get("choices"):
                    result.token_times.append(now)
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001  (a request that failed is counted as failed, and the run goes on)
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.output_tokens = result.output_tokens or len(result.token_times)
    result.success = bool(result.token_times)
    if not result.success:
        result.error = "the stream ended without a token"
    return result


async def benchmark(base_url: str, requests: list[Request], model: str | None = None,
                    endpoint: str = "/v1/completions", max_concurrency: int | None = None,
                    show_progress: bool = True, extra_body: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results (in request order) and the run's seconds."""
    import httpx
    from tqdm.auto import tqdm

    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:
        model = model or (await served_model(client, base_url))["id"]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not show_progress, leave=False)
        start = time.perf_counter()

        async def one(req: Request) -> RequestResult:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            if gate is None:
                result = await send(client, base_url + endpoint, model, req, extra_body)
            else:
                async with gate:
                    result = await send(client, base_url + endpoint, model, req, extra_body)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r) for r in requests))
        bar.close()
        ends = [r.token_times[-1] for r in results if r.token_times]
        return list(results), (max(ends) if ends else time.perf_counter()) - start


async def served_model(client, base_url: str) -> dict:
    """The first model the server lists at /v1/models (its "id", and vLLM's "max_model_len")."""
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]


# ---- the numbers ------------------------------------------------------------------------------------


def meets(r: RequestResult, targets: dict[str, float]) -> bool:
    """Did this request meet every target (seconds)? The course's one definition (goodput.py): itl, its every gap;
    the others, its own value."""
    return r.success and goodput.meets(r.ttft, r.itls, targets, {"tpot": r.tpot, "e2el": r.e2el})


def summarize(results: list[RequestResult], duration: float, targets: dict[str, float] | None = None) -> dict:
    """vLLM's metric names: counts, throughputs, {mean,median,std,p50,p90,p99}_{ttft,tpot,itl,e2el}_ms, goodput."""
    ok = [r for r in results if r.success]
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itls], "e2el": [r.e2el for r in ok]}
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
           "total_input_tokens": sum(r.prompt_len for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok),
           "request_throughput": len(ok) / duration if duration > 0 else 0.0}
    out["output_throughput"] = out["total_output_tokens"] / duration if duration > 0 else 0.0
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration \
        if duration > 0 else 0.0
    for name in METRICS:
        xs = np.array(values[name]) * 1e3
        out[f"mean_{name}_ms"] = float(xs.mean()) if xs.size else None
        out[f"median_{name}_ms"] = float(np.median(xs)) if xs.size else None
        out[f"std_{name}_ms"] = float(xs.std()) if xs.size else None
        for q in PERCENTILES:
            out[f"p{q}_{name}_ms"] = float(np.percentile(xs, q)) if xs.size else None
    if targets:
        good = sum(meets(r, targets) for r in results)
        out["goodput_targets_ms"] = {k: v * 1e3 for k, v in targets.items()}
        out["request_goodput"] = good / duration if duration > 0 else 0.0
        out["goodput_share"] = good / len(results) if results else 0.0
    out["errors"] = sorted({r.error for r in results if r.error})[:5]
    return out


def print_summary(s: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if "request_goodput" in s:
        targets = " ".join(f"{k}:{v:g}" for k, v in s["goodput_targets_ms"].items())
        rows += [(f"Request goodput (req/s) [{targets}]", f"{s['request_goodput']:.2f}"),
                 ("Requests meeting every target", f"{100 * s['goodput_share']:.1f}%")]
    for label, value in rows:
        print(f"{label:<44}{value:>16}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^60}")
        for stat in ("mean", "median", *(f"p{q}" for q in PERCENTILES)):
            value = s[f"{stat}_{name}_ms"]
            print(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):".ljust(44)
                  + (f"{value:>16.2f}" if value is not None else f"{'n/a':>16}"))
    for error in s["errors"]:
        print(f"error: {error}")
    print("=" * 60)


# ---- the command ------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--workload", default="lognormal", choices=SHAPES)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf (the default) sends every request at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=50257, help="prompt token ids are drawn below this (GPT-2's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output stay within this (default: the server's max_model_len, else 1024)")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--prompt-median", type=float, default=64)
    p.add_argument("--output-median", type=float, default=32)
    p.add_argument("--long-prompt-len", type=int, default=512)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="targets in ms: ttft, tpot, e2el, and itl (every gap of a request); e.g. ttft:500 itl:100")
    p.add_argument("--save-result", action="store_true", help="write the summary and per-request records as JSON")
    p.add_argument("--result-filename", default=None, help="where --save-result writes (default: a name with the time)")
    p.add_argument("--disable-tqdm", action="store_true")


async def _max_model_len(base_url: str) -> int | None:
    import httpx
    async with httpx.AsyncClient(timeout=10.0) as client:
        return (await served_model(client, base_url.rstrip("/"))).get("max_model_len")


def run(args: argparse.Namespace) -> int:
    targets = parse_goodput(args.goodput)
    for flag in ("num_prompts", "vocab_size", "random_input_len", "random_output_len", "long_prompt_len",
                 "prefix_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    import httpx
    try:
        max_len = args.max_model_len or asyncio.run(_max_model_len(args.base_url)) or 1024
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at --base-url {args.base_url} ({type(e).__name__}: {e}); "
                         "start one (python -m minillm serve) or point --base-url at it") from None
    requests = Workload(args.workload, args.num_prompts, args.vocab_size, max_len, seed=args.seed,
                        input_len=args.random_input_len, output_len=args.random_output_len,
                        prompt_median=args.prompt_median, output_median=args.output_median,
                        long_prompt_len=args.long_prompt_len, long_fraction=args.long_fraction,
                        prefix_len=args.prefix_len).requests(args.request_rate)
    results, duration = asyncio.run(benchmark(args.base_url, requests, args.model, args.endpoint,
                                              args.max_concurrency, not args.disable_tqdm))
    summary = summarize(results, duration, targets)
    summary.update(workload=args.workload, request_rate=args.request_rate, num_prompts=args.num_prompts,
                   base_url=args.base_url)
    print_summary(summary)
    if args.save_result:
        path = Path(args.result_filename or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
        records = [{**asdict(r), "ttft": r.ttft if r.success else None} for r in results]
        path.write_text(json.dumps({**summary, "requests": records}, indent=1))
        print(f"wrote {path}")
    return 0 if summary["completed"] else 1