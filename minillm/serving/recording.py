"""Does the live page cost the engine anything when nobody watches? Stepping with recording and without, in turns.

    python -m minillm.serving.recording [--model tiny] [--requests 32] [--max-tokens 64] [--rounds 15]

Recording is two pieces of work per step. The engine keeps the step's rows in
`last_step` (`record_steps`, a tuple per row, inside the step), and the server's
engine thread then hands the engine to `StepRecorder.record` (`serving/live.py`):
each running request's block table, the queue ids, one slot of a ring. Nobody
reads the ring unless a page is open, and that work must stay under 1% of the
engine's time, or the page would slow the engine it shows.

Recording is switched on and off step by step: within one run every other step
is recorded, and the steps around it are not. Two neighbouring steps have nearly
the same batch and meet nearly the same load, so on a machine that other
programs keep busy the comparison stays sharp (whole runs with and without
recording, in turns, scatter there by far more than the 1% looked for;
docs/lessons_notes.md). Each round runs the workload twice, recording the even
steps in one run and the odd steps in the other, and its value is the mean
recorded step ÷ the mean other step, the recorder's time included. The workload
is `--requests` prompts of 16–64 random tokens, `--max-tokens` each, all queued
at once, prefix caching on, and every run's prompts new, so no run finds
another's blocks cached. The claim holds when the interval of the median ratio
(`bench/verdict.py`) lies at or below 1.01; when the rounds scatter too much,
the verdict is INCONCLUSIVE and says so. What this design cannot see: the
garbage collector's extra work for the ring's records falls on recorded and
other steps alike, so half of it is hidden; the records are built of plain
tuples, which the collector stops tracking.

It prints the CPU, the step time, the time spent inside the recorder per step
(timed in the recording half of each round), the verdict and the machine's load
while it measured; `--json` also writes them. The default model is `tiny`, the
smallest step and so the hardest case: the recorder's cost does not grow with
the model, the step does. It lives in the server's package, beside the
recorder it measures, and needs the [serve] extra.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ..bench.threads import apply_threads, choose_threads
from ..bench.timing import device_name
from ..bench.verdict import Check, MachineLoad, interleave, judge, print_verdict, read_load, settled
from ..checkpoints.load import add_model_arguments, load_model
from ..device import resolve_device, resolve_dtype
from ..engine import LLMEngine
from ..kv_pool import CacheConfig
from ..sampling_params import SamplingParams
from ..scheduler import SchedulerConfig
from .live import StepRecorder

LINE = 1.01  # recording may add at most 1% to the engine's time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.set_defaults(model="tiny")
    parser.add_argument("--requests", type=int, default=32, help="requests per run, queued at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--rounds", type=int, default=15, help="rounds asked for (more are added until decided)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: the free cores)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


class Workload:
    """One engine, and a fresh batch of prompts for every run."""

    def __init__(self, engine: LLMEngine, requests: int, max_tokens: int, seed: int = 0):
        self.engine, self.requests, self.max_tokens = engine, requests, max_tokens
        self.rng = random.Random(seed)
        self.vocab = engine.config.vocab_size

    def run(self, recorder: StepRecorder, first_on: bool) -> tuple[float, float, float]:
        """Queue the prompts and step until all finish, recording every other step (the first if `first_on`) as
        the server's engine thread does: the engine keeps that step's rows (`record_steps`) and `recorder.record`
        runs after it. Returns the seconds of the recorded steps, record included, per step; of the others, per
        step; and the seconds inside `record`, per recorded step."""
        engine, params = self.engine, SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        for _ in range(self.requests):
            engine.add_request([self.rng.randrange(self.vocab) for _ in range(self.rng.randint(16, 64))], params)
        seconds, steps, in_record, on = [0.0, 0.0], [0, 0], 0.0, first_on
        while engine.has_unfinished_requests():
            engine.record_steps = on
            t0 = time.perf_counter()
            engine.step()
            if on:
                t1 = time.perf_counter()
                recorder.record(engine)
                in_record += time.perf_counter() - t1
            seconds[on] += time.perf_counter() - t0
            steps[on] += 1
            on = not on
        return seconds[1] / steps[1], seconds[0] / steps[0], in_record / steps[1]


def ratios(rounds) -> list[float]:
    """Per round: the mean recorded step ÷ the mean other step, over its two runs (recording the even steps in
    one and the odd steps in the other, so that neither side always gets the first step of a pair)."""
    return [(a[0] + b[0]) / (a[1] + b[1]) for a, b in zip(rounds.results("even"), rounds.results("odd"))]


def run(args: argparse.Namespace) -> int:
    choice = apply_threads(choose_threads(args.threads))
    device = resolve_device(args.device)
    model = load_model(args.model, device, resolve_dtype(args.dtype, device), args.weights_dir)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=args.requests),
                       cache_config=CacheConfig(enable_prefix_caching=True), record_timeline=False)
    workload = Workload(engine, args.requests, args.max_tokens)
    recorder = StepRecorder()
    where = device_name(device)
    print(f"{args.model} on {device} ({where}), {choice.threads} torch threads; {args.requests} requests × "
          f"{args.max_tokens} tokens per run, {engine.block_manager.num_blocks} KV blocks, prefix caching on")
    before = read_load()
    checks = lambda r: [Check("step time recording ÷ not", ratios(r), LINE, "<=", fmt="{:.4f}",
                              why="recording took more than 1% of a step's time: see the time inside the recorder "
                                  "above (the rest is the engine's rows, built inside its step)")]
    rounds = interleave({"even": lambda: workload.run(recorder, True), "odd": lambda: workload.run(recorder, False)},
                        repeats=args.rounds, until=settled(checks), desc="recording every other step")
    load = MachineLoad.between(before, read_load())
    step_s = statistics.median(off for name in ("even", "odd") for _, off, _ in rounds.results(name))
    per_step = statistics.median(inside for name in ("even", "odd") for *_, inside in rounds.results(name))
    print(f"a step: {step_s * 1e3:.3f} ms without recording (median of {rounds.count} rounds); inside the recorder "
          f"{per_step * 1e6:.1f} µs, {per_step / step_s:.2%} of a step (the rest of recording, the engine's rows, "
          "runs inside its step)")
    verdict = judge("recording every step for the live page costs the engine at most 1% of its time, nobody "
                    "watching", checks(rounds), load, [rounds])
    print_verdict(verdict)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": str(device), "cpu": where, "threads": choice.threads,
                       "step_s": step_s, "recorder_s_per_step": per_step,
                       "verdict": verdict.as_dict()}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.serving.recording", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    with torch.inference_mode():
        return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
