"""Lesson 04: memory-bound decode. Batching is nearly free, until it is not.

The claim
---------
A decode step reads every weight to do one multiply-add per weight per
sequence. Batch B sequences and the same weight read serves B tokens: while the
step is memory-bound its time barely moves, so tokens/s grows almost linearly
with B. The roofline says how far that goes:

    bytes(B)     ≈ b·P + B · context · KV bytes per token
    intensity(B) ≈ 2·P·B / bytes(B)   FLOP/byte

- as long as bytes(B) stays near bytes(1) (the weights dominate) and the
  intensity stays well left of the ridge, a batch of B costs about one step;
- the KV term grows with B: each sequence reads its own cache, so at long
  contexts the bytes, and the step time, grow with the batch;
- past the ridge the matmuls become compute-bound and the step grows with B;
- and the KV cache must *fit*: memory caps B × context outright.

So when a deployment slows down as more requests run at once, look at memory
first: the bytes each step must read, and the bytes the caches must hold.

What this lesson measures
-------------------------
A batch-size sweep of decode steps at a fixed context, every batch size timed
in turns: step time, tokens/s, achieved bytes/s as a share of the bandwidth,
intensity against the ridge (both ceilings measured at the start with the
engine's own kernels, `roofline.py`); and the largest batch × context this
device's memory holds.

The verdict is judged from batch 1. The roofline predicts a batch B* (the
largest in the sweep whose bytes stay within 4/3 of batch 1's and whose
intensity stays under half the ridge) at which the batch should be nearly
free; the claim holds if tokens/s at B* is at least 75% of B* times batch 1's,
i.e. the step at B* costs at most 4/3 of the step at batch 1.

Predict before you run: on this device, from which batch size on does doubling
the batch stop nearly doubling tokens/s? What does the ridge point predict?
"""
from __future__ import annotations

import statistics

import matplotlib

from common import (make_parser, ms, pct, plot_roofline, plt, predict, print_over_100_note, print_table, run,
                    save_plot, si, start, ticks_at, write_results)
import torch  # after common, which imports minillm: OpenMP's wait policy is set before torch loads it
from minillm.bench.verdict import Check, interleave, judge, print_verdict

from minillm.bench.cost import decode_cost
from minillm.bench.memory import memory_budget
from minillm.bench.roofline import achieved
from minillm.bench.steps import decode_step
from minillm.cpu_layout import layout_of, linear_in_layout, linears_layout
from minillm.model import Conv1D

NAME = "04_memory_bound_decode"
LINEAR_EFFICIENCY = 0.75       # "nearly free": tokens/s at B ≥ 0.75 · B · tokens/s at batch 1
GPU_MEMORY_UTILIZATION = 0.9   # vLLM's knob: the share of device memory the engine may use


def predicted_free_batch(batches: list[int], costs: list, ridge: float) -> int:
    """The largest batch the roofline calls nearly free: bytes ≤ bytes(1)/0.75 and intensity ≤ ridge/2
    (at least the second batch of the sweep, so there is a claim to judge)."""
    free = [b for b, c in zip(batches, costs)
            if c.bytes <= costs[0].bytes / LINEAR_EFFICIENCY and c.intensity <= ridge / 2]
    return max(free + batches[1:2])


