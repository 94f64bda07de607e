"""Lesson 01: the phase split. Prefill is compute-bound, decode is memory-bound.

The claim
---------
Serving one request has two phases that want different hardware. *Prefill*
pushes the whole prompt through the model in one forward pass: every weight
read from memory is used once per prompt token, so a 512-token prompt does
~512 multiply-adds per weight byte-pair and keeps the matmul units busy.
*Decode* emits one token per forward pass: every weight is read to do just one
multiply-add, so the step waits on memory. In symbols, for P parameters of b
bytes and a step of T tokens,

    FLOPs ≈ 2 · P · T            bytes ≈ b · P (+ KV)        intensity ≈ 2T / b  FLOP/byte

The device's *ridge point* (its matmul FLOP/s ÷ its memory bytes/s) splits the
two worlds: a step whose intensity is left of the ridge is memory-bound, right
of it compute-bound. Users feel the split as two latencies: TTFT (time to first
token, the prefill) and ITL (inter-token latency, each decode step).

What this lesson measures, on the device it runs on
---------------------------------------------------
- one request: its TTFT and the ITL of every decode step;
- prefill time against prompt length, decode step time against context length;
- for each, the achieved FLOP/s and bytes/s as fractions of this device's
  measured matmul and copy ceilings, and a roofline plot with both phases on it.

The verdict is computed from those numbers: which side of the ridge each phase
sits on, by what factor, and whether the step actually comes near that roof
(a step far below its roof is bound by overhead, e.g. Python and kernel
launches, not by the hardware).

Predict before you run: where on the roofline will a 1-token decode step land,
relative to a 512-token prefill? How many times further apart than the ridge?
"""
from __future__ import annotations

import statistics

from common import (make_parser, ms, plot_roofline, plt, print_table, print_verdict, save_plot, si, start,
                    write_results)

import torch

from minillm.kv_cache import generate
from minillm.metrics import Stopwatch, achieved, decode_cost, prefill_cost, time_decode, time_prefill
from minillm.sampling import SamplingParams

NAME = "01_phase_split"
# A step reaching less than this fraction of its roofline is bound by overhead, not by the hardware.
OVERHEAD_FRACTION = 0.2


def classify(point: dict, ridge: float, overhead_fraction: float = OVERHEAD_FRACTION) -> tuple[str, float]:
    """(bound, margin) for one measured step.

    bound is "compute" or "memory" by the side of the ridge the step's intensity
    lies on, or "overhead" when it reaches under `overhead_fraction` of its roof.
    margin is how far from the ridge the step sits (always ≥ 1).
    """
    side = "compute" if point["intensity"] >= ridge else "memory"
    margin = point["intensity"] / ridge if side == "compute" else ridge / point["intensity"]
    if point["frac_roofline"] < overhead_fraction:
        return "overhead", margin
    return side, margin


