"""Lesson 02: the phase split. Prefill is compute-bound, decode is memory-bound.

The claim
---------
Serving one request has two phases that want different hardware. *Prefill* pushes the whole prompt through the
model in one forward pass: every weight read from memory is used once per prompt token, so the matmul units stay
busy. *Decode* emits one token per forward pass: every weight is read to do one multiply-add, so the step waits on
memory. For P parameters of b bytes and a step of T tokens,

    FLOPs ≈ 2 · P · T            bytes ≈ b · P (+ KV)        intensity ≈ 2T / b  FLOP/byte

except for one matrix: the LM head (the embedding, reused; 31% of gpt2's weights) runs on the last position only,
since only the last token's next-token scores are needed. It is read in full but used for one token, so a prefill's
intensity is nearer 2T/b · (1 − head share): 176, not 256, FLOP/B for 512 fp32 tokens of gpt2.

The roofline turns that into a prediction of time: a step cannot beat max(FLOPs ÷ peak, bytes ÷ bandwidth), and
the *ridge*, peak ÷ bandwidth, says which term binds: right of it compute, left of it memory. The peak and the
bandwidth are this machine's, measured with the kernels the model runs (`minillm/bench/roofline.py`), so no step
beats them. Users feel the split as TTFT (time to first token, the prefill) and ITL (inter-token latency, decode).

Predict, then measure: the lesson measures the ceilings first and prints the roofline's predictions, then times
every step in turns with the ceiling kernels, so each round has its own peak, bandwidth and ridge (the ridge moves
with the machine's load: the lesson shows its interval). Each round's values are over that round's ceilings, so
load slows both sides alike. It judges:

- prefill: intensity ÷ ridge ≥ 1; its time grows from the shortest prompt to the longest past the geometric mean
  of the FLOPs' growth (the compute model's) and the bytes' (the memory model's); time ÷ roofline time ≤ BAND;
- decode: intensity ÷ ridge ≤ 1; time ÷ roofline time ≤ BAND.

BAND (2×) is the cost model's own uncertainty: it counts the large matmuls and the weights' bytes, not layer
norms, softmax, per-op overhead or shapes that run below the peak; a step whose roof explains under half its time
is bound by something else (a tiny model: per-step overhead, and the lesson says so).

Decoding needs somewhere to keep each token's keys and values: lesson 01 builds the real KV cache; here a stand-in
keeps them in a list and concatenates each step's new ones on, copying the context once per step (bytes counted).

Predict before you run: where on the roofline will a 1-token decode step land, relative to a 512-token prefill?
How many times further apart than the ridge?
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from common import (make_parser, ms, pct, plot_roofline, plt, predict, print_over_100_note, print_table, run, save_plot,
                    si, start, ticks_at, write_results)
from minillm.bench.verdict import MIN_ROUNDS, Check, Fact, interleave, judge, median_interval, print_verdict, settled

import torch

from minillm.config import dtype_bytes
from minillm.bench.cost import decode_cost, prefill_cost
from minillm.bench.roofline import achieved, ceiling_kernels, ceilings_from, raised_for_steps
from minillm.bench.timing import Stopwatch
from minillm.model import causal_attention
from minillm.quantize import quantization_of
from minillm.sampling import sample
from minillm.sampling_params import SamplingParams

NAME = "02_phase_split"
BAND = 2.0  # a step within 2× its roofline time: the binding roof accounts for at least half of it


class ListCache:
    """The simplest answer to the model's `cache.attend(layer, q, k, v)`: keep every layer's keys and values,
    concatenate the new ones on, attend over all. `frozen` attends without keeping (a timed step repeats)."""

    def __init__(self, n_layer: int, frozen: bool = False):
        self.k, self.v, self.frozen = [None] * n_layer, [None] * n_layer, frozen

    def attend(self, layer: int, q, k, v):
        keys, values = k, v
        if self.k[layer] is not None:  # everything before, then the new tokens: (1, H, L, D)
            keys, values = torch.cat((self.k[layer], k), dim=2), torch.cat((self.v[layer], v), dim=2)
        if not self.frozen:
            self.k[layer], self.v[layer] = keys, values
        return causal_attention(q, keys, values)


@torch.inference_mode()
def one_request(model, prompt_len: int, new_tokens: int) -> list[float]:
    """Generate greedily after one random prompt; the lap of every forward pass (lap 0 = TTFT)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    greedy = [SamplingParams(temperature=0.0)]
    watch = Stopwatch(model.device)
    cache, ids, pos = ListCache(model.config.n_layer), prompt.to(model.device), torch.arange(prompt_len)
    watch.start()
    for _ in range(new_tokens):
        last = torch.tensor([ids.shape[1] - 1], device=model.device)
        logits = model(ids, pos[None].to(model.device), cache=cache, logits_indices=last)
        token = sample(logits, greedy)[0]  # on the host: the step is over, as a user sees it
        watch.lap()
        ids, pos = torch.tensor([[token]], device=model.device), pos[-1:] + 1
    return watch.laps_s()


