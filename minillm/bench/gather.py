"""A paged decode step's gather, in groups of rows or in one copy: what each costs a served workload.

    python -m minillm.bench.gather --model gpt2 --num-prompts 32 --input-len 128 --output-len 64 --rounds 3

`PagedKVCache` gathers the decodes' K and V every layer of every step
(paged_attention.py). On a CPU it takes the rows in groups of at most
`GATHER_BYTES` (4 MiB), each into one scratch buffer it keeps; `--gather-bytes
0` takes every row in one copy, into a fresh buffer (as on a GPU).
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
from .workloads import add_random_arguments


def serve_once(model_name: str, num_prompts: int, input_len: int, output_len: int, gather_bytes: int | None,
               threads: int | None = None) -> dict:
    """The workload through one engine on the CPU, gathering in groups of `gather_bytes` (None: one copy)."""
    from ..checkpoints.load import load_model
    from ..engine import LLMEngine
    from ..scheduler import SchedulerConfig
    from .replay import greedy
    from .threads import apply_threads, choose_threads
    from .workloads import Workload
    threads = apply_threads(choose_threads(threads))
    model = load_model(model_name, "cpu", "auto")
    engine = LLMEngine(model, SchedulerConfig(max_num_seqs=num_prompts))
    engine.cache.gather_bytes = gather_bytes
    requests = Workload("random", num_prompts, model.config.vocab_size, model.config.n_ctx,
                        input_len=input_len, output_len=output_len).requests(float("inf"))
    for i, r in enumerate(requests):
        engine.add_request(r.prompt, greedy(r.max_tokens), request_id=str(i))
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.step()
        last = engine.timeline[-1]
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == num_prompts:
            steps.append((last.duration, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    seconds = time.perf_counter() - start
    if not steps:
        raise ValueError(f"no step decoded all {num_prompts} requests at once (with --output-len {output_len}, "
                         "or prompts that do not all fit in one step's budget): raise --output-len or lower "
                         "--num-prompts or --input-len")
    return {"tok_s": sum(r.max_tokens for r in requests) / seconds, "threads": threads.reason,  # each runs its length
            "gather_bytes": engine.cache.gather_bytes,
            "step_s": statistics.median(s for s, _ in steps), "faults": statistics.median(f for _, f in steps)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_random_arguments(p, input_len=128)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: the cores free as "
                                                                 "this run starts), the same for both sides")
    p.add_argument("--gather-bytes", type=int, default=None,
                   help=f"serve once with this bound in this process and print JSON (0: one copy); "
                        f"left out: both sides ({GATHER_BYTES} and 0) in turns, each in a fresh process")
    args = p.parse_args(argv)
    if args.rounds < 1 or (args.gather_bytes or 0) < 0:
        p.error(f"--rounds {args.rounds} must be at least 1 and --gather-bytes {args.gather_bytes} at least 0 "
                "(0: one copy)")
    work = (args.model, args.num_prompts, args.input_len, args.output_len)
    if args.gather_bytes is not None:
        print(json.dumps(serve_once(*work, args.gather_bytes or None, args.threads)))
        return []
    from .threads import choose_threads
    threads = choose_threads(args.threads)  # once, here: both sides compute on as many threads
    rounds = []
    for r in range(args.rounds):
        sides = {}
        for bound in ((GATHER_BYTES, 0) if r % 2 == 0 else (0, GATHER_BYTES)):
            out = subprocess.run([sys.executable, "-m", "minillm.bench.gather", *sys_args(args), "--gather-bytes",
                                  str(bound), "--threads", str(threads.threads)], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"the side with --gather-bytes {bound} failed:\n{out.stderr[-2000:]}")
            sides["groups" if bound else "one copy"] = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(sides)
        print(f"round {r + 1}: " + "; ".join(f"{name}: {s['tok_s']:.1f} tok/s, full-batch decode step "
                                            f"{s['step_s'] * 1e3:.0f} ms, {s['faults']:.0f} page faults a step"
                                            for name, s in sides.items()), flush=True)
    ratios = [s["groups"]["tok_s"] / s["one copy"]["tok_s"] for s in rounds]
    print(f"groups ÷ one copy (output tokens/s, {args.num_prompts} requests of {args.input_len} + {args.output_len} "
          f"tokens, {args.rounds} rounds in turns): {statistics.median(ratios):.2f} [{min(ratios):.2f}–"
          f"{max(ratios):.2f}]; each process: {threads.reason}")
    return rounds


def sys_args(args) -> list[str]:
    return ["--model", args.model, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


if __name__ == "__main__":
    main()
