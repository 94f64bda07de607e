"""What prefix caching saves, measured: workloads that repeat themselves, served with caching off and on.

    python -m minillm.prefix_bench --model gpt2 [--workloads shared,turns,control] [--requests 16]
        [--max-tokens 32] [--concurrency N] [--repeats 3] [--threads 1] [--quick] [--json PATH]

Three workloads, each drawn from a seed:

    shared    n requests: one system prompt of S tokens, then a distinct suffix of U tokens each
    turns     c conversations of t turns; each turn resends the whole history (every earlier
              prompt and answer) followed by a new user message
    control   n requests of S + U distinct tokens: nothing to share, so caching can only cost

Requests come from a closed loop of `concurrency` clients (all at once by default): a
client sends a conversation's next turn as soon as the answer to the last one is
complete, and starts the next conversation when its own has ended. TTFT counts from
the moment a request is added.

For each run: TTFT p50 and p90 (of all requests, and of those that hit the cache),
throughput (generated tokens ÷ makespan), prefill tokens actually computed, the hit
rate over all prompt tokens, and KV blocks in use (peak and mean over steps; cached
blocks nobody holds count as free, since any allocation may take them).

A shared machine only ever adds time, and by different amounts from one minute to
the next. So `compare` runs caching off and on back to back, for every workload and
every repeat, alternating which goes first, and reports each ratio per repeat: a
ratio of two neighbouring runs, not of two medians taken minutes apart. On a CPU
that other processes share, `--threads 1` steadies the figures: with every core
in use, a step of many small operations can wait at each one for a thread that
was descheduled (the same decode step was seen to take 0.6 s and 1.3 s with two
threads, 0.31 s and 0.46 s with one).

What to expect: TTFT of a hit ≈ the prefill of its uncached suffix, so with one
client (`--concurrency 1`, no queueing) it falls by up to P / (P − S), the ratio
of the matmul work (attention over the whole context and each step's fixed costs
remain); with all requests at once it includes the queue. Throughput gains as much as the work
was prefill: decode is untouched, so longer answers dilute the gain.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .engine import LLMEngine
from .sampling import SamplingParams
from .scheduler import SchedulerConfig


@dataclass
class Conversation:
    turns: list[list[int]]  # the user's message each turn; a turn's prompt is the history so far, then this
    max_tokens: int         # the length of every answer (greedy, no early stop)


def shared_prefix_workload(n: int, prefix_len: int, suffix_len: int, max_tokens: int, vocab_size: int,
                           seed: int = 0) -> list[Conversation]:
    """n one-turn requests: the same system prompt of `prefix_len` tokens, then `suffix_len` tokens of their own."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [Conversation([system + [rng.randrange(vocab_size) for _ in range(suffix_len)]], max_tokens)
            for _ in range(n)]


def multi_turn_workload(n: int, turns: int, first_len: int, user_len: int, max_tokens: int, vocab_size: int,
                        seed: int = 0) -> list[Conversation]:
    """n conversations: a first message of `first_len` tokens, then `turns` − 1 messages of `user_len`."""
    rng = random.Random(seed)
    return [Conversation([[rng.randrange(vocab_size) for _ in range(first_len if t == 0 else user_len)]
                          for t in range(turns)], max_tokens) for _ in range(n)]


