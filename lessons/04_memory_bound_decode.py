"""Lesson 04: memory-bound decode. Batching is nearly free, until it is not.

The claim
---------
A decode step reads every weight to do one multiply-add per weight per
sequence. Batch B sequences and the same weight read serves B tokens: the step
time barely moves, so tokens/s grows almost linearly with B. That holds while
the step stays memory-bound. Two things end it:

    intensity(B) ≈ 2·P·B / (b·P + B · context · KV bytes per token)   FLOP/byte

- the numerator grows with B: past the device's ridge point the matmuls become
  compute-bound and the step time grows with B (throughput bends);
- the KV term grows with B too: each sequence reads its own cache, which no
  other sequence shares, so at long contexts the step stays memory-bound and
  bandwidth per sequence, not compute, caps throughput;
- and the KV cache must *fit*: memory caps B × context outright.

So when a deployment degrades under concurrency, look at memory first: the
bytes each step must read, and the bytes the caches must hold.

What this lesson measures
-------------------------
A batch-size sweep of decode steps at a fixed context: step time, tokens/s,
achieved bytes/s against the measured copy bandwidth, arithmetic intensity
against the ridge point. The verdict finds, from the data, the batch sizes
over which throughput grows almost linearly and the batch at which it bends,
and computes the largest batch × context this device's memory holds.

Predict before you run: on this device, from which batch size on does doubling
the batch stop nearly doubling tokens/s? What does the ridge point predict?
"""
from __future__ import annotations

from common import (make_parser, ms, plot_roofline, plt, print_table, print_verdict, save_plot, si, start,
                    write_results)

from minillm.metrics import achieved, decode_cost, memory_budget, time_decode

NAME = "04_memory_bound_decode"
LINEAR_EFFICIENCY = 0.75       # doubling B counts as "nearly linear" when tokens/s grows ≥ 1.5×
GPU_MEMORY_UTILIZATION = 0.9   # vLLM's knob: the share of device memory the engine may use
OVERHEAD_FRACTION = 0.2        # under this share of bandwidth a step is bound by overhead, not memory


def scaling_efficiency(batches: list[int], tokens_per_s: list[float]) -> list[float]:
    """For each step up the sweep: (throughput gain) ÷ (batch gain); 1.0 is perfectly linear."""
    return [(t1 / t0) / (b1 / b0) for b0, b1, t0, t1 in zip(batches, batches[1:], tokens_per_s, tokens_per_s[1:])]


def find_bend(batches: list[int], tokens_per_s: list[float], threshold: float = LINEAR_EFFICIENCY) -> dict:
    """The nearly-linear region and the bend, from the data alone.

    The linear region is the longest run of consecutive steps up the sweep that
    each kept ≥ `threshold` of linear scaling, from batch `linear_from` to
    `linear_until`; `bend_at` is the first batch after it that fell below
    (None if the region runs to the end of the sweep). With no such step,
    linear_from == linear_until == the first batch.
    """
    eff = scaling_efficiency(batches, tokens_per_s)
    best, run_start = (0, 0), None  # (length, index of the run's first step)
    for i, e in enumerate(eff):
        if e >= threshold:
            run_start = i if run_start is None else run_start
            if i - run_start + 1 > best[0]:
                best = (i - run_start + 1, run_start)
        else:
            run_start = None
    length, first = best
    if not length:
        return {"efficiency": eff, "linear_from": batches[0], "linear_until": batches[0],
                "bend_at": batches[1] if len(batches) > 1 else None}
    last = first + length  # index of the run's last batch
    return {"efficiency": eff, "linear_from": batches[first], "linear_until": batches[last],
            "bend_at": batches[last + 1] if last + 1 < len(batches) else None}


