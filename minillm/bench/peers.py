"""minillm beside llama.cpp and CTranslate2: one checkpoint, one machine, one run, the engines in turns.

    python -m minillm.bench.peers                       # gpt2's shape, 2 threads, 3 rounds

The same random-init checkpoint (`peer_engines.write_checkpoint`) goes to every engine: minillm loads it
in fp32, int8 weight-only (`--quantization int8`), int8 with int8 activations (`w8a8`, as Q8_0 and
CTranslate2's int8 compute) and bf16; llama.cpp reads it as f32 and Q8_0 GGUF;
CTranslate2 as float32 and int8. Each round times, in each engine and in an order that rotates from
round to round, a decode step of 1, 4 and 16 sequences after `--context` cached tokens and a prefill of
`--prompt-len` tokens; the table holds the medians over rounds. minillm's step
is `steps.decode_step`, the model's forward step over the contiguous cache that `bench` sweeps.

Beside each minillm dtype: its weight-read floor, the bytes one step reads as the model stores them
(`cost.weight_bytes_read`) over the read bandwidth measured in the same run (`roofline.py`). The ratios
against the peers are taken round by round, so a load that comes and goes falls on both sides of each,
and are printed as the median and the range over rounds.

A peer that cannot run here (llama.cpp not built and not buildable, CTranslate2 not installed) gets one
line saying what was tried and what failed, and the table holds the others.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .peer_engines import (LLAMA_SDIST, PeerMissing, ct2_models, ct2_steps, llama_cpp, llama_steps, to_gguf,
                           write_checkpoint)

MINILLM = {"minillm fp32": ("fp32", None), "minillm int8": ("fp32", "int8"), "minillm w8a8": ("fp32", "w8a8"),
           "minillm bf16": ("bf16", None)}
LLAMA = {"llama.cpp f32": "f32", "llama.cpp Q8_0": "Q8_0"}
CT2 = {"CTranslate2 float32": "float32", "CTranslate2 int8": "int8"}
# (what is compared, numerator (engine, batch or "prefill"), denominator, the target, which way)
RATIOS = [("fp32 batch 1 ÷ llama.cpp f32", ("minillm fp32", 1), ("llama.cpp f32", 1), 1.05, "≤"),
          ("int8 batch 1 ÷ llama.cpp Q8_0", ("minillm int8", 1), ("llama.cpp Q8_0", 1), 1.2, "≤"),
          ("int8 batch 16 ÷ llama.cpp Q8_0", ("minillm int8", 16), ("llama.cpp Q8_0", 16), 1.0, "≤"),
          ("int8 batch 16 ÷ CTranslate2 int8", ("minillm int8", 16), ("CTranslate2 int8", 16), 1.0, "≤"),
          ("fp32 prefill ÷ llama.cpp f32 (tok/s)", ("minillm fp32", "prefill"), ("llama.cpp f32", "prefill"),
           1.0, "≥"),
          # like for like: Q8_0 (blocks of 32) and CTranslate2's int8 (per row) round the activations to int8 too
          ("w8a8 batch 1 ÷ llama.cpp Q8_0", ("minillm w8a8", 1), ("llama.cpp Q8_0", 1), 1.2, "≤"),
          ("w8a8 batch 16 ÷ llama.cpp Q8_0", ("minillm w8a8", 16), ("llama.cpp Q8_0", 16), 1.0, "≤"),
          ("w8a8 batch 16 ÷ CTranslate2 int8", ("minillm w8a8", 16), ("CTranslate2 int8", 16), 1.0, "≤")]
BUILD_MIN, CONVERT_MIN, ROUND_S = 20, 3, 160  # the first run's build and conversions, a round: on 2 busy cores


def default_cache() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help="a preset's shape, random init (default gpt2)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--context", type=int, default=128, help="cached tokens before each timed decode step")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of the timed prefill")
    p.add_argument("--batches", default="1,4,16", help="sequences per decode step, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every engine once in each")
    p.add_argument("--cache-dir", type=Path, default=default_cache(),
                   help="checkpoint, conversions and llama.cpp build (default $MINILLM_CACHE or ~/.cache/minillm)")
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="llama.cpp's home: source in src/, tools in build/bin/ (default <cache-dir>/llama.cpp)")
    p.add_argument("--no-build", action="store_true", help="use llama.cpp only if already built; never build it")
    p.add_argument("--json", type=Path, default=None, help="also write every round's figures here")


# ---- the figures --------------------------------------------------------------------------------

def figure(rounds: list[dict], key) -> float | None:
    """The median over rounds of a decode step's ms (`key` a batch) or of prefill tok/s (`key` "prefill")."""
    values = [r["prefill_tok_s"] if key == "prefill" else r["decode_ms"].get(key) for r in rounds]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(results: dict, num: tuple, den: tuple) -> tuple[float, float, float] | None:
    """(median, lowest, highest) over rounds of num ÷ den, each (engine, batch or "prefill"), round by round;
    None where either engine did not run or either figure was not timed."""
    if num[0] not in results or den[0] not in results:
        return None
    pairs = [(figure([a], num[1]), figure([b], den[1])) for a, b in zip(results[num[0]], results[den[0]])]
    if any(a is None or b is None for a, b in pairs):
        return None
    per_round = [a / b for a, b in pairs]
    return statistics.median(per_round), min(per_round), max(per_round)


