"""Lesson 04: memory-bound decode. Batching is nearly free, until it is not.

The claim
---------
A decode step reads every weight to do one multiply-add per weight per
sequence. Batch B sequences and the same weight read serves B tokens: while the
step is memory-bound its time barely moves, so tokens/s grows almost linearly
with B. The roofline says how far that goes, step by step:

    bytes(B)     ≈ b·P + B · context · KV bytes per token
    FLOPs(B)     ≈ 2·P·B
    time(B)      ≈ max(bytes(B) / bandwidth, FLOPs(B) / peak)    (both ceilings measured at the start)

- while bytes(B) stays near bytes(1) (the weights dominate) and FLOPs(B)/peak
  stays under bytes(B)/bandwidth (left of the ridge), a batch costs about one step;
- the KV term grows with B: each sequence reads its own cache, so at long
  contexts the bytes, and the step time, grow with the batch;
- past the ridge the matmuls become compute-bound and the step grows with B;
- and the KV cache must *fit*: memory caps B × context outright.

Batching, not the kernel
------------------------
On a CPU the engine runs one row (a batch-1 decode) and several rows through
different kernels (`cpu_layout.py`: W as stored, by numpy's BLAS or F.linear,
against a oneDNN-packed copy). So batch 1 → 2 measures a kernel switch as much
as batching. The lesson reports that switch as its own figure (a fact: the
step at 2 over the step at 1, beside the roofline's ratio) and judges batching
on one kernel: every batch from 2 up against the batch-2 step.

What this lesson measures
-------------------------
A batch-size sweep of decode steps at a fixed context, every batch size timed
in turns: step time, tokens/s, achieved bytes/s as a share of the bandwidth,
intensity against the ridge (`roofline.py`); one weight matrix multiplied at
1, 2 and the judged batch's rows, beside the steps; and the largest
batch × context this device's memory holds.

The verdict, round by round: the step at batch B* over the step at batch 2,
against the roofline's prediction of that ratio. B* is the largest batch of
the sweep whose predicted step is at most 4/3 of batch 2's (the batch the
roofline calls nearly free, fixed before measuring; at least the batch after 2). The cost
model counts the matmuls' bytes and FLOPs at the ceilings' best repeats and
nothing else: not each sequence's attention, layer norms and sampling, nor a
kernel's lower efficiency at few rows. Those make a step dearer than the
model says by a margin the model cannot state, so the claim holds while the
measured ratio is at most 1.5× the predicted one (`BAND`), and a batch that
cost as much as separate steps (B*/2 × the batch-2 step, ≥ 2) is past it.

Predict before you run: on this device, from which batch size on does doubling
the batch stop nearly doubling tokens/s? What does the ridge point predict?
"""
from __future__ import annotations

import statistics

from common import (make_parser, ms, pct, plot_roofline, plt, predict, print_over_100_note, print_table, run,
                    save_plot, si, start, ticks_at, write_results)
import torch  # after common, which imports minillm: OpenMP's wait policy is set before torch loads it
from minillm.bench.verdict import Check, Fact, interleave, judge, median_interval, print_verdict

from minillm.bench.cost import decode_cost
from minillm.bench.memory import memory_budget
from minillm.bench.roofline import achieved
from minillm.bench.steps import decode_step
from minillm.cpu_layout import layout_of, linear_in_layout, linears_layout
from minillm.model import Conv1D

NAME = "04_memory_bound_decode"
BASE = 2                       # batching is judged from the smallest batch the several-rows kernel serves
NEARLY_FREE = 4 / 3            # B*: predicted step at most this × batch 2's
BAND = 1.5                     # measured ÷ predicted step ratio at most this: what the cost model leaves out
GPU_MEMORY_UTILIZATION = 0.9   # vLLM's knob: the share of device memory the engine may use


def roofline_time(cost, ceil) -> float:
    """The roofline's step time: its bytes at the bandwidth or its FLOPs at the peak, whichever is longer."""
    return max(cost.bytes / ceil.bandwidth, cost.flops / ceil.matmul_flops)


def predicted_free_batch(batches: list[int], times: list[float]) -> int:
    """The largest batch whose predicted step is at most NEARLY_FREE × batch BASE's (at least the batch after
    BASE, so there is a claim to judge)."""
    base = times[batches.index(BASE)]
    free = [b for b, t in zip(batches, times) if b > BASE and t <= NEARLY_FREE * base]
    return max(free + [b for b in batches if b > BASE][:1])


