"""A paged decode step's gather, in groups of rows or in one copy: what each costs a served workload.

    python -m minillm.bench.gather --model gpt2 --num-prompts 32 --input-len 128 --output-len 64 --rounds 3

`PagedKVCache` gathers the decodes' K and V into a fresh buffer every layer of
every step (paged_attention.py). On a CPU it takes the rows in groups of at
most `GATHER_BYTES` (4 MiB); `--gather-bytes 0` takes every row in one copy.
Each side serves the same seeded workload (every request at once, greedy,
`ignore_eos`) in a fresh process, the sides in turns, round after round, and
reports the output tokens per second and, over the steps that decode the whole
batch, the median step time and the minor page faults the process took per
step (`getrusage`): a buffer the allocator maps afresh (glibc maps anything
over its threshold, at most 32 MiB, and unmaps it when freed) is faulted in
page by page, every layer, every step.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from ..paged_attention import GATHER_BYTES


def serve_once(model_name: str, num_prompts: int, input_len: int, output_len: int, gather_bytes: int | None) -> dict:
    """The workload through one engine, gathering in groups of `gather_bytes` (None: one copy)."""
    from ..checkpoints.load import load_model
    from ..engine import LLMEngine
    from ..scheduler import SchedulerConfig
    from .replay import greedy
    from .threads import apply_threads, choose_threads
    from .workloads import Workload
    threads = apply_threads(choose_threads())
    model = load_model(model_name, "auto", "auto")
    engine = LLMEngine(model, SchedulerConfig(max_num_seqs=num_prompts))
    engine.cache.gather_bytes = gather_bytes
    for i, r in enumerate(Workload("random", num_prompts, model.config.vocab_size, model.config.n_ctx,
                                   input_len=input_len, output_len=output_len).requests(float("inf"))):
        engine.add_request(r.prompt, greedy(r.max_tokens), request_id=str(i))
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.step()
        last = engine.timeline[-1]
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == num_prompts:
            steps.append((last.duration, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    seconds = time.perf_counter() - start
    return {"tok_s": num_prompts * output_len / seconds, "threads": threads.reason,  # each request runs its length
            "gather_bytes": engine.cache.gather_bytes,
            "step_s": statistics.median(s for s, _ in steps), "faults": statistics.median(f for _, f in steps)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gather-bytes", type=int, default=None,
                   help=f"serve once with this bound in this process and print JSON (0: one copy); "
                        f"left out: both sides ({GATHER_BYTES} and 0) in turns, each in a fresh process")
    args = p.parse_args(argv)
    work = (args.model, args.num_prompts, args.input_len, args.output_len)
    if args.gather_bytes is not None:
        print(json.dumps(serve_once(*work, args.gather_bytes or None)))
        return []
    rounds = []
    for r in range(args.rounds):
        sides = {}
        for bound in ((GATHER_BYTES, 0) if r % 2 == 0 else (0, GATHER_BYTES)):
            out = subprocess.run([sys.executable, "-m", "minillm.bench.gather", *sys_args(args), "--gather-bytes",
                                  str(bound)], capture_output=True, text=True, check=True).stdout
            sides["groups" if bound else "one copy"] = json.loads(out.strip().splitlines()[-1])
        rounds.append(sides)
        print(f"round {r + 1}: " + "; ".join(f"{name}: {s['tok_s']:.1f} tok/s, full-batch decode step "
                                            f"{s['step_s'] * 1e3:.0f} ms, {s['faults']:.0f} page faults a step"
                                            for name, s in sides.items()), flush=True)
    ratios = [s["groups"]["tok_s"] / s["one copy"]["tok_s"] for s in rounds]
    print(f"groups ÷ one copy (output tokens/s, {args.num_prompts} requests of {args.input_len} + {args.output_len} "
          f"tokens, {args.rounds} rounds in turns): {statistics.median(ratios):.2f} [{min(ratios):.2f}–"
          f"{max(ratios):.2f}]; each process: {rounds[0]['groups']['threads']}")
    return rounds


def sys_args(args) -> list[str]:
    return ["--model", args.model, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


if __name__ == "__main__":
    main()