def table(results: dict, floors: dict, batches, prompt_len: int) -> list[str]:
    """The side-by-side table in Markdown: medians over rounds; the floor beside each minillm dtype."""
    head = [f"batch {b}" for b in batches] + [f"prefill {prompt_len} tokens", "weight-read floor", "batch 1 ÷ floor"]
    lines = ["| engine (ms per decode step) | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, rounds in results.items():
        cells = [f"{figure(rounds, b):.2f}" for b in batches]
        tok_s = figure(rounds, "prefill")
        cells.append(f"{tok_s:,.0f} tok/s" if tok_s is not None else "—")
        floor = floors.get(name)
        cells += ([f"{floor * 1e3:.2f}", f"{figure(rounds, batches[0]) / (floor * 1e3):.2f}×"] if floor
                  else ["—", "—"])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def ratio_lines(results: dict) -> list[str]:
    """Each target of the comparison: the ratio's median and range over rounds, or why it is missing."""
    lines = []
    for what, num, den, target, way in RATIOS:
        r = ratio(results, num, den)
        if r is None:
            absent = [e for e, _ in (num, den) if e not in results]
            why = f"{absent[0]} did not run" if absent else f"batch {num[1]} not in --batches"
            lines.append(f"{what}: not measured ({why})")
            continue
        met = r[0] <= target if way == "≤" else r[0] >= target
        lines.append(f"{what}: {r[0]:.2f}× (rounds {r[1]:.2f}–{r[2]:.2f}; target {way} {target:g}×: "
                     f"{'met' if met else 'NOT met'})")
    return lines


# ---- the run ------------------------------------------------------------------------------------

def minillm_engines(checkpoint: Path, threads: int) -> dict:
    """name → model, each dtype of MINILLM loaded from `checkpoint` on the CPU."""
    from ..checkpoints.load import load_model
    from ..device import set_num_threads

    set_num_threads(threads)
    return {name: load_model(checkpoint, "cpu", dtype, quantization=q) for name, (dtype, q) in MINILLM.items()}


def minillm_round(model, context: int, prompt_len: int, batches) -> dict:
    from .steps import decode_step, prefill_step
    from .timing import time_fn

    decode = {b: time_fn(decode_step(model, context, b), "cpu", 1, 5).median_s * 1e3 for b in batches}
    return {"decode_ms": decode, "prefill_tok_s": prompt_len / time_fn(prefill_step(model, prompt_len), "cpu",
                                                                       1, 3).median_s}


def peers(args, checkpoint: Path, say) -> dict:
    """name → a function timing one round of that peer; a PeerMissing line said for each peer that cannot run."""
    run, out = {}, args.cache_dir / "peers" / f"{args.model}-converted"
    try:
        home = llama_cpp(args.llama_cpp or args.cache_dir / "llama.cpp", build=not args.no_build, log=say)
        ggufs = to_gguf(home, checkpoint, out)
        for name, kind in LLAMA.items():
            run[name] = lambda g=ggufs[kind]: llama_steps(home, g, args.threads, args.prompt_len, args.batches)
    except PeerMissing as e:
        say(f"peer missing: {e}")
    try:
        made = ct2_models(checkpoint, out)
        for name, kind in CT2.items():
            run[name] = lambda p=made[kind], k=kind: ct2_steps(p, k, args.threads, args.context, args.batches)
    except PeerMissing as e:
        say(f"peer missing: {e}")
    return run


def budget(args) -> str:
    """The run's time, said before it starts: a build and conversions only where their outputs are missing."""
    home = args.llama_cpp or args.cache_dir / "llama.cpp"
    build = 0 if (home / "build" / "bin" / "llama-batched-bench").is_file() or args.no_build else BUILD_MIN
    converted = (args.cache_dir / "peers" / f"{args.model}-converted" / "model-Q8_0.gguf").is_file()
    minutes = build + (0 if converted else CONVERT_MIN) + args.rounds * ROUND_S / 60
    return (f"time budget: about {minutes:.0f} min on 2 busy cores ("
            + (f"up to {BUILD_MIN} min to build llama.cpp once; " if build else "")
            + ("" if converted else f"{CONVERT_MIN} min to convert the checkpoint once; ")
            + f"{args.rounds} rounds of up to {ROUND_S} s; cache {args.cache_dir})")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.peers", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.batches = tuple(int(b) for b in args.batches.split(","))
    from .timing import device_name

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    say(budget(args))
    started = time.perf_counter()
    checkpoint = write_checkpoint(args.cache_dir / "peers" / f"{args.model}-seed0", args.model)
    timers = peers(args, checkpoint, say)
    models = minillm_engines(checkpoint, args.threads)
    for name, model in models.items():
        timers[name] = lambda m=model: minillm_round(m, args.context, args.prompt_len, args.batches)
    names = list(MINILLM) + [n for n in (*LLAMA, *CT2) if n in timers]
    results = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(timers[name]())
        say(f"round {r + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s in, "
            f"load average {os.getloadavg()[0]:.1f}")
    floors = weight_floors(models)
    lines = [f"{device_name('cpu')}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
             f"{args.model}'s shape, random init, {args.threads} threads, {args.context} cached tokens, medians of "
             f"{args.rounds} rounds in turns; {versions()}", "",
             *table(results, floors["s"], args.batches, args.prompt_len), "",
             f"weight-read floor: weight bytes read per step ÷ {floors['bandwidth'] / 1e9:.1f} GB/s measured read "
             "bandwidth (" + ", ".join(f"{n.split()[1]} {b / 1e6:.0f} MB" for n, b in floors["bytes"].items()) + ")",
             *ratio_lines(results)]
    print("\n".join(lines))
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": results, "floors": floors,
              "load_average": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def versions() -> str:
    """The engines' versions, for the table's caption."""
    import torch
    try:
        import ctranslate2
        ct2 = f", CTranslate2 {ctranslate2.__version__}"
    except ImportError:
        ct2 = ""
    return f"torch {torch.__version__}, llama.cpp from the {LLAMA_SDIST} sdist{ct2}"


def weight_floors(models: dict) -> dict:
    """Each minillm model's weight bytes per step and its floor in seconds at the measured read bandwidth."""
    import torch

    from .cost import weight_bytes_read
    from .roofline import measure_ceilings

    bandwidth = measure_ceilings("cpu", torch.float32, quick=True).bandwidth
    nbytes = {name: weight_bytes_read(m) for name, m in models.items()}
    return {"bandwidth": bandwidth, "bytes": nbytes, "s": {n: b / bandwidth for n, b in nbytes.items()}}


if __name__ == "__main__":
    main()
