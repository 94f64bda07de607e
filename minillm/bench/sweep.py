"""The decode step at several batch sizes, each against this device's roofline and against batch 1.

    python -m minillm bench --model gpt2 --sweep 1,4,16,64 --sweep-context 128 [--busy-check]

Batching is what makes decode pay: a step of B sequences reads the weights
once for B tokens. How much a step of B may cost is set by the roofline, in
the ceilings `roofline.py` measures on this device:

    weight-read floor  = weight bytes ÷ bandwidth                      (any B)
    memory floor       = (weight bytes + B · context · KV bytes per token + …) ÷ bandwidth
    compute floor      = FLOPs(B) ÷ matmul FLOP/s,   FLOPs(B) ≈ 2 · P · B
    roofline(B)        = max(memory floor, compute floor)

So a step of B costs about a step of 1 while the memory floor leads, and grows
linearly once the compute floor does (past the ridge, B ≈ ridge · bytes per
weight ÷ 2). A step is judged by its time over its roofline, and by its time
over the batch-1 step of the same round: the batch sizes are timed in turns,
round after round, so a busy machine slows them alike, and the ratio is the
median of the per-round ratios with their range.

What is timed is `steps.decode_step`, the eager step over the contiguous cache
(the engine's paged step adds a gather of each row's blocks), with the model
in the layout the loader chose (`cpu_layout.lm_head_layout`).

`--busy-check` also times the batch-16 step beside a core kept busy by a
Python loop this run starts and stops, in turns with the quiet step and with
the same step on one thread (`beside_busy_core`): what a third runnable
thread costs the thread policy (`threads.py`), and whether it ever loses to
one thread.
"""
from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time

from .cost import as_stored, decode_cost
from .roofline import Ceilings, raised_for_steps
from ..cpu_layout import attention_layout, lay_out, layout_of, linears_layout, lm_head_layout
from ..device import set_num_threads
from .steps import decode_step
from .timing import time_fn

DEFAULT_BATCHES = (1, 4, 16, 64)
SWEEP_CONTEXT = 128
FLOOR_AIM = 1.3     # batch 1: a step within this factor of the weight-read floor
BATCH16_AIM = 1.5   # a step of 16 within this factor of the step of 1
BUSY_AIM = 1.5      # beside a core another process keeps busy, the batch-16 step within this factor of quiet


def parse_batches(text: str) -> tuple[int, ...]:
    """'1,4,16,64' → (1, 4, 16, 64); batch 1 is always first (every ratio is against it); '' → none."""
    if not text.strip():
        return ()
    try:
        batches = sorted({int(b) for b in text.split(",")})
    except ValueError:
        raise ValueError(f"--sweep {text!r}: give batch sizes separated by commas, e.g. 1,4,16,64") from None
    if batches[0] < 1:
        raise ValueError(f"--sweep {text!r}: every batch size must be at least 1")
    return tuple(sorted(set(batches) | {1}))


