"""Prefill and decode speed, as fractions of this device's own limits.

    python -m minillm bench --model gpt2 --device cpu --dtype fp32 [--prompt-len 512 --batch 1 --context-len 512]

It picks its thread count (the cores free as it starts; `--threads` overrides) and
measures the device's ceilings first, in the model's dtype and weight format
(`roofline.py`: the peak FLOP/s of the fastest of a large matmul and the engine's own
projection, int8's too; the bandwidth of the fastest of a copy, a sum, a
matrix-vector product and the engine's one-row product; each the best of its repeats),
then times one prefill of `--prompt-len` tokens per sequence and one decode step
after `--context-len` cached tokens, both the model's forward pass through the
contiguous KV cache (the decode step in the mode the engine decodes with on the
device: replayed as a CUDA graph on CUDA, eager elsewhere), and prints for each phase:

    tokens/s, achieved FLOP/s (% of the peak), achieved bytes/s (% of the bandwidth)

Then the step the engine itself takes: `LLMEngine.step()` at batch 1 on the same
model (the paged cache, its gather, the scheduler and sampling around the same
forward pass), in turns with the forward step (`steps.engine_against_forward`),
and their ratio against the aim: at most ENGINE_STEP_GOAL× the forward step.

For decode it also prints the *weight-read floor*: weight bytes ÷ bandwidth, the
fastest any step could be that reads every weight once as stored (int8: a byte). A batch-1 decode
step is judged by how close it comes to that floor (weight bytes read per step
÷ step time, as a share of the bandwidth), a prefill by its share of the peak.
Small models on big GPUs stay far from the floor: each step is a few hundred
kernel launches from Python, and launching, not memory, sets the pace. Every
share is of a ceiling measured with kernels at least as fast as the step's own;
where a step still beats them, the ceiling is raised to the step's rate and bench
says so ("raised"), so no share exceeds 100%: a raise names a kernel missing from the ceilings.

Beside the ceilings, bench prints each kernel's own rate: where the engine's
one-row product streams far below the bandwidth, no change to the model can
close the gap; a different BLAS or kernel could. So bench states its aims
against what it measured on this device, naming the ceiling each time: prefill
at 60% of the peak; on a CPU, decode's weight reads at 80% of the bandwidth; on
a GPU, a decode step within 2× the weight-read floor. It prints the machine's
load and its thread choice first: a busy machine slows every figure, ceilings
included.

Before anything slow, bench times one small matmul in the working dtype and in
fp32: a dtype the device only emulates (fp16 on most CPUs runs tens of times
slower than fp32) gets a warning at once. Each measurement says when it
starts, so a long run is never silent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .cost import as_stored, decode_cost, prefill_cost
from .bench_checks import _check, check_arguments, check_memory, check_output_path  # noqa: F401  (bench.check_memory)
from .roofline import achieved, measure_ceilings, raised_for_steps
from ..quantize import quantization_of
from .steps import engine_against_forward, time_decode, time_prefill
from .sweep import (DEFAULT_BATCHES, SWEEP_CONTEXT, beside_busy_core, blas_check, blas_report, busy_report,
                    parse_batches, sweep)
from .sweep import report as sweep_report
from .threads import apply_threads, choose_threads
from .timing import environment, si, time_fn
from ..checkpoints.load import add_model_arguments, add_quantization_argument, load_model
from ..device import resolve_device, resolve_dtype

# minillm's speed goals (benchmarks, not tests), for batch 1 and 512-token prompts, each against a ceiling that
# bench measures on this device in the same run.
CPU_DECODE_GOAL = 0.80   # batch-1 decode on a CPU: weight bytes per step ÷ step time, share of the bandwidth
                         # (the fastest of a copy, a sum and the engine's one-row product, best repeats)
CPU_PREFILL_GOAL = 0.60  # 512-token prefill on a CPU in fp32: share of the peak (the faster of a matmul and
                         # the engine's projection, best repeats)
GPU_DECODE_GOAL = 2.0    # decode step time within this factor of the weight-read floor
ENGINE_STEP_GOAL = 1.15  # the engine's batch-1 step (LLMEngine.step) ÷ the model's forward step, timed in turns
ENGINE_STEPS = 32        # decode steps per round of the engine's figure
GOAL_PROMPT_LEN = 512
EMULATED_SLOWDOWN = 3.0  # a dtype this much slower than fp32 at a matmul is emulated (native ones are as fast)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_quantization_argument(parser)
    parser.add_argument("--prompt-len", type=int, default=GOAL_PROMPT_LEN, help="prefill tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--context-len", type=int, default=None,
                        help="cached tokens before the timed decode step (default: --prompt-len)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: the cores free as bench starts)")
    parser.add_argument("--sweep", default=",".join(map(str, DEFAULT_BATCHES)),
                        help="batch sizes whose decode steps are timed in turns against the roofline ('' skips)")
    parser.add_argument("--sweep-context", type=int, default=SWEEP_CONTEXT,
                        help="cached tokens per sequence before each swept decode step")
    parser.add_argument("--busy-check", action="store_true",
                        help="also time the batch-16 step beside a core a Python loop keeps busy, in turns with quiet")
    parser.add_argument("--blas-check", action="store_true",
                        help="also time the batch-1 step with its one-row products on numpy's BLAS and on torch's, "
                             "in turns, quiet and beside a busy core (fp32 on a CPU)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")


def emulation_slowdown(device: torch.device, dtype: torch.dtype, n: int = 512) -> tuple[float, float]:
    """(how many times slower a matmul runs in `dtype` than in fp32, FLOP/s in `dtype`), from one small
    matmul each (512² is large enough for fp32 to run at speed, and about a second where `dtype` is emulated)."""
    def rate(dt: torch.dtype) -> float:
        a = torch.randn(n, n, device=device).to(dt)
        return 2 * n ** 3 / time_fn(lambda: a @ a, device, warmup=1, repeats=2).median_s
    fast = rate(torch.float32)
    slow = rate(dtype) if dtype != torch.float32 else fast
    return fast / slow, slow


def bench(model, prompt_len: int, context_len: int, batch: int = 1, warmup: int = 2, repeats: int = 7,
          progress=lambda message: None, quick_ceilings: bool = False) -> dict:
    """Time one prefill and one decode step; return each against the ceilings measured in the model's dtype and
    weight format (raised to a step's own rate where it beat them: `roofline.raised_for_steps`, listed in the
    ceilings' `raised`). `progress(message)` is called as each measurement starts; `quick_ceilings` measures the
    ceilings with `measure_ceilings(quick=True)`'s smaller kernels."""
    cfg, device, dtype = model.config, model.device, model.dtype
    ceilings = measure_ceilings(device, dtype, quick_ceilings, quantization=quantization_of(model),
                                progress=lambda what: progress(f"measuring this device's {what}"))
    progress(f"timing the prefill: {warmup} + {repeats} passes of {batch} × {prompt_len} tokens")
    t_prefill = time_prefill(model, prompt_len, batch, warmup, repeats).median_s
    mode = "graph" if device.type == "cuda" else "eager"  # the step the engine decodes with on this device
    progress(f"timing a decode step ({mode}): {warmup} + {repeats} steps after {context_len} cached tokens")
    t_decode = time_decode(model, context_len, batch, warmup, repeats, mode=mode).median_s
    progress(f"timing the engine's batch-1 step (LLMEngine.step) in turns with the forward step: {warmup} + "
             f"{repeats} requests of {ENGINE_STEPS} tokens around {context_len} cached")
    engine = engine_against_forward(model, context_len, ENGINE_STEPS, repeats, warmup)
    pre_cost = as_stored(prefill_cost(cfg, prompt_len, batch, dtype), model)  # int8: a byte a weight
    dec_cost = as_stored(decode_cost(cfg, context_len, batch, dtype), model)
    ceilings = raised_for_steps(ceilings, {"the prefill": (pre_cost, t_prefill), "the decode step": (dec_cost, t_decode)})
    pre, dec = achieved(pre_cost, t_prefill, ceilings), achieved(dec_cost, t_decode, ceilings)
    weight_floor = dec["seconds"] * dec["weight_bytes_per_s"] / ceilings.bandwidth  # weight bytes ÷ bandwidth
    return {"prefill": {**pre, "tokens_per_s": batch * prompt_len / t_prefill},
            "decode": {**dec, "mode": mode, "tokens_per_s": batch / t_decode,
                       "weight_frac_bandwidth": dec["weight_bytes_per_s"] / ceilings.bandwidth,
                       "weight_read_floor_s": weight_floor, "times_floor": t_decode / weight_floor},
            "engine": engine, "ceilings": ceilings.as_dict(), "prompt_len": prompt_len, "context_len": context_len,
            "batch": batch}


def report(result: dict, on_gpu: bool) -> list[str]:
    """The printed lines: the machine's load and the thread choice (when the result has them), each phase against
    the measured ceilings, and where this run stands against minillm's aims, each against a ceiling measured here."""
    c, p, d = result["ceilings"], result["prefill"], result["decode"]
    lines = []
    if result.get("threads"):
        lines.append(f"threads  {result['threads']['reason']}")
    if result.get("load"):
        lines.append(f"load     {result['load']['text']}")
    kernels = c.get("kernels", {})
    rates = lambda roof, unit, top: "; ".join(  # noqa: E731
        f"{name} {si(k['rate'], unit)} ({k['rate'] / top:.0%})" for name, k in kernels.items() if k["roof"] == roof)
    lines += [f"ceilings (measured, each its fastest kernel's best repeat): peak {si(c['matmul_flops'], 'FLOP/s')}, "
              f"bandwidth {si(c['bandwidth'], 'B/s')}, ridge {c['ridge']:.1f} FLOP/B",
              f"  peak of: {rates('compute', 'FLOP/s', c['matmul_flops'])}",
              f"  bandwidth of: {rates('memory', 'B/s', c['bandwidth'])}"]
    if c.get("raised"):
        lines.append(f"  raised to a step's own rate, which beat every measured kernel ({', '.join(c['raised'])}): "
                     "the ceiling is at least that; a kernel the step runs is missing from roofline.ceiling_kernels")
    if c.get("datasheet"):
        lines.append(f"  {c['datasheet']['source']}: {si(c['datasheet']['matmul_flops'], 'FLOP/s')}, "
                     f"{si(c['datasheet']['bandwidth'], 'B/s')}")
    lines += [
        f"prefill  batch {result['batch']} × {result['prompt_len']} tokens: {p['seconds'] * 1e3:.2f} ms, "
        f"{si(p['tokens_per_s'], 'tok/s')}, {si(p['flops_per_s'], 'FLOP/s')} "
        f"({p['frac_matmul_flops']:.0%} of peak), {si(p['bytes_per_s'], 'B/s')} ({p['frac_bandwidth']:.0%} of bw)",
        f"decode   batch {result['batch']} after {result['context_len']} tokens, the model's {d['mode']} forward step: "
        f"{d['seconds'] * 1e3:.2f} ms, "
        f"{si(d['tokens_per_s'], 'tok/s')}, {si(d['flops_per_s'], 'FLOP/s')} ({d['frac_matmul_flops']:.0%} of peak), "
        f"{si(d['bytes_per_s'], 'B/s')} ({d['frac_bandwidth']:.0%} of bw)",
        f"         weights read {si(d['weight_bytes_per_s'], 'B/s')} ({d['weight_frac_bandwidth']:.0%} of bw); "
        f"weight-read floor {d['weight_read_floor_s'] * 1e3:.2f} ms → step is {d['times_floor']:.2f}× the floor",
    ]
    if "engine" in result:
        e = result["engine"]
        lines += [f"engine   batch 1 through LLMEngine.step(), {e['rounds']} requests of {e['steps']} decode steps "
                  f"after a {e['prompt_len']}-token prompt, each step in turns with the forward step:",
                  f"         {e['engine_s'] * 1e3:.2f} ms a token against {e['forward_s'] * 1e3:.2f}; paired, "
                  f"{e['ratio']:.2f}× the forward step (requests {min(e['round_ratios']):.2f}–"
                  f"{max(e['round_ratios']):.2f}×); aim ≤ {ENGINE_STEP_GOAL:g}×"]
    if on_gpu:
        lines.append(f"aims     decode: a step within {GPU_DECODE_GOAL:g}× the weight-read floor, weight bytes ÷ the "
                     f"bandwidth measured here ({si(c['bandwidth'], 'B/s')}): this run {d['times_floor']:.2f}×")
    else:
        one_row = kernels.get("one-row product", {}).get("rate")
        lines.append(f"aims     decode: weight reads at ≥ {CPU_DECODE_GOAL:.0%} of the bandwidth measured here "
                     f"({si(c['bandwidth'], 'B/s')}): this run {d['weight_frac_bandwidth']:.0%}"
                     + (f"; the engine's one-row product alone streams {one_row / c['bandwidth']:.0%} of it"
                        if one_row else ""))
        lines.append(f"         prefill: ≥ {CPU_PREFILL_GOAL:.0%} of the peak measured here "
                     f"({si(c['matmul_flops'], 'FLOP/s')}): this run {p['frac_matmul_flops']:.0%}")
    if result.get("load", {}).get("busy_cores", 0) >= 0.5:
        lines.append(f"         (other processes kept {result['load']['busy_cores']:.1f} cores busy: every figure "
                     "and ceiling above is slower than this device can do when it is quiet)")
    if result["batch"] != 1 or result["prompt_len"] != GOAL_PROMPT_LEN:
        lines.append(f"         (the aims are for batch 1 and {GOAL_PROMPT_LEN}-token prompts; this run used "
                     f"batch {result['batch']} and --prompt-len {result['prompt_len']}, so compare with care)")
    return lines


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    batches = parse_batches(args.sweep)  # a bad list fails before anything loads
    check_output_path("--json", args.json)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.blas_check and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"--blas-check compares one-row products on numpy's BLAS and torch's, which numpy "
                         f"computes in fp32 on a CPU only; this run is {str(dtype).removeprefix('torch.')} on "
                         f"{device}: add --device cpu --dtype fp32")
    choice = apply_threads(choose_threads(args.threads))  # the free cores, or --threads
    load_before = _loadavg()
    model = load_model(args.model, device, dtype, args.weights_dir, quantization=args.quantization)
    context = _check(args, model.config.n_ctx)
    check_memory(model.config, dtype, device, args.prompt_len, context, args.batch)
    slowdown, rate = emulation_slowdown(device, dtype)
    if slowdown > EMULATED_SLOWDOWN:
        name = str(dtype).removeprefix("torch.")
        say(f"warning: {name} matmuls run {slowdown:.0f}× slower than fp32 on this {device.type} "
            f"({si(rate, 'FLOP/s')}): it emulates {name} rather than computing in it, so this bench takes "
            "a long time (tens of minutes for gpt2). For figures that mean something here, use --dtype fp32.")
    result = bench(model, args.prompt_len, context, args.batch, args.warmup, args.repeats,
                   progress=lambda message: say(f"bench: {message} …"))
    if batches:
        say(f"bench: timing decode steps at batch {', '.join(map(str, batches))} in turns, {args.repeats} rounds …")
        result["sweep"] = sweep(model, batches, min(args.sweep_context, model.config.n_ctx - 1),
                                measure_ceilings(device, dtype, quantization=args.quantization),
                                rounds=args.repeats, warmup=args.warmup)
    if args.busy_check:
        say(f"bench: timing the batch-16 step quiet, beside a busy core, and there on one thread, {args.repeats} rounds …")
        result["busy"] = beside_busy_core(model, 16, min(args.sweep_context, model.config.n_ctx - 1), args.repeats)
    if args.blas_check:
        say(f"bench: timing the batch-1 step on numpy's BLAS and on torch's, quiet and beside a busy core, "
            f"{args.repeats} rounds …")
        result["blas"] = blas_check(model, min(args.sweep_context, model.config.n_ctx - 1), args.repeats)
    result["threads"] = choice.as_dict()
    busy = choice.busy if choice.busy is not None else 0.0
    load_after = _loadavg()
    result["load"] = {"loadavg_before": load_before, "loadavg_after": load_after, "busy_cores": busy,
                      "text": (f"load average {load_before:.2f} → {load_after:.2f} on {choice.cpus} CPUs"
                               if load_before is not None and load_after is not None else f"{choice.cpus} CPUs")
                      + (f"; other processes kept {busy:.1f} cores busy as bench started" if choice.busy is not None
                         else "")}
    env = environment(device, dtype)
    print(f"bench    {args.model} ({model.weights_source}) on {env['device_name']}, {env['dtype']}"
          f"{f', {args.quantization} weights' if args.quantization else ''}, torch {env['torch']}")
    print("\n".join(report(result, device.type == "cuda")))
    if "sweep" in result:
        print("\n".join(sweep_report(result["sweep"])))
    if "busy" in result:
        print(busy_report(result["busy"]))
    if "blas" in result:
        print(blas_report(result["blas"]))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": args.model, "weights_source": model.weights_source,
                                    "quantization": args.quantization, "environment": env, **result}, indent=2) + "\n")
        print(f"results: {path}")
    return 0
