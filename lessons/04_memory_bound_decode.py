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
in turns with the copy that defines the bandwidth ceiling: step time, tokens/s,
achieved bytes/s, intensity against the ridge; and the largest batch × context
this device's memory holds.

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
import torch

from common import (make_parser, ms, plot_roofline, plt, predict, print_table, run, save_plot, si, start, ticks_at,
                    write_results)
from minillm.bench.verdict import Check, interleave, judge, print_verdict

from minillm.bench.cost import decode_cost
from minillm.bench.memory import memory_budget
from minillm.bench.roofline import achieved, ceiling_kernels
from minillm.bench.steps import decode_step

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


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    model, cfg, device, dtype, ceil = lesson.model, lesson.config, lesson.device, lesson.dtype, lesson.ceilings
    s = sizes(cfg.n_ctx, args.quick, device.type == "cuda")
    budget = memory_budget(device)
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

    # Matrices of the shape of the MLP's first weight ([n_embd, 4·n_embd], the checkpoint's [in, out] layout), each
    # multiplied once per call at 1, B* and 2·B* rows, as a step streams its layers: enough of them to stream from
    # memory (128 MiB, past any CPU's cache; at most 64 of them), so the time per matrix is what a step pays.
    weight = torch.randn(cfg.n_embd, 4 * cfg.n_embd, device=device).to(dtype)
    weights = [weight] + [torch.randn_like(weight) for _ in range(min(64, -(-(128 << 20) // weight.nbytes)) - 1)]
    rows_probe = sorted({1, b_star, 2 * b_star})
    xs = {r: torch.randn(r, weight.shape[0], device=device, dtype=dtype) for r in rows_probe}
    probes = {f"matmul {r} rows": (lambda x=xs[r]: [x @ w for w in weights]) for r in rows_probe}
    per_matrix = lambda rounds, r: rounds.median(f"matmul {r} rows") / len(weights)  # noqa: E731

    copy = ceiling_kernels(device, dtype, args.quick)["copy"]
    fns = {"copy": copy.fn, **{f"batch {b}": decode_step(model, s["context"], b) for b in batches}, **probes}

    def make_check(rounds) -> Check:
        eff = [t1 / t for t1, t in zip(rounds.times("batch 1"), rounds.times(f"batch {b_star}"))]
        floor = weight.nbytes / (copy.bytes / rounds.median("copy"))
        probe = ", ".join(f"{r} row{'s' * (r > 1)} {ms(per_matrix(rounds, r))}" for r in rows_probe)
        grow = per_matrix(rounds, b_star) / per_matrix(rounds, 1)
        return Check(f"tokens/s at batch {b_star} ÷ ({b_star} × tokens/s at batch 1)", eff, LINEAR_EFFICIENCY, ">=",
                     fmt="{:.2f}",
                     why=f"a [{weight.shape[0]}×{weight.shape[1]}] weight matrix streamed from memory, times {probe}, "
                         "against "
                         f"{ms(floor)} to read it once at the copy bandwidth: {b_star} rows cost {grow:.2f}× one row, "
                         + ("so the kernel's time grows with its rows: it re-reads or repacks the weights for a "
                            "matrix-matrix product instead of streaming them once"
                            if grow > 1 / LINEAR_EFFICIENCY else
                            "so the product itself is nearly free; the rest of the step (attention over each "
                            "sequence's KV, per-sequence work) grows with the batch"))

    rounds = interleave(fns, s["repeats"], device=device, desc="batch sizes, in turns",
                        until=lambda r: make_check(r).outcome() != "INCONCLUSIVE")
    points = []
    for b, cost in zip(batches, costs):
        times = rounds.times(f"batch {b}")
        points.append({"batch": b, **achieved(cost, rounds.median(f"batch {b}"), ceil), "times_s": times,
                       "efficiency": [t1 / t for t1, t in zip(rounds.times("batch 1"), times)],
                       "bandwidth_share": [cost.bytes / t / (copy.bytes / c) for t, c in
                                           zip(times, rounds.times("copy"))],
                       "kv_share": cost.kv_read_bytes / cost.bytes})
    print_table(["batch", "step", "tokens/s", "÷ (B × batch 1)", "bytes", "FLOP/B", "B/s", "% copy bw", "KV share"],
                [[p["batch"], ms(p["seconds"]), si(p["batch"] / p["seconds"]), f"{statistics.median(p['efficiency']):.2f}",
                  si(p["bytes"], "B"), f"{p['intensity']:.2f}", si(p["bytes_per_s"]),
                  f"{statistics.median(p['bandwidth_share']):.0%}", f"{p['kv_share']:.0%}"] for p in points],
                f"Decode steps at context {s['context']}, {args.model}, {ceil.dtype} (medians of {rounds.count} rounds):")

    capacity = {"budget_bytes": usable, "budget_source": f"{budget['source']} × {GPU_MEMORY_UTILIZATION}",
                "max_batch_at_sweep_context": fits,
                "max_batch_at_full_context": max_batch(usable, weight_bytes, per_token, cfg.n_ctx),
                "max_tokens_in_flight": max(0, int((usable - weight_bytes) // per_token))}
    print(f"Memory: {si(usable, 'B')} usable ({capacity['budget_source']}), weights {si(weight_bytes, 'B')}, KV "
          f"{si(per_token, 'B')}/token → at most {capacity['max_tokens_in_flight']:,} tokens in flight: batch ≤ {fits:,} "
          f"at context {s['context']}, ≤ {capacity['max_batch_at_full_context']:,} at {cfg.n_ctx}\n")

    check = make_check(rounds)
    verdict = judge(f"while decode is memory-bound, a batch of {b_star} costs about one step (the roofline's "
                    f"prediction for this device)", [check], lesson.load(), [rounds])
    second = points[1]
    later = [p for p in points if p["batch"] > second["batch"]]
    if later:
        verdict.notes.append(f"from batch {second['batch']} on: " + ", ".join(
            f"batch {p['batch']} costs {p['seconds'] / second['seconds']:.2f}× batch {second['batch']}'s step"
            for p in later))
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 3, figsize=(15, 5.3))
    tps = [p["batch"] / p["seconds"] for p in points]
    axes[0].plot(batches, tps, "o-", label=f"measured (medians of {rounds.count} rounds)")
    axes[0].plot(batches, [tps[0] * b for b in batches], "k:", label="linear from batch 1")
    axes[0].plot(batches, [LINEAR_EFFICIENCY * tps[0] * b for b in batches], "r--", lw=1,
                 label=f"the claim's line: {LINEAR_EFFICIENCY:.0%} of linear")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")  # log-log: linear scaling is a straight line
    axes[0].axvline(b_star, color="grey", ls="--", label=f"predicted nearly free up to {b_star}")
    axes[0].set(xlabel="batch", ylabel="tokens/s (log)",
                title=f"throughput: batch {b_star} at {check.median:.2f} of linear (median)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    axes[1].errorbar(batches, [p["seconds"] * 1e3 for p in points], capsize=3, fmt="o-",
                     yerr=[[(p["seconds"] - min(p["times_s"])) * 1e3 for p in points],
                           [(max(p["times_s"]) - p["seconds"]) * 1e3 for p in points]])
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="batch", ylabel="step time (ms)", ylim=(0, None),
                title=f"step time (medians; bars: range of {rounds.count} rounds)")
    for ax in axes[:2]:
        ticks_at(ax, batches)
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    plot_roofline(axes[2], ceil, {f"decode, batch {batches[0]}..{batches[-1]}": ([p["intensity"] for p in points],
                                                                                 [p["flops_per_s"] for p in points])})
    axes[2].set_title("roofline (ceilings measured at the start)")
    save_plot(lesson, fig, verdict)

    figures = {"context_len": s["context"], "points": points,
               "matmul_probe_s": {r: per_matrix(rounds, r) for r in rows_probe}, "predicted_free_batch": b_star, "capacity": capacity,
               "kv_bytes_per_token": per_token, "weight_bytes": weight_bytes}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