def sweep(model, batches, context_len: int, ceilings: Ceilings, rounds: int = 5, warmup: int = 1) -> dict:
    """Time a decode step at each batch size in turns, `rounds` times; each against its roofline and batch 1."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    device = model.device
    steps = {b: decode_step(model, context_len, b) for b in batches}
    for step in steps.values():
        time_fn(step, device, warmup=warmup, repeats=1)
    times = {b: [] for b in batches}
    for _ in range(rounds):
        for b, step in steps.items():
            times[b].append(time_fn(step, device, warmup=0, repeats=1).median_s)
    costs = {b: as_stored(decode_cost(model.config, context_len, b, model.dtype), model) for b in batches}  # int8: 1 B
    ceilings = raised_for_steps(ceilings, {f"the batch-{b} decode step": (costs[b], min(times[b])) for b in batches})
    rows = []
    for b in batches:
        cost = costs[b]
        weight_floor = cost.weight_bytes / ceilings.bandwidth
        memory, compute = cost.bytes / ceilings.bandwidth, cost.flops / ceilings.matmul_flops
        seconds = statistics.median(times[b])
        ratios = [t / t1 for t, t1 in zip(times[b], times[batches[0]])]
        rows.append({"batch": b, "seconds": seconds, "times_s": times[b], "weight_read_floor_s": weight_floor,
                     "memory_floor_s": memory, "compute_floor_s": compute, "roofline_s": max(memory, compute),
                     "bound": "compute" if compute > memory else "memory",
                     "times_weight_floor": seconds / weight_floor, "times_roofline": seconds / max(memory, compute),
                     "times_batch1": statistics.median(ratios), "times_batch1_range": [min(ratios), max(ratios)],
                     "roofline_times_batch1": max(memory, compute) / rows[0]["roofline_s"] if rows else 1.0})
    return {"context_len": context_len, "rounds": rounds, "rows": rows, "lm_head_layout": lm_head_layout(model),
            "peak": ceilings.matmul_flops, "bandwidth": ceilings.bandwidth, "ceilings_raised": ceilings.raised,
            "block_linears": linears_layout(model), "attention": attention_layout(model),
            "dtype": str(model.dtype).removeprefix("torch.")}


@contextlib.contextmanager
def busy_core():
    """A core kept busy by a Python loop in a child process (`while True: pass`), running before the block starts."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        loop.kill()
        loop.wait()


def beside_busy_core(model, batch: int, context_len: int, rounds: int = 5) -> dict:
    """The batch-`batch` step quiet, beside a busy core, and beside it on one thread, in turns, `rounds` times.

    The busy core (`busy_core`) is started before and stopped after each busy timing; the quiet timing comes
    first in every round. Judged per round: busy ÷ quiet (how much a third runnable thread costs this thread
    policy) and busy ÷ busy on one thread (whether the chosen threads ever lose to one)."""
    import torch
    step, threads = decode_step(model, context_len, batch), torch.get_num_threads()
    step()
    times = {"quiet": [], "busy": [], "busy, 1 thread": []}
    for _ in range(rounds):
        times["quiet"].append(time_fn(step, model.device, warmup=0, repeats=1).median_s)
        with busy_core():
            try:
                times["busy"].append(time_fn(step, model.device, warmup=0, repeats=1).median_s)
                set_num_threads(1)
                times["busy, 1 thread"].append(time_fn(step, model.device, warmup=0, repeats=1).median_s)
            finally:
                set_num_threads(threads)
    ratio = lambda a, b: [x / y for x, y in zip(times[a], times[b])]  # noqa: E731
    return {"batch": batch, "threads": threads, "rounds": rounds, "times_s": times,
            "busy_over_quiet": ratio("busy", "quiet"), "busy_over_one_thread": ratio("busy", "busy, 1 thread")}


def blas_check(model, context_len: int, rounds: int = 5) -> dict:
    """The batch-1 step with its one-row products on numpy's BLAS and on torch's, in turns, quiet and beside a
    busy core, `rounds` times: what the loader's choice of library (`cpu_layout.numpy_blas_pays`) gains, and what a core
    taken by another process after the threads were counted costs each. The model's choice is restored."""
    import torch
    step, threads, chosen = decode_step(model, context_len, 1), torch.get_num_threads(), layout_of(model)["numpy_one_row"]
    times = {f"{lib}, {load}": [] for load in ("quiet", "busy") for lib in ("numpy", "torch")}
    try:
        for lib in ("numpy", "torch"):
            lay_out(model, numpy_one_row=lib == "numpy")
            time_fn(step, model.device, warmup=1, repeats=1)
        for _ in range(rounds):
            for load in ("quiet", "busy"):
                with busy_core() if load == "busy" else contextlib.nullcontext():
                    for lib in ("numpy", "torch"):
                        lay_out(model, numpy_one_row=lib == "numpy")
                        times[f"{lib}, {load}"].append(time_fn(step, model.device, warmup=0, repeats=3).median_s)
    finally:
        lay_out(model, numpy_one_row=chosen)
    ratio = lambda load: [t / n for t, n in zip(times[f"torch, {load}"], times[f"numpy, {load}"])]  # noqa: E731
    return {"threads": threads, "rounds": rounds, "context_len": context_len, "times_s": times,
            "torch_over_numpy_quiet": ratio("quiet"), "torch_over_numpy_busy": ratio("busy")}


