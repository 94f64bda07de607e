"""What serving costs: `minillm serve` against its own engine offline, on the same workload, in turns.

    python -m minillm.bench.serve_overhead --model gpt2 --num-prompts 32 --rounds 3

Each round runs one seeded workload (`workloads.Workload`, every request at
once, greedy, `ignore_eos`) twice: through a server started for the run
(`python -m minillm serve` in a process of its own, loaded by `bench-serve`'s
client) and through an `LLMEngine` of the same configuration in this process
(`replay.replay`). Both count output tokens ÷ the time from the first request
to the last token; the ratio served ÷ offline is taken within each round, and
its median and range are printed. What the server adds: HTTP and JSON per
request, one server-sent event per token, and the asyncio loop beside the
engine thread, all on the cores the engine computes on. The aim (`AIM`):
served ≥ 0.9 × offline. Both sides take the cores free as they start and
OpenMP's passive policy (`threads.py`); the server runs while the offline
engine does not, and the reverse. docs/serving.md has what it measured, and
on which machines.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

from .replay import replay
from .serve import benchmark
from .workloads import Workload, add_random_arguments

AIM = 0.9


def start_server(model: str, port: int, max_num_seqs: int) -> subprocess.Popen:
    import httpx
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", model, "--port", str(port),
                             "--max-num-seqs", str(max_num_seqs), "--max-queue", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not start: {proc.stderr.read()[-2000:]}")


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_arguments(p, input_len=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    args = p.parse_args(argv)
    if args.port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    from ..checkpoints.load import load_model
    from ..engine import LLMEngine
    from ..scheduler import SchedulerConfig
    from .threads import apply_threads, choose_threads
    threads = apply_threads(choose_threads())
    model = load_model(args.model, "auto", "auto")
    work = Workload("random", args.num_prompts, model.config.vocab_size, model.config.n_ctx,
                    input_len=args.input_len, output_len=args.output_len)
    tokens = sum(o for _, o in work)
    rates = {"served": [], "offline": []}
    for r in range(args.rounds):
        for side in (("served", "offline") if r % 2 == 0 else ("offline", "served")):
            if side == "served":
                server = start_server(args.model, args.port, args.max_num_seqs)
                try:
                    results, seconds = asyncio.run(benchmark(f"http://127.0.0.1:{args.port}", work.requests(
                        float("inf")), show_progress=False))
                finally:
                    server.terminate()
                    server.wait()
                assert all(x.success for x in results), "a served request failed"
            else:
                engine = LLMEngine(model, SchedulerConfig(max_num_seqs=args.max_num_seqs), record_timeline=True)
                seconds = replay(engine, work.requests(float("inf"))).seconds
            rates[side].append(tokens / seconds)
        print(f"round {r + 1}: served {rates['served'][-1]:.1f} tok/s, offline {rates['offline'][-1]:.1f} tok/s",
              flush=True)
    ratios = [s / o for s, o in zip(rates["served"], rates["offline"])]
    print(f"serve ÷ offline (output tokens/s, {args.num_prompts} requests of {args.input_len} + {args.output_len} "
          f"tokens, {args.rounds} rounds in turns): {statistics.median(ratios):.3f} [{min(ratios):.3f}–"
          f"{max(ratios):.3f}] (aim ≥ {AIM}); this process: {threads.reason}")
    return ratios


if __name__ == "__main__":
    main()