def max_batch(budget_bytes: float, weight_bytes: int, kv_per_token: int, context_len: int) -> int:
    """How many sequences of `context_len` tokens fit beside the weights."""
    return max(0, int((budget_bytes - weight_bytes) // (kv_per_token * context_len)))


def concurrency_verdict(batches: list[int], tokens_per_s: list[float], intensity: list[float],
                        frac_bandwidth: list[float], kv_share: list[float], ridge: float,
                        threshold: float = LINEAR_EFFICIENCY, overhead_fraction: float = OVERHEAD_FRACTION) -> dict:
    """Does this sweep show decode's memory-bound batching? Pure: measured numbers in, verdict out.

    Holds when throughput grows nearly linearly over at least one doubling of
    the batch, and the smallest batch's step is memory-bound: left of the
    ridge *and* using at least `overhead_fraction` of the copy bandwidth (a step
    far below the bandwidth roof is cheap to batch because overhead, not
    memory, sets its time).
    """
    bend = find_bend(batches, tokens_per_s, threshold)
    memory_side = intensity[0] < ridge
    memory_busy = frac_bandwidth[0] >= overhead_fraction
    linear = bend["linear_until"] > bend["linear_from"]
    holds = linear and memory_side and memory_busy
    reasons = [
        (f"tokens/s grows ≥ {threshold:.0%} of linearly from batch {bend['linear_from']} to {bend['linear_until']}"
         + (f", then bends at batch {bend['bend_at']}" if bend["bend_at"] else ", to the end of the sweep"))
        if linear else f"no doubling of the batch kept ≥ {threshold:.0%} of linear scaling",
        "scaling efficiency per step: " + ", ".join(f"{b}:{e:.2f}" for b, e in zip(batches[1:], bend["efficiency"])),
        f"batch {batches[0]}: intensity {intensity[0]:.2f} FLOP/B vs ridge {ridge:.1f} → "
        f"{'memory' if memory_side else 'compute'} side; reaches {frac_bandwidth[0]:.0%} of copy bandwidth",
    ]
    crossing = next((b for b, i in zip(batches, intensity) if i >= ridge), None)
    reasons.append(f"the roofline predicts compute-bound from batch {crossing}" if crossing else
                   f"no batch in the sweep crosses the ridge: at batch {batches[-1]} intensity is "
                   f"{intensity[-1]:.1f} FLOP/B, still on the memory side"
                   + (f"; KV reads are {kv_share[-1]:.0%} of its bytes and grow with the batch"
                      if kv_share[-1] >= 0.5 else ""))
    if linear and bend["linear_from"] > batches[0]:
        reasons.append(f"below batch {bend['linear_from']} scaling was worse than linear: the small-batch steps cost "
                       "more than the memory traffic explains (on CPUs the BLAS often switches from a "
                       "matrix-vector to a slower small matrix-matrix kernel at batch 2; compare the step times)")
    if not memory_busy:
        reasons.append(f"the smallest batch reaches only {frac_bandwidth[0]:.0%} of bandwidth (< {overhead_fraction:.0%}): "
                       "per-step overhead (Python, kernel launches) dominates, so cheap batching here says little "
                       "about memory; try a larger model")
    if not holds:
        reasons.append("the data does not support the claim in this run"
                       + ("" if memory_side else ": the smallest batch is already compute-bound"))
    return {"holds": holds, **bend, "predicted_compute_bound_from": crossing, "reasons": reasons}


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
    per_token = cfg.kv_bytes_per_token(dtype)
    weight_bytes = cfg.weight_bytes(dtype)
    fits = max_batch(usable, weight_bytes, per_token, s["context"] + 1)

    points = []
    for b in s["batches"]:
        if b > fits:
            print(f"batch {b} skipped: its KV cache would not fit beside the weights (max {fits})")
            continue
        t = time_decode(model, s["context"], b, repeats=s["repeats"]).median_s
        cost = decode_cost(cfg, s["context"], b, dtype)
        points.append({"batch": b, "tokens_per_s": b / t, "kv_share": cost.kv_read_bytes / cost.bytes,
                       **achieved(cost, t, ceil)})

    if not points:
        raise SystemExit(f"{NAME}: no batch fits: {si(usable, 'B')} usable memory, weights {si(weight_bytes, 'B')}, "
                         f"so room for {fits} sequences of {s['context'] + 1} tokens; use a smaller --model, "
                         "--dtype bf16, or a device with more memory")
    print_table(["batch", "step", "tokens/s", "FLOP/B", "B/s", "% bw", "FLOP/s", "% matmul", "KV share of bytes"],
                [[p["batch"], ms(p["seconds"]), si(p["tokens_per_s"]), f"{p['intensity']:.2f}", si(p["bytes_per_s"]),
                  f"{p['frac_bandwidth']:.0%}", si(p["flops_per_s"]), f"{p['frac_matmul_flops']:.0%}",
                  f"{p['kv_share']:.0%}"] for p in points],
                f"Decode steps at context {s['context']}, {args.model}, {ceil.dtype}:")

    capacity = {"budget_bytes": usable, "budget_source": f"{budget['source']} × {GPU_MEMORY_UTILIZATION}",
                "max_batch_at_sweep_context": fits,
                "max_batch_at_full_context": max_batch(usable, weight_bytes, per_token, cfg.n_ctx),
                "max_tokens_in_flight": max(0, int((usable - weight_bytes) // per_token))}
    print(f"Memory: {si(usable, 'B')} usable ({capacity['budget_source']}), weights {si(weight_bytes, 'B')}, "
          f"KV {si(per_token, 'B')}/token → at most {capacity['max_tokens_in_flight']:,} tokens in flight: "
          f"batch ≤ {fits:,} at context {s['context']}, ≤ {capacity['max_batch_at_full_context']:,} at {cfg.n_ctx}\n")

    verdict = concurrency_verdict([p["batch"] for p in points], [p["tokens_per_s"] for p in points],
                                  [p["intensity"] for p in points], [p["frac_bandwidth"] for p in points],
                                  [p["kv_share"] for p in points], ceil.ridge)
    verdict["reasons"].append(f"memory caps concurrency at {capacity['max_batch_at_full_context']:,} full-context "
                              "sequences" + (": under load, look at memory first (bytes read per step, bytes held "
                                             "per sequence)" if verdict["holds"] else ""))
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    bs = [p["batch"] for p in points]
    axes[0].loglog(bs, [p["tokens_per_s"] for p in points], "o-", label="measured")
    axes[0].loglog(bs, [points[0]["tokens_per_s"] * b / bs[0] for b in bs], "k:", label="perfectly linear")
    if verdict["bend_at"]:
        axes[0].axvline(verdict["bend_at"], color="grey", ls="--", label=f"bend at {verdict['bend_at']}")
    axes[0].set(xlabel="batch", ylabel="tokens/s", title="throughput")
    axes[0].legend(fontsize=8)
    axes[1].semilogx(bs, [p["seconds"] * 1e3 for p in points], "o-")
    axes[1].set(xlabel="batch", ylabel="step time (ms)", title="step time", ylim=(0, None))
    plot_roofline(axes[2], ceil, {f"decode, batch {bs[0]}..{bs[-1]}": ([p["intensity"] for p in points],
                                                                       [p["flops_per_s"] for p in points])})
    axes[2].set_title("roofline")
    save_plot(lesson, fig)

    figures = {"context_len": s["context"], "points": points, "capacity": capacity,
               "kv_bytes_per_token": per_token, "weight_bytes": weight_bytes}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    main()