def prefill_step(model, n: int):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(model.device)
    last = torch.tensor([n - 1], device=model.device)
    return torch.inference_mode()(lambda: model(ids, logits_indices=last))


def decode_step(model, context: int):
    """One decode step after `context` tokens (zeros: time does not depend on the values)."""
    cfg = model.config
    cache = ListCache(cfg.n_layer, frozen=True)
    cache.k = [torch.zeros(1, cfg.n_head, context, cfg.head_dim, device=model.device, dtype=model.dtype)
               for _ in range(cfg.n_layer)]
    cache.v = [k.clone() for k in cache.k]
    ids, pos = torch.zeros(1, 1, dtype=torch.long, device=model.device), torch.tensor([[context]], device=model.device)
    return torch.inference_mode()(lambda: model(ids, pos, cache=cache))


def stand_in_cost(cfg, context: int, dtype):
    """A decode step's analytic cost, plus the stand-in's copy: the context's K and V read and written again."""
    cost = decode_cost(cfg, context, 1, dtype)
    return dataclasses.replace(cost, other_bytes=cost.other_bytes + 2 * cost.kv_read_bytes)


def sizes(n_ctx: int, quick: bool) -> dict:  # --quick: at least MIN_ROUNDS rounds all the same
    if quick:
        prompt = min(128, n_ctx // 2)
        return {"prompt": prompt, "new_tokens": 8, "prefill_lens": [prompt // 4, prompt // 2, prompt],
                "contexts": [prompt // 4, prompt], "repeats": MIN_ROUNDS}
    prompt = min(512, n_ctx // 2)
    return {"prompt": prompt, "new_tokens": 32, "prefill_lens": [prompt // 8, prompt // 4, prompt // 2, prompt],
            "contexts": [prompt // 4, prompt, n_ctx - 1], "repeats": 7}


def roof_s(point: dict, peak: float, bandwidth: float) -> float:
    """The roofline's time for a step of point["flops"] and point["bytes"]: max(FLOPs ÷ peak, bytes ÷ bandwidth)."""
    return max(point["flops"] / peak, point["bytes"] / bandwidth)


def over_roof(point: dict, figures: dict) -> list[float]:
    """The step's time ÷ its roofline time, round by round, each over that round's peak and bandwidth."""
    return [t / roof_s(point, p, w) for t, p, w in zip(point["times_s"], figures["peak_rounds"],
                                                         figures["bandwidth_rounds"])]


def judged(figures: dict) -> tuple[dict, dict, dict]:
    """The points the checks judge: the shortest and the longest prefill, and the decode step after the prompt."""
    dec = next(d for d in figures["decode"] if d["context"] == figures["prompt_len"])
    return figures["prefill"][0], figures["prefill"][-1], dec


def checks(figures: dict) -> list[Check]:
    """The claim's checks from the figures: each round's values over that round's ceilings; each prediction from the
    ceilings measured before anything was timed (figures["ceilings_before"])."""
    small, pre, dec = judged(figures)
    T, T0, C, band = pre["tokens"], small["tokens"], dec["context"], figures["band"]
    before = figures["ceilings_before"]
    p0, w0 = before["matmul_flops"], before["bandwidth"]
    peaks, bws = figures["peak_rounds"], figures["bandwidth_rounds"]
    ridges = [p / w for p, w in zip(peaks, bws)]
    lo, hi = min(ridges), max(ridges)
    grow_flops, grow_bytes = pre["flops"] / small["flops"], pre["bytes"] / small["bytes"]
    grow_line = math.sqrt(grow_flops * grow_bytes)
    pre_roof, dec_roof = over_roof(pre, figures), over_roof(dec, figures)
    return [
        Check(f"prefill of {T} tokens: intensity ÷ ridge", [pre["intensity"] / r for r in ridges], 1.0, ">=",
              predicted=pre["intensity"] * w0 / p0, key="prefill_over_ridge",
              why=f"the ridge of these rounds ({lo:.3g}–{hi:.3g} FLOP/B) lies above the prefill's {pre['intensity']:.3g}: "
                  f"arithmetic outruns memory here by more than {T} tokens can feed; ~{T * hi / pre['intensity']:.0f} would"),
        Check(f"prefill time, {T} ÷ {T0} tokens", [a / b for a, b in zip(pre["times_s"], small["times_s"])],
              grow_line, ">=", predicted=roof_s(pre, p0, w0) / roof_s(small, p0, w0), key="prefill_growth",
              why=f"FLOPs grow {grow_flops:.3g}× and bytes {grow_bytes:.3g}× from {T0} to {T} tokens; the time grew "
                  f"{statistics.median(a / b for a, b in zip(pre['times_s'], small['times_s'])):.3g}×, nearer the "
                  "bytes: a fixed cost per step (Python, per-op overhead) weighs more than the arithmetic"),
        Check(f"prefill of {T} tokens: time ÷ its roofline time", pre_roof, band, "<=", predicted=1.0,
              key="prefill_over_roof",
              why=f"it took {statistics.median(pre_roof):.3g}× its roofline time: most of it went to what is not a "
                  "large matmul (attention, layer norms, per-op overhead) or to shapes the library runs slowly"),
        Check(f"decode after {C} tokens: intensity ÷ ridge", [dec["intensity"] / r for r in ridges], 1.0, "<=",
              predicted=dec["intensity"] * w0 / p0, key="decode_over_ridge",
              why=f"the ridge of these rounds ({lo:.3g}–{hi:.3g} FLOP/B) lies below decode's {dec['intensity']:.3g}: "
                  "here one token per weight read keeps the arithmetic busier than the memory"),
        Check(f"decode after {C} tokens: time ÷ its roofline time", dec_roof, band, "<=", predicted=1.0,
              key="decode_over_roof",
              why=f"it took {statistics.median(dec_roof):.3g}× the time its bytes take at the bandwidth: per-step "
                  "overhead (Python, many small kernels) or a matrix-vector kernel slower than the fastest read"),
    ]


def facts(figures: dict) -> list[Fact]:
    small, pre, dec = judged(figures)
    before = figures["ceilings_before"]
    return [Fact("the ridge, peak ÷ bandwidth (median of the rounds, FLOP/B)",
                 statistics.median(p / w for p, w in zip(figures["peak_rounds"], figures["bandwidth_rounds"])),
                 predicted=before["matmul_flops"] / before["bandwidth"], why="this machine's, and its load's, not the claim's"),
            Fact("prefill ÷ decode intensity", pre["intensity"] / dec["intensity"],
                 why="the cost model's arithmetic, equal to its formula by construction")]


def predict_phases(lesson, s: dict) -> dict:
    """The costs of the longest prefill and of a decode step, and what the roofline predicts for them."""
    cfg, dtype, ceil, T = lesson.config, lesson.dtype, lesson.ceilings, s["prefill_lens"][-1]
    pre_cost, dec_cost = prefill_cost(cfg, T, 1, dtype), stand_in_cost(cfg, s["prompt"], dtype)
    small = prefill_cost(cfg, s["prefill_lens"][0], 1, dtype)
    head_share = cfg.vocab_size * cfg.n_embd * dtype_bytes(dtype) / pre_cost.weight_bytes
    roof = lambda c: max(c.flops / ceil.matmul_flops, c.bytes / ceil.bandwidth)  # noqa: E731
    predict(lesson, f"a prefill of {T} tokens does {pre_cost.intensity:.0f} FLOP per byte it moves (2T/b = "
            f"{2 * T / dtype_bytes(dtype):.0f}, less the LM head's {head_share:.0%} of the weights, read for one "
            f"position only); a decode step after {s['prompt']} tokens does {dec_cost.intensity:.2f}; the ridge "
            f"measured now is {ceil.ridge:.1f}",
            f"the roofline's times: the prefill {ms(roof(pre_cost))}, the decode step {ms(roof(dec_cost))}; each judged "
            f"within {BAND:g}× of its own",
            expect={"prefill_over_ridge": pre_cost.intensity / ceil.ridge, "prefill_growth": roof(pre_cost) / roof(small),
                    "prefill_over_roof": 1.0, "decode_over_ridge": dec_cost.intensity / ceil.ridge,
                    "decode_over_roof": 1.0})
    return {"T": T, "head_share": head_share}


def figures_of(lesson, s: dict, rounds, kernels: dict, quantization) -> dict:
    """Every figure the checks, the table and the plot use, from the rounds so far: each step's times and cost,
    each round's peak, bandwidth and ridge (that round's rates of the kernels fastest at their median), and the
    run's ceilings (each kernel's best round; raised to a step's own rate where one beat them)."""
    cfg, dtype = lesson.config, lesson.dtype
    costs = {f"prefill {t}": prefill_cost(cfg, t, 1, dtype) for t in s["prefill_lens"]}
    costs |= {f"decode {k}": stand_in_cost(cfg, k, dtype) for k in s["contexts"]}
    ceil = ceilings_from(kernels, rounds.seconds, lesson.device, dtype, quantization)
    fastest = [max((n for n, k in kernels.items() if k.roof == roof), key=lambda n: kernels[n].rate(rounds.median(n)))
               for roof in ("compute", "memory")]  # the steadiest: fastest at the median of the rounds
    peaks, bws = ([kernels[name].rate(t) for t in rounds.times(name)] for name in fastest)
    ceil = raised_for_steps(ceil, {name: (cost, min(rounds.times(name))) for name, cost in costs.items()})

    def point(name: str) -> dict:
        cost, times = costs[name], rounds.times(name)
        p = achieved(cost, statistics.median(times), ceil)
        return {**p, "times_s": times, "matmul_share": [cost.flops / t / ceil.matmul_flops for t in times],
                "bandwidth_share": [cost.bytes / t / ceil.bandwidth for t in times]}
    ridges = [p / w for p, w in zip(peaks, bws)]
    return {"prompt_len": s["prompt"], "new_tokens": s["new_tokens"], "band": BAND,
            "prefill": [{"tokens": t, **point(f"prefill {t}")} for t in s["prefill_lens"]],
            "decode": [{"context": k, **point(f"decode {k}")} for k in s["contexts"]],
            "peak_rounds": peaks, "bandwidth_rounds": bws, "ridge_rounds": ridges,
            "ridge_interval": list(median_interval(ridges)[:2]), "ridge": ceil.ridge,
            "ceilings_before": lesson.ceilings.as_dict(), "ceilings_in_rounds": ceil.as_dict()}


def measure(lesson, s: dict) -> tuple[dict, object]:
    """One request's TTFT and ITLs; then every prefill and decode step in turns with the ceiling kernels, until the
    checks are decided. Returns the figures and the rounds."""
    model = lesson.model
    one_request(model, s["prompt"], 2)  # warm-up: the first calls pay for allocation and kernel selection
    ttft, *itl = one_request(model, s["prompt"], s["new_tokens"])
    print(f"one request, prompt {s['prompt']} tokens, {s['new_tokens']} new: TTFT {ms(ttft)}, ITL median "
          f"{ms(statistics.median(itl))} (min {ms(min(itl))}, max {ms(max(itl))})\n")
    kernels = ceiling_kernels(lesson.device, lesson.dtype, lesson.args.quick, quantization := quantization_of(model))
    fns = {name: k.fn for name, k in kernels.items()}
    fns |= {f"prefill {n}": prefill_step(model, n) for n in s["prefill_lens"]}
    fns |= {f"decode {k}": decode_step(model, k) for k in s["contexts"]}
    rounds = interleave(fns, s["repeats"], device=lesson.device, desc="timing in turns",
                        until=settled(lambda r: checks(figures_of(lesson, s, r, kernels, quantization))))
    return {**figures_of(lesson, s, rounds, kernels, quantization), "ttft_s": ttft, "itl_s": itl}, rounds


def print_figures(f: dict, c: dict, count: int, dtype) -> None:
    med, ceil = statistics.median, f["ceilings_in_rounds"]
    rows = [[phase, p.get("tokens", 1), p.get("context", 0), ms(p["seconds"]), si(p.get("tokens", 1) / p["seconds"]),
             f"{p['intensity']:.3g}", si(p["flops_per_s"]), pct(med(p["matmul_share"])), si(p["bytes_per_s"]),
             pct(med(p["bandwidth_share"]))] for phase in ("prefill", "decode") for p in f[phase]]
    lo, hi = f["ridge_interval"]
    print(f"ceilings of these rounds, each its fastest kernel's best round: peak {si(ceil['matmul_flops'], 'FLOP/s')}, "
          f"bandwidth {si(ceil['bandwidth'], 'B/s')}, ridge {ceil['ridge']:.1f} FLOP/B; round by round the ridge "
          f"was {lo:.1f}–{hi:.1f} FLOP/B (the interval of its median)"
          + (f"; raised to a step's own rate: {', '.join(ceil['raised'])}" if ceil["raised"] else ""))
    print_table(["phase", "tokens", "cached", "time", "tokens/s", "FLOP/B", "FLOP/s", "% peak", "B/s", "% bw"],
                rows, f"Each phase against those ceilings (medians of {count} rounds):")
    print_over_100_note(rows)
    big, b = f["prefill"][-1], dtype_bytes(dtype)
    print(f"Prefill of {big['tokens']} tokens: 2T/b predicts {2 * big['tokens'] / b:.0f} FLOP/B; the LM head, "
          f"{c['head_share']:.0%} of the weights read, runs on the last position only, so 2T/b · (1 − "
          f"{c['head_share']:.2f}) = {2 * big['tokens'] / b * (1 - c['head_share']):.0f}; the full count "
          f"(attention, KV writes, embeddings) gives {big['intensity']:.0f}.\n")


def plot(lesson, f: dict, verdict, count: int) -> None:
    prefill, decode, ceil = f["prefill"], f["decode"], f["ceilings_in_rounds"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, pts, x, label in ((axes[0], prefill, "tokens", "prompt length (tokens)"),
                              (axes[1], decode, "context", "tokens already in context")):
        mid, iv = [statistics.median(over_roof(p, f)) for p in pts], [median_interval(over_roof(p, f)) for p in pts]
        ax.errorbar([p[x] for p in pts], mid, yerr=[[m - i[0] for m, i in zip(mid, iv)], [i[1] - m for m, i in zip(mid, iv)]],
                    fmt="o-", capsize=4, label=f"measured: median of {count} rounds, interval")
        ax.axhline(1.0, color="k", ls="--", lw=1, label="predicted: the roofline's time (1)")
        ax.axhline(BAND, color="firebrick", ls=":", lw=1, label=f"{BAND:g}× predicted (the claim's line)")
        ax.set(xlabel=label, ylabel="time ÷ roofline time (each round's ceilings)", xlim=(0, None), yscale="log")
        ticks_at(ax, (0.5, 1, 2, 4, 8, 16, 32, 64), axis="y")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
        ax.set_title(f"{'prefill' if x == 'tokens' else 'decode step'}: time ÷ max(FLOPs ÷ peak, bytes ÷ bandwidth)", fontsize=10)
    run_ceil = dataclasses.replace(lesson.ceilings, matmul_flops=ceil["matmul_flops"], bandwidth=ceil["bandwidth"])
    plot_roofline(axes[2], run_ceil, {"prefill": ([p["intensity"] for p in prefill], [p["flops_per_s"] for p in prefill]),
                                      "decode": ([d["intensity"] for d in decode], [d["flops_per_s"] for d in decode])})
    lo, hi = f["ridge_interval"]
    axes[2].axvspan(lo, hi, color="grey", alpha=0.2, label="the ridge, round by round (interval of its median)")
    axes[2].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[2].set_title(f"roofline ({run_ceil.dtype}), each ceiling its best round: ridge {f['ridge']:.1f} FLOP/B\n"
                      f"(round by round {lo:.1f}–{hi:.1f}); medians of the steps under the roof", fontsize=10)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    lesson = start(NAME, make_parser(__doc__).parse_args(argv))  # the ceilings first: the predictions come from them
    s = sizes(lesson.config.n_ctx, lesson.args.quick)
    c = predict_phases(lesson, s)
    figures, rounds = measure(lesson, s)
    figures["lm_head_share"] = c["head_share"]
    print_figures(figures, c, rounds.count, lesson.dtype)
    verdict = judge("prefill is compute-bound and decode is memory-bound", checks(figures), lesson.load(), [rounds],
                    facts=facts(figures))
    print_verdict(verdict)
    plot(lesson, figures, verdict, rounds.count)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