def max_batch(budget_bytes: float, weight_bytes: int, kv_per_token: int, context_len: int) -> int:
    """How many sequences of `context_len` tokens fit beside the weights."""
    return max(0, int((budget_bytes - weight_bytes) // (kv_per_token * context_len)))


def sizes(n_ctx: int, quick: bool, on_gpu: bool) -> dict:
    if quick:
        return {"context": min(16, n_ctx // 4), "batches": [1, 2, 4, 8], "repeats": 3}
    top = 512 if on_gpu else 64
    return {"context": min(256, n_ctx // 4), "batches": [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= top],
            "repeats": 5}


def predict_batches(lesson, s: dict, budget: dict) -> dict:
    """The batches memory holds at the sweep's context, their costs, and the largest the roofline calls nearly
    free (B*), printed with its prediction."""
    cfg, dtype, ceil = lesson.config, lesson.dtype, lesson.ceilings
    usable = GPU_MEMORY_UTILIZATION * budget["bytes"]
    per_token, weight_bytes = cfg.kv_bytes_per_token(dtype), cfg.weight_bytes(dtype)
    fits = max_batch(usable, weight_bytes, per_token, s["context"] + 1)
    batches = [b for b in s["batches"] if b <= fits]
    if len(batches) < 2:
        raise SystemExit(f"{NAME}: {si(usable, 'B')} usable memory, weights {si(weight_bytes, 'B')}, room for {fits} "
                         f"sequences of {s['context'] + 1} tokens: too few to batch; use a smaller --model, "
                         "--dtype bf16, or a device with more memory")
    costs = [decode_cost(cfg, s["context"], b, dtype) for b in batches]
    b_star = predicted_free_batch(batches, costs, ceil.ridge)
    cost_star = costs[batches.index(b_star)]
    predict(lesson, f"at context {s['context']} a batch-{b_star} step moves {cost_star.bytes / costs[0].bytes:.2f}× "
            f"the bytes of batch 1 at {cost_star.intensity:.2f} FLOP/B, under half the ridge ({ceil.ridge:.1f}): the "
            f"roofline puts both at their byte time, {ms(costs[0].bytes / ceil.bandwidth)} and "
            f"{ms(cost_star.bytes / ceil.bandwidth)}, so batch {b_star} should give ≥ {LINEAR_EFFICIENCY:.0%} of "
            f"{b_star}× batch 1's tokens/s")
    return {"batches": batches, "costs": costs, "b_star": b_star, "usable": usable, "fits": fits,
            "per_token": per_token, "weight_bytes": weight_bytes, "budget": budget}


def matrix_probes(lesson, b_star: int) -> dict:
    """Projections of the shape of the MLP's first ([n_embd, 4·n_embd]), in the layout the loader gave the model
    (the engine's own kernel path: on a CPU, W for one row, through numpy's BLAS on an AMD one, and a oneDNN-packed
    copy for several), each applied once per call at 1, B* and 2·B* rows, as a step streams its layers: enough of
    them to stream from memory (128 MiB, past any CPU's cache; at most 64 of them), so the time per matrix is what
    a step pays."""
    cfg, device, dtype = lesson.config, lesson.device, lesson.dtype
    layout = layout_of(lesson.model)  # the loader's: packed copies, and one row by the library it chose
    count = min(64, -(-(128 << 20) // (cfg.n_embd * 4 * cfg.n_embd * torch.finfo(dtype).bits // 8)))
    layers = [linear_in_layout(Conv1D(cfg.n_embd, 4 * cfg.n_embd).to(device, dtype), layout["packed"],
                               layout["numpy_one_row"]) for _ in range(count)]
    rows = sorted({1, b_star, 2 * b_star})
    xs = {r: torch.randn(r, cfg.n_embd, device=device, dtype=dtype) for r in rows}

    def apply_all(x):
        with torch.inference_mode():
            return [layer(x) for layer in layers]
    return {"weight": layers[0].weight.detach(), "count": count, "rows": rows, "layout": linears_layout(lesson.model),
            "fns": {f"matmul {r} rows": (lambda x=xs[r]: apply_all(x)) for r in rows}}


def per_matrix(rounds, probes: dict, r: int) -> float:
    return rounds.median(f"matmul {r} rows") / probes["count"]


def make_check(rounds, b_star: int, probes: dict, ceil) -> Check:
    eff = [t1 / t for t1, t in zip(rounds.times("batch 1"), rounds.times(f"batch {b_star}"))]
    weight = probes["weight"]
    floor = weight.nbytes / ceil.bandwidth
    probe = ", ".join(f"{r} row{'s' * (r > 1)} {ms(per_matrix(rounds, probes, r))}" for r in probes["rows"])
    grow = per_matrix(rounds, probes, b_star) / per_matrix(rounds, probes, 1)
    return Check(f"tokens/s at batch {b_star} ÷ ({b_star} × tokens/s at batch 1)", eff, LINEAR_EFFICIENCY, ">=",
                 fmt="{:.2f}",
                 why=f"a [{weight.shape[0]}×{weight.shape[1]}] weight matrix streamed from memory, times {probe}, "
                     "against "
                     f"{ms(floor)} to read it once at the bandwidth: {b_star} rows cost {grow:.2f}× one row, "
                     + (f"so the kernel ({probes['layout']}) grows with its rows: its matrix-matrix product "
                        "does not stream the weights once at the bandwidth"
                        if grow > 1 / LINEAR_EFFICIENCY else
                        "so the product itself is nearly free; the rest of the step (attention over each "
                        "sequence's KV, per-sequence work) grows with the batch"))


def measure(lesson, s: dict, p: dict, probes: dict) -> dict:
    """Every batch's decode step and the matrix probes, in turns; a point per batch, against the ceilings."""
    ceil = lesson.ceilings
    fns = {**{f"batch {b}": decode_step(lesson.model, s["context"], b) for b in p["batches"]},
           **probes["fns"]}
    rounds = interleave(fns, s["repeats"], device=lesson.device, desc="batch sizes, in turns",
                        until=lambda r: make_check(r, p["b_star"], probes, ceil).outcome() != "INCONCLUSIVE")
    points = []
    for b, cost in zip(p["batches"], p["costs"]):
        times = rounds.times(f"batch {b}")
        points.append({"batch": b, **achieved(cost, rounds.median(f"batch {b}"), ceil), "times_s": times,
                       "efficiency": [t1 / t for t1, t in zip(rounds.times("batch 1"), times)],
                       "bandwidth_share": [cost.bytes / t / ceil.bandwidth for t in times],
                       "kv_share": cost.kv_read_bytes / cost.bytes})
    rows = [[q["batch"], ms(q["seconds"]), si(q["batch"] / q["seconds"]), f"{statistics.median(q['efficiency']):.2f}",
             si(q["bytes"], "B"), f"{q['intensity']:.2f}", si(q["bytes_per_s"]),
             pct(statistics.median(q['bandwidth_share'])), f"{q['kv_share']:.0%}"] for q in points]
    print_table(["batch", "step", "tokens/s", "÷ (B × batch 1)", "bytes", "FLOP/B", "B/s", "% bw", "KV share"], rows,
                f"Decode steps at context {s['context']}, {lesson.args.model}, {lesson.ceilings.dtype} (medians of "
                f"{rounds.count} rounds):")
    print_over_100_note(rows)
    return {"rounds": rounds, "points": points}


def capacity_of(lesson, s: dict, p: dict) -> dict:
    """What memory holds beside the weights: tokens in flight, and batches at the sweep's and the full context."""
    usable, weight_bytes, per_token, n_ctx = p["usable"], p["weight_bytes"], p["per_token"], lesson.config.n_ctx
    capacity = {"budget_bytes": usable, "budget_source": f"{p['budget']['source']} × {GPU_MEMORY_UTILIZATION}",
                "max_batch_at_sweep_context": p["fits"],
                "max_batch_at_full_context": max_batch(usable, weight_bytes, per_token, n_ctx),
                "max_tokens_in_flight": max(0, int((usable - weight_bytes) // per_token))}
    print(f"Memory: {si(usable, 'B')} usable ({capacity['budget_source']}), weights {si(weight_bytes, 'B')}, KV "
          f"{si(per_token, 'B')}/token → at most {capacity['max_tokens_in_flight']:,} tokens in flight: batch ≤ "
          f"{p['fits']:,} at context {s['context']}, ≤ {capacity['max_batch_at_full_context']:,} at {n_ctx}\n")
    return capacity


def judge_claim(lesson, p: dict, probes: dict, m: dict):
    b_star, points = p["b_star"], m["points"]
    verdict = judge(f"while decode is memory-bound, a batch of {b_star} costs about one step (the roofline's "
                    f"prediction for this device)", [make_check(m["rounds"], b_star, probes, lesson.ceilings)],
                    lesson.load(), [m["rounds"]])
    second = points[1]
    later = [q for q in points if q["batch"] > second["batch"]]
    if later:
        verdict.notes.append(f"from batch {second['batch']} on: " + ", ".join(
            f"batch {q['batch']} costs {q['seconds'] / second['seconds']:.2f}× batch {second['batch']}'s step"
            for q in later))
    print_verdict(verdict)
    return verdict


def plot(lesson, p: dict, m: dict, verdict) -> None:
    batches, b_star, points, count, check = p["batches"], p["b_star"], m["points"], m["rounds"].count, verdict.checks[0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.3))
    tps = [q["batch"] / q["seconds"] for q in points]
    axes[0].plot(batches, tps, "o-", label=f"measured (medians of {count} rounds)")
    axes[0].plot(batches, [tps[0] * b for b in batches], "k:", label="linear from batch 1")
    axes[0].plot(batches, [LINEAR_EFFICIENCY * tps[0] * b for b in batches], "r--", lw=1,
                 label=f"the claim's line: {LINEAR_EFFICIENCY:.0%} of linear")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")  # log-log: linear scaling is a straight line
    axes[0].axvline(b_star, color="grey", ls="--", label=f"predicted nearly free up to {b_star}")
    axes[0].set(xlabel="batch", ylabel="tokens/s (log)",
                title=f"throughput: batch {b_star} at {check.median:.2f} of linear (median)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    axes[1].errorbar(batches, [q["seconds"] * 1e3 for q in points], capsize=3, fmt="o-",
                     yerr=[[(q["seconds"] - min(q["times_s"])) * 1e3 for q in points],
                           [(max(q["times_s"]) - q["seconds"]) * 1e3 for q in points]])
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="batch", ylabel="step time (ms)", ylim=(0, None),
                title=f"step time (medians; bars: range of {count} rounds)")
    for ax in axes[:2]:
        ticks_at(ax, batches)
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    plot_roofline(axes[2], lesson.ceilings, {f"decode, batch {batches[0]}..{batches[-1]}": (
        [q["intensity"] for q in points], [q["flops_per_s"] for q in points])})
    axes[2].set_title("roofline (ceilings: fastest kernels' best, at the start)")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick, lesson.device.type == "cuda")
    p = predict_batches(lesson, s, memory_budget(lesson.device))
    probes = matrix_probes(lesson, p["b_star"])
    m = measure(lesson, s, p, probes)
    capacity = capacity_of(lesson, s, p)
    verdict = judge_claim(lesson, p, probes, m)
    plot(lesson, p, m, verdict)
    figures = {"context_len": s["context"], "points": m["points"],
               "matmul_probe_s": {r: per_matrix(m["rounds"], probes, r) for r in probes["rows"]},
               "predicted_free_batch": p["b_star"], "capacity": capacity, "kv_bytes_per_token": p["per_token"],
               "weight_bytes": p["weight_bytes"]}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