def phase_verdict(prefill: dict, decode: dict, ridge: float,
                  overhead_fraction: float = OVERHEAD_FRACTION) -> dict:
    """Does this run show prefill compute-bound and decode memory-bound?

    `prefill` is the longest prompt's point, `decode` a typical decode step's;
    each has intensity, frac_roofline, frac_matmul_flops and frac_bandwidth.
    """
    p_bound, p_margin = classify(prefill, ridge, overhead_fraction)
    d_bound, d_margin = classify(decode, ridge, overhead_fraction)
    reasons = [
        f"prefill: intensity {prefill['intensity']:.1f} FLOP/B, {p_margin:.1f}× "
        f"{'right' if prefill['intensity'] >= ridge else 'left'} of the ridge ({ridge:.1f}); reaches "
        f"{prefill['frac_matmul_flops']:.0%} of matmul FLOP/s, {prefill['frac_bandwidth']:.0%} of bandwidth → {p_bound}-bound",
        f"decode:  intensity {decode['intensity']:.2f} FLOP/B, {d_margin:.1f}× "
        f"{'right' if decode['intensity'] >= ridge else 'left'} of the ridge; reaches "
        f"{decode['frac_matmul_flops']:.0%} of matmul FLOP/s, {decode['frac_bandwidth']:.0%} of bandwidth → {d_bound}-bound",
        f"the two phases sit {prefill['intensity'] / decode['intensity']:.0f}× apart in intensity",
    ]
    if "overhead" in (p_bound, d_bound):
        reasons.append(f"a step under {overhead_fraction:.0%} of its roof is limited by per-step overhead "
                       "(Python, kernel launches, small ops), not by the hardware: try a larger model")
    holds = p_bound == "compute" and d_bound == "memory"
    if not holds and not (prefill["intensity"] >= ridge and decode["intensity"] < ridge):
        reasons.append("the data contradicts the claim: the phases are not on opposite sides of the ridge")
    return {"holds": holds, "prefill_bound": p_bound, "decode_bound": d_bound,
            "prefill_margin": p_margin, "decode_margin": d_margin, "reasons": reasons}


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"prompt": min(32, n_ctx // 4), "new_tokens": 8, "prefill_lens": [8, 16, 32],
                "contexts": [8, 32, n_ctx // 2], "repeats": 2}
    return {"prompt": min(512, n_ctx // 2), "new_tokens": 32,
            "prefill_lens": [n for n in (32, 64, 128, 256, 512) if n <= n_ctx // 2],
            "contexts": [c for c in (32, 128, 256, 512) if c < n_ctx] + [n_ctx - 1], "repeats": 5}


def one_request(model, prompt_len: int, new_tokens: int) -> list[float]:
    """Generate greedily for one random prompt; returns the lap of every forward (lap 0 = TTFT)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    generate(model, [prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    watch = Stopwatch(model.device)
    watch.start()
    generate(model, [prompt], params, on_step=lambda step, n: watch.lap())
    return watch.laps_s()


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    model, cfg, dtype, ceil = lesson.model, lesson.config, lesson.dtype, lesson.ceilings
    s = sizes(cfg.n_ctx, args.quick)

    laps = one_request(model, s["prompt"], s["new_tokens"])
    ttft, itl = laps[0], laps[1:]
    req_prefill = achieved(prefill_cost(cfg, s["prompt"], 1, dtype), ttft, ceil)
    req_decode = [achieved(decode_cost(cfg, s["prompt"] + i, 1, dtype), t, ceil) for i, t in enumerate(itl)]
    itl_bw = statistics.median(d["frac_bandwidth"] for d in req_decode)
    print(f"one request, prompt {s['prompt']} tokens, {s['new_tokens']} new: TTFT {ms(ttft)} "
          f"({req_prefill['frac_matmul_flops']:.0%} of matmul FLOP/s), ITL median {ms(statistics.median(itl))} "
          f"({itl_bw:.0%} of bandwidth; min {ms(min(itl))}, max {ms(max(itl))})\n")

    prefill = []
    for n in s["prefill_lens"]:
        t = time_prefill(model, n, repeats=s["repeats"]).median_s
        prefill.append({"prompt_len": n, **achieved(prefill_cost(cfg, n, 1, dtype), t, ceil)})
    decode = []
    for c in s["contexts"]:
        t = time_decode(model, c, repeats=s["repeats"]).median_s
        decode.append({"context_len": c, **achieved(decode_cost(cfg, c, 1, dtype), t, ceil)})

    headers = ["phase", "tokens", "context", "time", "tokens/s", "FLOP/B", "FLOP/s", "% matmul", "B/s", "% bw", "bound"]
    rows = [["prefill", p["prompt_len"], p["prompt_len"], ms(p["seconds"]), si(p["prompt_len"] / p["seconds"]),
             f"{p['intensity']:.1f}", si(p["flops_per_s"]), f"{p['frac_matmul_flops']:.0%}", si(p["bytes_per_s"]),
             f"{p['frac_bandwidth']:.0%}", classify(p, ceil.ridge)[0]] for p in prefill]
    rows += [["decode", 1, d["context_len"], ms(d["seconds"]), si(1 / d["seconds"]), f"{d['intensity']:.2f}",
              si(d["flops_per_s"]), f"{d['frac_matmul_flops']:.0%}", si(d["bytes_per_s"]),
              f"{d['frac_bandwidth']:.0%}", classify(d, ceil.ridge)[0]] for d in decode]
    print_table(headers, rows, "Each phase against this device's measured ceilings:")

    typical_decode = sorted(decode, key=lambda d: d["seconds"])[len(decode) // 2]
    verdict = phase_verdict(prefill[-1], typical_decode, ceil.ridge)
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot([p["prompt_len"] for p in prefill], [p["seconds"] * 1e3 for p in prefill], "o-")
    axes[0].set(xlabel="prompt length (tokens)", ylabel="prefill time (ms)", title="prefill time vs prompt length")
    axes[1].plot([d["context_len"] for d in decode], [d["seconds"] * 1e3 for d in decode], "s-", label="decode step")
    axes[1].plot([s["prompt"] + i for i in range(len(itl))], [t * 1e3 for t in itl], ".", label="ITL, one request")
    axes[1].set(xlabel="context length (tokens)", ylabel="step time (ms)", title="decode step time vs context",
                ylim=(0, None))
    axes[1].legend()
    plot_roofline(axes[2], ceil, {"prefill": ([p["intensity"] for p in prefill], [p["flops_per_s"] for p in prefill]),
                                  "decode": ([d["intensity"] for d in decode], [d["flops_per_s"] for d in decode])})
    axes[2].set_title(f"roofline, {ceil.device}, {ceil.dtype}")
    save_plot(lesson, fig)

    figures = {"prompt_len": s["prompt"], "new_tokens": s["new_tokens"], "ttft_s": ttft, "itl_s": itl,
               "itl_median_s": statistics.median(itl), "request_prefill": req_prefill, "request_decode": req_decode,
               "prefill": prefill, "decode": decode}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    main()