def max_batch(budget_bytes: float, weight_bytes: int, kv_per_token: int, context_len: int) -> int:
    """How many sequences of `context_len` tokens fit beside the weights."""
    return max(0, int((budget_bytes - weight_bytes) // (kv_per_token * context_len)))


def sizes(n_ctx: int, quick: bool, on_gpu: bool) -> dict:
    if quick:
        return {"context": min(16, n_ctx // 4), "batches": [1, 2, 4, 8], "repeats": 5}
    top = 512 if on_gpu else 64
    return {"context": min(256, n_ctx // 4), "batches": [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= top],
            "repeats": 5}


def predict_batches(lesson, s: dict, budget: dict) -> dict:
    """The batches memory holds at the sweep's context, their costs and roofline times, B*, printed with the
    prediction."""
    cfg, dtype, ceil = lesson.config, lesson.dtype, lesson.ceilings
    usable = GPU_MEMORY_UTILIZATION * budget["bytes"]
    per_token, weight_bytes = cfg.kv_bytes_per_token(dtype), cfg.weight_bytes(dtype)
    fits = max_batch(usable, weight_bytes, per_token, s["context"] + 1)
    batches = [b for b in s["batches"] if b <= fits]
    if len(batches) < 3:
        raise SystemExit(f"{NAME}: {si(usable, 'B')} usable memory, weights {si(weight_bytes, 'B')}, room for {fits} "
                         f"sequences of {s['context'] + 1} tokens: too few to batch; use a smaller --model, "
                         "--dtype bf16, or a device with more memory")
    costs = [decode_cost(cfg, s["context"], b, dtype) for b in batches]
    times = [roofline_time(c, ceil) for c in costs]
    b_star = predicted_free_batch(batches, times)
    base, star = times[batches.index(BASE)], times[batches.index(b_star)]
    predict(lesson, f"at context {s['context']} the roofline puts a batch-1 step at {ms(times[0])}, batch {BASE} at "
            f"{ms(base)} and batch {b_star} at {ms(star)} ({costs[batches.index(b_star)].intensity:.2f} FLOP/B against "
            f"the ridge {ceil.ridge:.1f}): batch {b_star}'s step should cost {star / base:.2f}× batch {BASE}'s, "
            f"{b_star // BASE}× the tokens for that; {BAND}× that ratio is the claim's line",
            expect={"step_ratio": star / base})
    return {"batches": batches, "costs": costs, "times": times, "b_star": b_star, "usable": usable, "fits": fits,
            "per_token": per_token, "weight_bytes": weight_bytes, "budget": budget,
            "predicted_ratio": star / base, "predicted_switch": base / times[0]}


def matrix_probes(lesson, b_star: int) -> dict:
    """Projections of the shape of the MLP's first ([n_embd, 4·n_embd]), in the layout the loader gave the model
    (the engine's own kernel path: on a CPU, one row by W as stored, several by a oneDNN-packed copy), each
    applied once per call at 1, 2 and B* rows, as a step streams its layers: enough of them to stream from memory
    (128 MiB, past any CPU's cache; at most 64 of them), so the time per matrix is what a step pays."""
    cfg, device, dtype = lesson.config, lesson.device, lesson.dtype
    layout = layout_of(lesson.model)  # the loader's: packed copies, and one row by the library it chose
    count = min(64, -(-(128 << 20) // (cfg.n_embd * 4 * cfg.n_embd * torch.finfo(dtype).bits // 8)))
    layers = [linear_in_layout(Conv1D(cfg.n_embd, 4 * cfg.n_embd).to(device, dtype), layout["packed"],
                               layout["numpy_one_row"]) for _ in range(count)]
    rows = sorted({1, BASE, b_star})
    xs = {r: torch.randn(r, cfg.n_embd, device=device, dtype=dtype) for r in rows}

    def apply_all(x):
        with torch.inference_mode():
            return [layer(x) for layer in layers]
    return {"weight_shape": list(layers[0].weight.shape), "weight_bytes": layers[0].weight.nbytes, "count": count,
            "rows": rows, "layout": linears_layout(lesson.model),
            "fns": {f"matmul {r} rows": (lambda x=xs[r]: apply_all(x)) for r in rows}}


def points_of(rounds, p: dict, ceil) -> list[dict]:
    """A point per batch: its rounds, its median against the ceilings."""
    points = []
    for b, cost, t in zip(p["batches"], p["costs"], p["times"]):
        times = rounds.times(f"batch {b}")
        points.append({"batch": b, **achieved(cost, rounds.median(f"batch {b}"), ceil), "times_s": times,
                       "predicted_s": t, "over_base": [x / y for x, y in zip(times, rounds.times(f"batch {BASE}"))],
                       "bandwidth_share": [cost.bytes / x / ceil.bandwidth for x in times],
                       "kv_share": cost.kv_read_bytes / cost.bytes})
    return points


def checks(figures: dict) -> list[Check]:
    """The judged batch's step ÷ the batch-2 step, round by round, against the roofline's ratio × BAND."""
    b_star, pred = figures["predicted_free_batch"], figures["predicted_step_ratio"]
    point = next(q for q in figures["points"] if q["batch"] == b_star)
    probe = figures["matmul_probe_s"]
    rows = ", ".join(f"{r} row{'s' * (int(r) > 1)} {ms(t)}" for r, t in probe.items())
    grow = probe[str(b_star)] / probe[str(BASE)]
    shape = figures["probe_weight_shape"]
    return [Check(f"step at batch {b_star} ÷ step at batch {BASE}", point["over_base"], BAND * pred, "<=",
                  fmt="{:.2f}", predicted=pred, key="step_ratio",
                  why=f"a [{shape[0]}×{shape[1]}] weight matrix streamed from memory took {rows}: {b_star} rows cost "
                      f"{grow:.2f}× {BASE} rows on the same kernel, " + (
                          "so the matrix product itself grows with its rows past the roofline's bytes"
                          if grow > BAND * pred else
                          "so the product is nearly as free as predicted; the rest of the step (each sequence's "
                          "attention over its KV, per-sequence work) grows with the batch"))]


def facts(figures: dict) -> list[Fact]:
    """The kernel switch from 1 row to 2: a figure of its own, not batching."""
    one, two = (next(q for q in figures["points"] if q["batch"] == b) for b in (1, BASE))
    switch = statistics.median(x / y for x, y in zip(two["times_s"], one["times_s"]))
    return [Fact(f"step at batch {BASE} ÷ step at batch 1 (the kernel switch)", switch,
                 predicted=figures["predicted_switch"], fmt="{:.2f}",
                 why=f"the projections run {figures['kernels']}; the roofline's ratio is the bytes' and FLOPs' "
                     "alone, so what the step adds past it is the switch between kernels, not batching")]


def measure(lesson, s: dict, p: dict, probes: dict) -> dict:
    """Every batch's decode step and the matrix probes, in turns; a point per batch, against the ceilings."""
    ceil = lesson.ceilings
    fns = {**{f"batch {b}": decode_step(lesson.model, s["context"], b) for b in p["batches"]}, **probes["fns"]}

    def figures_of(rounds):
        return {"points": points_of(rounds, p, ceil), "predicted_free_batch": p["b_star"],
                "predicted_step_ratio": p["predicted_ratio"], "predicted_switch": p["predicted_switch"],
                "probe_weight_shape": probes["weight_shape"], "kernels": probes["layout"],
                "matmul_probe_s": {str(r): rounds.median(f"matmul {r} rows") / probes["count"] for r in probes["rows"]}}
    rounds = interleave(fns, s["repeats"], device=lesson.device, desc="batch sizes, in turns",
                        until=lambda r: all(c.outcome() != "INCONCLUSIVE" for c in checks(figures_of(r))))
    figures = figures_of(rounds)
    rows = [[q["batch"], ms(q["seconds"]), ms(q["predicted_s"]), si(q["batch"] / q["seconds"]),
             f"{statistics.median(q['over_base']):.2f}", si(q["bytes"], "B"), f"{q['intensity']:.2f}",
             si(q["bytes_per_s"]), pct(statistics.median(q['bandwidth_share'])), f"{q['kv_share']:.0%}"]
            for q in figures["points"]]
    print_table(["batch", "step", "roofline", "tokens/s", f"÷ batch {BASE}", "bytes", "FLOP/B", "B/s", "% bw",
                 "KV share"], rows, f"Decode steps at context {s['context']}, {lesson.args.model}, "
                f"{lesson.ceilings.dtype} (medians of {rounds.count} rounds):")
    print_over_100_note(rows)
    return {"rounds": rounds, "figures": figures}


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


def judge_claim(lesson, figures: dict, rounds):
    b_star = figures["predicted_free_batch"]
    verdict = judge(f"while decode is memory-bound, batching on one kernel costs what the roofline predicts: the step "
                    f"at batch {b_star} is at most {BAND}× its predicted ratio to batch {BASE}'s",
                    checks(figures), lesson.load(), [rounds], facts=facts(figures))
    base = next(q for q in figures["points"] if q["batch"] == BASE)
    later = [q for q in figures["points"] if q["batch"] > b_star]
    if later:
        verdict.notes.append(f"past batch {b_star}: " + ", ".join(
            f"batch {q['batch']} costs {q['seconds'] / base['seconds']:.2f}× batch {BASE}'s step (roofline "
            f"{q['predicted_s'] / base['predicted_s']:.2f}×)" for q in later))
    verdict.notes.append("each step ÷ its roofline time (1: at the ceilings; the kernels' efficiency at each row count): "
                         + ", ".join(f"batch {q['batch']} {q['seconds'] / q['predicted_s']:.1f}×" for q in figures["points"]))
    print_verdict(verdict)
    return verdict


def plot(lesson, figures: dict, count: int, verdict) -> None:
    points, b_star, check = figures["points"], figures["predicted_free_batch"], verdict.checks[0]
    batches = [q["batch"] for q in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.3))
    on_one = [q for q in points if q["batch"] >= BASE]
    mid = [statistics.median(q["over_base"]) for q in on_one]
    ivs = [median_interval(q["over_base"])[:2] for q in on_one]
    base = next(q for q in points if q["batch"] == BASE)
    axes[0].errorbar([q["batch"] for q in on_one], mid, fmt="o-", capsize=3,
                     yerr=[[m - lo for m, (lo, _) in zip(mid, ivs)], [hi - m for m, (_, hi) in zip(mid, ivs)]],
                     label=f"measured (medians of {count} rounds; bars: interval)")
    axes[0].plot([q["batch"] for q in on_one], [q["predicted_s"] / base["predicted_s"] for q in on_one], "k:",
                 label="the roofline's prediction")
    axes[0].plot([q["batch"] for q in on_one], [q["batch"] / BASE for q in on_one], color="grey", lw=0.8,
                 label=f"separate steps (batch ÷ {BASE})")
    axes[0].plot([b_star], [check.line], "rv", label=f"the claim's line: {BAND}× predicted, at batch {b_star}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set(xlabel="batch", ylabel=f"step time ÷ batch-{BASE} step (log)",
                title=f"batching on one kernel: batch {b_star} at {check.median:.2f}× batch {BASE}\n"
                      f"(predicted {figures['predicted_step_ratio']:.2f}×)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    axes[1].errorbar(batches, [q["seconds"] * 1e3 for q in points], capsize=3, fmt="o-", label="measured",
                     yerr=[[(q["seconds"] - min(q["times_s"])) * 1e3 for q in points],
                           [(max(q["times_s"]) - q["seconds"]) * 1e3 for q in points]])
    axes[1].plot(batches, [q["predicted_s"] * 1e3 for q in points], "k:", label="the roofline's time")
    axes[1].annotate("batch 1: another kernel", (1, points[0]["seconds"] * 1e3), fontsize=8,
                     xytext=(6, 6), textcoords="offset points")
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="batch", ylabel="step time (ms)", ylim=(0, None),
                title=f"step time (medians; bars: range of {count} rounds)")
    axes[1].legend(fontsize=8)
    for ax in axes[:2]:
        ticks_at(ax, batches if ax is axes[1] else [q["batch"] for q in on_one])
    ys = [lo for lo, _ in ivs] + [hi for _, hi in ivs] + [q["batch"] / BASE for q in on_one]
    ticks_at(axes[0], [2.0 ** k for k in range(-4, 12) if min(ys) / 2 <= 2.0 ** k <= max(ys) * 2], axis="y")
    plot_roofline(axes[2], lesson.ceilings, {f"decode, batch {batches[0]}..{batches[-1]}": (
        [q["intensity"] for q in points], [q["flops_per_s"] for q in points])})
    axes[2].set_title("roofline (ceilings measured at the start)")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick, lesson.device.type == "cuda")
    p = predict_batches(lesson, s, memory_budget(lesson.device))
    probes = matrix_probes(lesson, p["b_star"])
    m = measure(lesson, s, p, probes)
    capacity = capacity_of(lesson, s, p)
    figures = {"context_len": s["context"], **m["figures"], "capacity": capacity, "kv_bytes_per_token": p["per_token"],
               "weight_bytes": p["weight_bytes"], "band": BAND}
    verdict = judge_claim(lesson, figures, m["rounds"])
    plot(lesson, figures, m["rounds"].count, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
