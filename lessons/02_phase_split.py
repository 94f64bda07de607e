"""Lesson 02: the phase split. Prefill is compute-bound, decode is memory-bound.

The claim
---------
Serving one request has two phases that want different hardware. *Prefill*
pushes the whole prompt through the model in one forward pass: every weight
read from memory is used once per prompt token, so the matmul units stay busy.
*Decode* emits one token per forward pass: every weight is read to do one
multiply-add, so the step waits on memory. For P parameters of b bytes and a
step of T tokens,

    FLOPs ≈ 2 · P · T            bytes ≈ b · P (+ KV)        intensity ≈ 2T / b  FLOP/byte

except for one matrix: the LM head (the embedding, reused; 31% of gpt2's
weights) runs on the last position only, since only the last token's next-token
scores are needed. It is read in full but used for one token, so a prefill's
intensity is nearer 2T/b · (1 − head share): 176, not 256, FLOP/B for 512 fp32
tokens of gpt2. The lesson prints both.

The device's *ridge point* (its matmul FLOP/s ÷ its memory bytes/s) splits the
two worlds: a step left of it is memory-bound, right of it compute-bound. Users
feel the split as two latencies: TTFT (time to first token, the prefill) and
ITL (inter-token latency, each decode step).

What this lesson measures, on the device it runs on
---------------------------------------------------
- one request: its TTFT and the ITL of every decode step;
- prefill time against prompt length, decode step time against context length,
  timed in turns with the kernels that define the ceilings (`roofline.py`: a
  large matmul and the engine's own projection for the peak; a copy, a sum and
  the engine's one-row product for the bandwidth); each ceiling is the best
  round of its fastest kernel, so no step can beat it;
- the achieved FLOP/s and bytes/s as shares of those ceilings, and a roofline.

Decoding needs somewhere to keep each token's keys and values: lesson 01 builds
the real KV cache. Here a stand-in keeps them in a list and concatenates each
step's new ones on, which copies the context once per step; those bytes are
counted in the decode step's traffic.

The verdict: the longest prefill sits right of the ridge and reaches at least
a fifth of the peak; a decode step sits left of it and moves at least a fifth
of the bandwidth (far below its roof, a step is bound by something else, such
as per-step overhead). Each share is measured once per round, against the
ceilings of the whole run.

Predict before you run: where on the roofline will a 1-token decode step land,
relative to a 512-token prefill? How many times further apart than the ridge?
"""
from __future__ import annotations

import dataclasses
import statistics

from common import (make_parser, ms, pct, plot_roofline, plt, predict, print_over_100_note, print_table, run, save_plot,
                    si, start, write_results)
from minillm.bench.verdict import Check, interleave, judge, print_verdict, settled

import torch

from minillm.config import dtype_bytes
from minillm.bench.cost import decode_cost, prefill_cost
from minillm.bench.roofline import achieved, ceiling_kernels, ceilings_from
from minillm.bench.timing import Stopwatch
from minillm.model import causal_attention
from minillm.sampling import sample
from minillm.sampling_params import SamplingParams