def no_sharing_workload(n: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> list[Conversation]:
    """The control: n one-turn requests of `prompt_len` tokens, nothing in common."""
    rng = random.Random(seed)
    return [Conversation([[rng.randrange(vocab_size) for _ in range(prompt_len)]], max_tokens) for _ in range(n)]


def longest_request(conversations: list[Conversation]) -> int:
    """The most tokens one request of the workload holds: the whole history before its last answer's last token."""
    return max(sum(len(t) for t in c.turns) + len(c.turns) * c.max_tokens - 1 for c in conversations)


def serve(engine: LLMEngine, conversations: list[Conversation], concurrency: int | None = None) -> dict:
    """Serve a workload from `concurrency` closed-loop clients (all conversations at once by default)."""
    waiting = deque(range(len(conversations)))
    active: dict[str, tuple[int, int, list[int]]] = {}  # request id → (conversation, turn, prompt)
    records, first_step = [], len(engine.timeline)

    def send(c: int, turn: int, history: list[int]) -> None:
        prompt = history + conversations[c].turns[turn]
        params = SamplingParams(temperature=0.0, max_tokens=conversations[c].max_tokens, ignore_eos=True)
        active[engine.add_request(prompt, params)] = (c, turn, prompt)

    t0 = time.perf_counter()
    for _ in range(min(concurrency or len(conversations), len(conversations))):
        send(waiting.popleft(), 0, [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c, turn, prompt = active.pop(out.request_id)
            records.append({"conversation": c, "turn": turn, "prompt_tokens": len(prompt),
                            "cached_tokens": out.num_cached_tokens, "generated_tokens": len(out.output_token_ids),
                            "ttft_s": out.metrics.ttft, "finished_s": out.metrics.finished_time - t0})
            if turn + 1 < len(conversations[c].turns):
                send(c, turn + 1, prompt + out.output_token_ids)
            elif waiting:
                send(waiting.popleft(), 0, [])
    steps = engine.timeline[first_step:]
    in_use = [engine.block_manager.num_blocks - s.num_free_blocks for s in steps]
    makespan = max(r["finished_s"] for r in records)
    hits = [r["ttft_s"] for r in records if r["cached_tokens"]]
    ttfts = [r["ttft_s"] for r in records]
    return {"requests": len(records), "makespan_s": makespan,
            "throughput": sum(r["generated_tokens"] for r in records) / makespan,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "hit_ttft_p50_s": percentile(hits, 50), "hit_ttft_p90_s": percentile(hits, 90),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "prefill_tokens_computed": sum(s.num_prefill_tokens for s in steps),
            "hit_rate": sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
            "peak_blocks_in_use": max(in_use), "mean_blocks_in_use": statistics.mean(in_use),
            "records": sorted(records, key=lambda r: (r["conversation"], r["turn"]))}


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def make_engine(model, conversations: list[Conversation], caching: bool, block_size: int = 16) -> LLMEngine:
    """An engine whose pool holds every request of the workload at once: no run preempts, caching is the
    only difference."""
    per_request = -(-longest_request(conversations) // block_size)
    return LLMEngine(model, SchedulerConfig(max_num_seqs=max(len(conversations), 1)), block_size=block_size,
                     num_blocks=per_request * len(conversations), enable_prefix_caching=caching)


def compare(model, workloads: dict[str, list[Conversation]], repeats: int = 3,
            concurrency: int | None = None, on_run=None) -> dict:
    """Every workload with caching off and on, back to back, `repeats` times, alternating which goes first.

    Returns, per workload: every run, and per repeat the ratios on ÷ off of TTFT p50 (all requests, and of the
    requests that hit, against the same requests without caching) and of throughput. `on_run(name, caching,
    run)` is called after every run, to show progress.
    """
    result = {}
    for name, conversations in workloads.items():
        runs = {False: [], True: []}
        for r in range(repeats):
            for caching in ((False, True) if r % 2 == 0 else (True, False)):
                runs[caching].append(serve(make_engine(model, conversations, caching), conversations, concurrency))
                if on_run:
                    on_run(name, caching, runs[caching][-1])
        ratios = [pair_ratios(off, on) for off, on in zip(runs[False], runs[True])]
        result[name] = {"off": runs[False], "on": runs[True], "ratios": ratios,
                        "median_ratios": {k: statistics.median(r[k] for r in ratios) for k in ratios[0]}}
    return result


def pair_ratios(off: dict, on: dict) -> dict:
    """How many times lower TTFT is with caching, and how many times higher throughput, in one pair of runs."""
    hit = {(r["conversation"], r["turn"]) for r in on["records"] if r["cached_tokens"]}
    same_off = [r["ttft_s"] for r in off["records"] if (r["conversation"], r["turn"]) in hit]
    same_on = [r["ttft_s"] for r in on["records"] if (r["conversation"], r["turn"]) in hit]
    return {"ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
            "hit_ttft_p50_speedup": percentile(same_off, 50) / percentile(same_on, 50) if hit else float("nan"),
            "throughput_gain": on["throughput"] / off["throughput"],
            "prefill_tokens_ratio": on["prefill_tokens_computed"] / off["prefill_tokens_computed"]}


def default_workloads(vocab_size: int, n_ctx: int, quick: bool, n: int | None = None, answer: int | None = None,
                      seed: int = 0) -> dict[str, list[Conversation]]:
    """A 768-token system prompt with 32-token suffixes (n requests, 16 by default), conversations of 4 turns
    (n / 2 of them), answers of `answer` tokens (32 by default); or small sizes with `quick`."""
    if quick:
        prefix, suffix, first, user, turns = 48, 8, 24, 8, 3
    else:
        prefix, suffix, first, user, turns = 768, 32, 256, 64, 4
    n, answer = n or (4 if quick else 16), answer or (4 if quick else 32)
    assert prefix + suffix + answer <= n_ctx and first + (turns - 1) * (answer + user) + answer <= n_ctx
    return {"shared": shared_prefix_workload(n, prefix, suffix, answer, vocab_size, seed),
            "turns": multi_turn_workload(n // 2, turns, first, user, answer, vocab_size, seed + 1),
            "control": no_sharing_workload(n, prefix + suffix, answer, vocab_size, seed + 2)}


def report(result: dict) -> list[str]:
    lines = [f"{'workload':9} {'cache':5} {'TTFT p50':>9} {'p90':>8} {'hit p50':>8} {'tok/s':>7} {'prefilled':>9} "
             f"{'hit rate':>8} {'peak blk':>8}"]
    for name, r in result.items():
        for caching in ("off", "on"):
            run = min(r[caching], key=lambda x: x["makespan_s"])  # the least disturbed repeat
            lines.append(f"{name:9} {caching:5} {run['ttft_p50_s']:9.3f} {run['ttft_p90_s']:8.3f} "
                         f"{run['hit_ttft_p50_s']:8.3f} {run['throughput']:7.1f} {run['prefill_tokens_computed']:9d} "
                         f"{run['hit_rate']:8.1%} {run['peak_blocks_in_use']:8d}")
        per_repeat = ", ".join(f"{x['throughput_gain']:.3f}" for x in r["ratios"])
        hit = ", ".join(f"{x['hit_ttft_p50_speedup']:.1f}" for x in r["ratios"])
        lines.append(f"  {name}: throughput on/off per repeat [{per_repeat}]; TTFT of a hit, off/on [{hit}]")
    return lines


def main(argv=None) -> int:
    from .weights import load_model, resolve_device, resolve_dtype

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=None, help="closed-loop clients (default: all at once)")
    parser.add_argument("--requests", type=int, default=None, help="requests of the shared and control workloads")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 32)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--workloads", default="shared,turns,control")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model = load_model(args.model, device=device, dtype=resolve_dtype(args.dtype, device))
    workloads = default_workloads(model.config.vocab_size, model.config.n_ctx, args.quick, args.requests,
                                  args.max_tokens)
    workloads = {k: workloads[k] for k in args.workloads.split(",")}
    warm = no_sharing_workload(2, 32, 2, model.config.vocab_size)
    serve(make_engine(model, warm, False), warm)  # the first forward passes allocate; keep them out of the figures
    result = compare(model, workloads, args.repeats, args.concurrency, on_run=lambda name, caching, run: print(
        f"{time.strftime('%H:%M:%S')} {name} caching {'on' if caching else 'off'}: makespan {run['makespan_s']:.1f} s, "
        f"TTFT p50 {run['ttft_p50_s']:.3f} s", file=sys.stderr, flush=True))
    print("\n".join(report(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