def blas_report(result: dict) -> str:
    med = {k: statistics.median(v) * 1e3 for k, v in result["times_s"].items()}
    q, b = result["torch_over_numpy_quiet"], result["torch_over_numpy_busy"]
    return (f"blas     batch-1 step, one-row products by numpy's BLAS and by torch's in turns ({result['rounds']} "
            f"rounds, {result['threads']} thread{'s' * (result['threads'] > 1)}): quiet numpy {med['numpy, quiet']:.1f}"
            f" ms, torch {med['torch, quiet']:.1f} ms: torch takes {statistics.median(q):.2f}× [{min(q):.2f}–"
            f"{max(q):.2f}] numpy's time; beside a busy core numpy {med['numpy, busy']:.1f} ms, torch "
            f"{med['torch, busy']:.1f} ms: {statistics.median(b):.2f}× [{min(b):.2f}–{max(b):.2f}]")


def busy_report(result: dict) -> str:
    b, q = result["busy_over_quiet"], result["busy_over_one_thread"]
    med = {k: statistics.median(v) * 1e3 for k, v in result["times_s"].items()}
    return (f"busy     batch-{result['batch']} step beside a busy core ({result['rounds']} rounds in turns, "
            f"{result['threads']} thread{'s' * (result['threads'] > 1)}): quiet {med['quiet']:.1f} ms, busy "
            f"{med['busy']:.1f} ms = {statistics.median(b):.2f}× quiet [{min(b):.2f}–{max(b):.2f}] (aim ≤ "
            f"{BUSY_AIM:g}×); on one thread beside it {med['busy, 1 thread']:.1f} ms: the chosen threads take "
            f"{statistics.median(q):.2f}× [{min(q):.2f}–{max(q):.2f}] of that")


def report(result: dict) -> list[str]:
    """The sweep's lines: what ran, one line per batch size, and the aims against this run's own figures."""
    rows = {r["batch"]: r for r in result["rows"]}
    lines = [f"sweep    decode steps after {result['context_len']} cached tokens, batch sizes timed in turns "
             f"({result['rounds']} rounds, medians); {result['dtype']}, LM head: {result['lm_head_layout']}, "
             f"block linears: {result['block_linears']}, attention: {result['attention']}"]
    for r in result["rows"]:
        lo, hi = r["times_batch1_range"]
        lines.append(f"  batch {r['batch']:>3}: {r['seconds'] * 1e3:8.2f} ms ({r['seconds'] * 1e3 / r['batch']:.2f} "
                     f"ms/token) = {r['times_batch1']:.2f}× batch 1 [{lo:.2f}–{hi:.2f}] (roofline allows "
                     f"{r['roofline_times_batch1']:.2f}×); roofline {r['roofline_s'] * 1e3:.2f} ms "
                     f"({r['bound']}-bound, weight-read floor {r['weight_read_floor_s'] * 1e3:.2f} ms): step is "
                     f"{r['times_roofline']:.2f}× the roofline")
    if result.get("ceilings_raised"):
        lines.append(f"  (ceilings raised to a step's own rate, which beat every measured kernel: "
                     f"{', '.join(result['ceilings_raised'])})")
    one = rows[1]
    aim = (f"aims     batch 1 within {FLOOR_AIM:g}× the weight-read floor: this run {one['times_weight_floor']:.2f}×")
    if 16 in rows:
        lo, hi = rows[16]["times_batch1_range"]
        aim += (f"; batch 16 within {BATCH16_AIM:g}× batch 1: this run {rows[16]['times_batch1']:.2f}× "
                f"[{lo:.2f}–{hi:.2f}] (the roofline allows {rows[16]['roofline_times_batch1']:.2f}×)")
    return lines + [aim]