NAME = "02_phase_split"
ROOF_SHARE = 0.2  # a step reaching under a fifth of its roof is bound by something other than that roof


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


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        prompt = min(128, n_ctx // 2)
        return {"prompt": prompt, "new_tokens": 8, "prefill_lens": [prompt // 4, prompt // 2, prompt],
                "contexts": [prompt // 4, prompt], "repeats": 3}
    prompt = min(512, n_ctx // 2)
    return {"prompt": prompt, "new_tokens": 32, "prefill_lens": [prompt // 8, prompt // 4, prompt // 2, prompt],
            "contexts": [prompt // 4, prompt, n_ctx - 1], "repeats": 5}


def predict_phases(lesson, s: dict) -> dict:
    """The costs of the longest prefill and of a decode step, and where the claim puts them against a ridge."""
    cfg, dtype, T = lesson.config, lesson.dtype, s["prefill_lens"][-1]
    pre_cost, dec_cost = prefill_cost(cfg, T, 1, dtype), stand_in_cost(cfg, s["prompt"], dtype)
    head_share = cfg.vocab_size * cfg.n_embd * dtype_bytes(dtype) / pre_cost.weight_bytes
    predict(lesson, f"a prefill of {T} tokens does {pre_cost.intensity:.0f} FLOP per byte it moves (2T/b = "
            f"{2 * T / dtype_bytes(dtype):.0f}, less the LM head's {head_share:.0%} of the weights, read for one "
            f"position only); a decode step after {s['prompt']} tokens does {dec_cost.intensity:.2f}",
            f"so the claim holds on a device whose ridge (peak FLOP/s ÷ bandwidth) lies between "
            f"{dec_cost.intensity:.2f} and {pre_cost.intensity:.0f} FLOP/B, and whose prefill and decode reach at "
            f"least {ROOF_SHARE:.0%} of their roofs; CPUs' ridges lie near 2–10, GPUs' near 50–300")
    return {"T": T, "prefill": pre_cost, "decode": dec_cost, "head_share": head_share}


def shares(rounds, ceil, name: str, cost) -> tuple[list[float], list[float]]:
    """The step's FLOP/s and bytes/s in each round as shares of the run's peak and bandwidth."""
    return ([cost.flops / t / ceil.matmul_flops for t in rounds.times(name)],
            [cost.bytes / t / ceil.bandwidth for t in rounds.times(name)])


def run_ceilings(lesson, rounds, kernels: dict):
    """The ceilings of the rounds so far: each kernel's best round, each ceiling its fastest kernel."""
    return ceilings_from(kernels, rounds.seconds, lesson.device, lesson.dtype)


def make_checks(rounds, ceil, s: dict, c: dict) -> list[Check]:
    """Each phase's intensity against the run's ridge, and its share of its roof, one value per round."""
    T, pre_cost, dec_cost = c["T"], c["prefill"], c["decode"]
    r, t_pre, t_dec = ceil.ridge, rounds.median(f"prefill {T}"), rounds.median(f"decode {s['prompt']}")
    ridge = [r] * rounds.count  # one ridge for the run: the ratio of its two ceilings
    mm_share = shares(rounds, ceil, f"prefill {T}", pre_cost)[0]
    bw_share = shares(rounds, ceil, f"decode {s['prompt']}", dec_cost)[1]
    at_roof, floor = pre_cost.flops / ceil.matmul_flops, dec_cost.bytes / ceil.bandwidth
    return [
        Check(f"prefill of {T} tokens: intensity / ridge", [pre_cost.intensity / x for x in ridge], 1.0, ">=",
              why=f"the ridge measured in these rounds, {r:.1f} FLOP/B, lies above the prefill's "
                  f"{pre_cost.intensity:.0f}: this device's matmul units outrun its memory by more than a "
                  f"{T}-token prompt can feed; about {T * r / pre_cost.intensity:.0f} tokens would cross it"),
        Check(f"prefill of {T} tokens: share of the peak", mm_share, ROOF_SHARE, ">=", fmt="{:.0%}",
              of_ceiling=True,
              why=f"at the peak its {si(pre_cost.flops, 'FLOP')} would take {ms(at_roof)}; it took "
                  f"{ms(t_pre)}: the other {ms(max(0.0, t_pre - at_roof))} went to what is not a large matmul "
                  "(attention, layer norms, per-op overhead) or to a matmul shape the library runs slowly"),
        Check(f"decode after {s['prompt']} tokens: intensity / ridge", [dec_cost.intensity / x for x in ridge],
              1.0, "<=",
              why=f"the ridge measured in these rounds, {r:.2f} FLOP/B, lies below decode's "
                  f"{dec_cost.intensity:.2f}: on this device even one token per weight read keeps the "
                  "matmul units busier than the memory"),
        Check(f"decode after {s['prompt']} tokens: share of the bandwidth", bw_share, ROOF_SHARE, ">=",
              fmt="{:.0%}", of_ceiling=True,
              why=f"its {si(dec_cost.bytes, 'B')} would move in {ms(floor)} at the bandwidth; the step "
                  f"took {ms(t_dec)}, so {ms(max(0.0, t_dec - floor))} went to something else than memory: "
                  "per-step overhead (Python, many small kernels) or a matrix-vector kernel that streams "
                  "weights more slowly than the fastest read stream"),
    ]


def measure(lesson, s: dict, c: dict) -> dict:
    """One request's TTFT and ITLs; then every prefill and decode step in turns with the ceiling kernels.
    Prints each phase against the run's ceilings (the best round of the fastest kernel); returns the rounds and
    every figure."""
    model, cfg, dtype = lesson.model, lesson.config, lesson.dtype
    one_request(model, s["prompt"], 2)  # warm-up: the first calls pay for allocation and kernel selection
    laps = one_request(model, s["prompt"], s["new_tokens"])
    ttft, itl = laps[0], laps[1:]
    print(f"one request, prompt {s['prompt']} tokens, {s['new_tokens']} new: TTFT {ms(ttft)}, ITL median "
          f"{ms(statistics.median(itl))} (min {ms(min(itl))}, max {ms(max(itl))})\n")
    kernels = ceiling_kernels(lesson.device, dtype, lesson.args.quick)
    fns = {name: k.fn for name, k in kernels.items()}
    fns |= {f"prefill {n}": prefill_step(model, n) for n in s["prefill_lens"]}
    fns |= {f"decode {k}": decode_step(model, k) for k in s["contexts"]}
    rounds = interleave(fns, s["repeats"], device=lesson.device, desc="timing in turns",
                        until=settled(lambda r: make_checks(r, run_ceilings(lesson, r, kernels), s, c)))
    ceil = run_ceilings(lesson, rounds, kernels)

    def point(name: str, cost) -> dict:
        p = achieved(cost, rounds.median(name), ceil)
        p["matmul_share"], p["bandwidth_share"] = shares(rounds, ceil, name, cost)
        return p

    prefill = [{"tokens": n, **point(f"prefill {n}", prefill_cost(cfg, n, 1, dtype))} for n in s["prefill_lens"]]
    decode = [{"context": k, **point(f"decode {k}", stand_in_cost(cfg, k, dtype))} for k in s["contexts"]]
    med = statistics.median
    rows = [["prefill", p["tokens"], 0, ms(p["seconds"]), si(p["tokens"] / p["seconds"]), f"{p['intensity']:.1f}",
             si(p["flops_per_s"]), pct(med(p["matmul_share"])), si(p["bytes_per_s"]), pct(med(p["bandwidth_share"]))]
            for p in prefill]
    rows += [["decode", 1, d["context"], ms(d["seconds"]), si(1 / d["seconds"]), f"{d['intensity']:.2f}",
              si(d["flops_per_s"]), pct(med(d["matmul_share"])), si(d["bytes_per_s"]), pct(med(d["bandwidth_share"]))]
             for d in decode]
    print(f"ceilings, the best round of the fastest kernel timed in the same rounds: peak "
          f"{si(ceil.matmul_flops, 'FLOP/s')} ({ceil.fastest('compute')}), bandwidth {si(ceil.bandwidth, 'B/s')} "
          f"({ceil.fastest('memory')}), ridge {ceil.ridge:.1f} FLOP/B")
    print_table(["phase", "tokens", "cached", "time", "tokens/s", "FLOP/B", "FLOP/s", "% peak", "B/s", "% bw"],
                rows, f"Each phase against those ceilings (medians of {rounds.count} rounds):")
    print_over_100_note(rows)
    big, b = prefill[-1], dtype_bytes(dtype)
    print(f"Prefill of {big['tokens']} tokens: 2T/b predicts {2 * big['tokens'] / b:.0f} FLOP/B; the LM head, "
          f"{c['head_share']:.0%} of the weights read, runs on the last position only, so 2T/b · (1 − "
          f"{c['head_share']:.2f}) = {2 * big['tokens'] / b * (1 - c['head_share']):.0f}; the full count "
          f"(attention, KV writes, embeddings) gives {big['intensity']:.0f}.\n")
    return {"rounds": rounds, "kernels": kernels, "ceil": ceil, "prefill": prefill, "decode": decode, "ttft": ttft,
            "itl": itl}


def judge_claim(lesson, s: dict, c: dict, m: dict):
    verdict = judge("prefill is compute-bound and decode is memory-bound", make_checks(m["rounds"], m["ceil"], s, c),
                    lesson.load(), [m["rounds"]])
    step = next(d for d in m["decode"] if d["context"] == s["prompt"])
    verdict.notes.append(f"the two phases sit {m['prefill'][-1]['intensity'] / step['intensity']:.0f}× apart in "
                         "intensity")
    print_verdict(verdict)
    return verdict


def plot(lesson, s: dict, m: dict, verdict) -> None:
    prefill, decode, ceil, count = m["prefill"], m["decode"], m["ceil"], m["rounds"].count
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot([p["tokens"] for p in prefill], [p["seconds"] * 1e3 for p in prefill], "o-")
    axes[0].set(xlabel="prompt length (tokens)", ylabel="prefill time (ms)",
                title=f"prefill time vs prompt length (medians of {count} rounds)", xlim=(0, None), ylim=(0, None))
    axes[1].plot([d["context"] for d in decode], [d["seconds"] * 1e3 for d in decode], "s-",
                 label=f"decode step (median of {count} rounds)")
    axes[1].plot([s["prompt"] + i for i in range(len(m["itl"]))], [t * 1e3 for t in m["itl"]], ".",
                 label="ITL, one request")
    axes[1].set(xlabel="tokens already in context", ylabel="step time (ms)", title="decode step time vs context",
                xlim=(0, None), ylim=(0, None))
    axes[1].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    plot_roofline(axes[2], ceil, {"prefill": ([p["intensity"] for p in prefill], [p["flops_per_s"] for p in prefill]),
                                  "decode": ([d["intensity"] for d in decode], [d["flops_per_s"] for d in decode])})
    grid = sorted({*axes[2].get_xlim(), ceil.ridge})
    axes[2].loglog(grid, [ROOF_SHARE * ceil.attainable(x) for x in grid], "k--", lw=0.8,
                   label=f"{ROOF_SHARE:.0%} of the roof (the claim's line)")
    axes[2].legend(fontsize=8, loc="lower right")
    axes[2].set_title(f"roofline ({ceil.dtype}): each ceiling its fastest kernel's best round", fontsize=10)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)  # the ceilings are timed in the rounds, beside each step
    s = sizes(lesson.config.n_ctx, args.quick)
    costs = predict_phases(lesson, s)
    m = measure(lesson, s, costs)
    verdict = judge_claim(lesson, s, costs, m)
    plot(lesson, s, m, verdict)
    figures = {"prompt_len": s["prompt"], "new_tokens": s["new_tokens"], "ttft_s": m["ttft"], "itl_s": m["itl"],
               "prefill": m["prefill"], "decode": m["decode"], "ridge": m["ceil"].ridge,
               "lm_head_share": costs["head_share"], "ceilings_in_rounds": m["ceil"].as_dict()}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
