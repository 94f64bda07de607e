"""Lesson 11: speculative decoding. Does checking γ guesses in one target pass pay, as Leviathan's formula says?

The claim
---------
A decode step is memory-bound (lessons 01 and 04): it reads every weight to
make one token, and a pass over k tokens reads the same weights, so checking k
tokens should cost about one step. A cheap draft guesses γ tokens; the target
checks them in one pass and keeps the prefix it agrees with, plus one token of
its own (`minillm/speculative.py`). With acceptance rate α and a draft step
costing c target steps, Leviathan et al. predict the speedup

    S = (1 − α^(γ+1)) / ((1 − α) · (γc + 1))        (the verification pass counted as 1 step)

The claim, in three lines: a pass over 5 new tokens costs at most 1.3× a
one-token step (the premise); the measured speedup is within 15% of S for every
γ and draft; prompt lookup (vLLM's n-gram draft, c ≈ 0) on a prompt that
repeats itself, at γ = 4 (fixed beforehand), is at least 1.5× faster. Each
line is judged round by round, on the range over the rounds widened by the
machine's load (`measure.judge`); the notes compute why a line was missed.

What this lesson measures
-------------------------
1. The premise: the target's pass over k new tokens after 256 cached ones,
   logits at all k as verification needs, against k = 1, for k up to 16 and
   every γ + 1; beside it the same pass's matrix products alone, and the
   roofline of lesson 01 from the measured ceilings. In the same rounds a draft
   step and a lookup (its worst case: no match), for c.
2. The drafts. The model draft is the target's first quarter of blocks with its
   embeddings, ln_f and head (`--draft NAME` picks a model instead): it shares
   the target's weights, so it costs no memory. Prompt lookup (n-grams of 1–3).
3. The prompt: a passage, the target's own greedy continuation of it, then the
   passage again. A model that copies from its context (real checkpoints do)
   writes that continuation again, and lookup proposes it. Whether this target
   does is what α measures: random-init weights say nothing about a real
   checkpoint's α, and the verdict names the weights. The best case, a free
   draft that is always right (α = 1, c = 0), is (γ + 1) ÷ the pass's cost.
4. The sweep: greedy, the target alone (`kv_cache.generate`) and each draft
   for γ = 1, 2, 4, 8, in turns, three rounds; only the decode phase is timed
   (the prefill is the same target pass either way). Per γ: α, tokens per pass
   against (1 − α^(γ+1)) / (1 − α), the speedup, and S fed the measured α and
   c. Beside S, the run's own cost model: its tokens ÷ the sum over its rounds
   of (guesses · c + the measured cost of a pass over guesses + 1 tokens).
   Where S misses and this one does not, the miss is the premise (and guesses S
   assumed that the draft did not make).
--quick: γ = 4 only, a 42-token prompt, 10 new tokens, two rounds; the same lines.
Before all that, one sampled run with the model draft (temperature 1) reports
α under Leviathan's acceptance rule, the exercise of this lesson.

Predict before you run: what share of a decode step is not reading weights on
this CPU? If verifying 5 tokens cost 2× a step, what could any draft give at γ = 4?
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import make_parser, ms, plt, print_table, quiet_load_model, run, save_plot, start, ticks_at, write_results
from measure import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, Check, interleave, judge, print_verdict

from minillm.kv_cache import KVCache, Segment, generate
from minillm.metrics import decode_step, step_cost
from minillm.model import GPT2, Conv1D
from minillm.sampling import SamplingParams
from minillm.speculative import NgramProposer, SpeculativeDecoder, expected_speedup, expected_tokens_per_pass

NAME = "11_speculative_decoding"
CONTEXT = 256                      # cached tokens before the measured passes
PREMISE_K, PREMISE_LINE = 5, 1.3   # a pass over 5 new tokens costs at most 1.3× a one-token step
FREE_LINE = 1.2                    # the verdict says up to which k a pass stays under 1.2× a step
FIT = 0.15                         # measured speedup within ±15% of S
LOOKUP_GAMMA, LOOKUP_LINE = 4, 1.5


def sizes(quick: bool) -> dict:
    if quick:
        return {"gammas": [LOOKUP_GAMMA], "passage": 16, "quoted": 10, "max_tokens": 10, "sampled_tokens": 6,
                "repeats": 2, "cost_repeats": 3, "ks": []}
    return {"gammas": [1, 2, 4, 8], "passage": 64, "quoted": 24, "max_tokens": 24, "sampled_tokens": 24,
            "repeats": 3, "cost_repeats": 7, "ks": [16]}


def shallow_draft(target: GPT2, n_layer: int) -> GPT2:
    """The target's first n_layer blocks, its embeddings, ln_f and tied head: a draft sharing (not copying) them."""
    with torch.device("meta"):
        draft = GPT2(target.config.with_(n_layer=n_layer), seed=None)
    draft.wte, draft.wpe, draft.ln_f, draft.h = target.wte, target.wpe, target.ln_f, nn.ModuleList(target.h[:n_layer])
    draft.weights_source = f"the target's first {n_layer} of {target.config.n_layer} blocks"
    return draft.eval()


def quoting_prompt(target: GPT2, passage: int, quoted: int, seed: int = 0) -> list[int]:
    """A passage, the target's greedy continuation of it, and the passage again."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, target.config.vocab_size, (passage,), generator=g).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=quoted, ignore_eos=True)
    return text + generate(target, [text], greedy)[0] + text


def cost_fns(target: GPT2, draft: GPT2, ks: list[int], context: int) -> dict:
    """Target passes over k new tokens after `context` cached ones, logits at all k; their matrix products alone
    (every projection and the LM head on k rows); a draft step; a lookup. Time does not depend on the cached
    values, so the caches are declared filled (zeros)."""
    cfg, device = target.config, target.device
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (context + max(ks),), generator=g).tolist()
    ids = torch.tensor([tokens[context:]], device=device)
    layers = [m for m in target.modules() if isinstance(m, Conv1D)]

    def verify(k: int):
        cache, rows = KVCache(cfg, 1, context + k, device, target.dtype), torch.arange(k, device=device)
        return torch.inference_mode()(lambda: target(ids[:, :k], cache.prepare([Segment(0, context, k)]).positions,
                                                     cache=cache, logits_indices=rows))

    def matmuls(k: int):
        xs = {n: torch.randn(k, n, generator=g).to(device, target.dtype) for n in {m.weight.shape[0] for m in layers}}
        return torch.inference_mode()(lambda: [m(xs[m.weight.shape[0]]) for m in layers]
                                      + [F.linear(xs[cfg.n_embd], target.wte.weight)])

    lookup, greedy = NgramProposer(), SamplingParams(temperature=0.0)   # random tokens: no match, all scanned
    return {**{f"pass {k}": verify(k) for k in ks}, **{f"matmuls {k}": matmuls(k) for k in ks},
            "draft step": decode_step(draft, context),
            "lookup": lambda: lookup.propose(tokens[:context], LOOKUP_GAMMA, greedy, None)}


def roofline_s(cfg, k: int, context: int, dtype, ceilings) -> float:
    """Lesson 01's roofline: a pass over k tokens takes at least its FLOPs at the matmul ceiling, or its bytes at the
    copy bandwidth, whichever is longer."""
    x = step_cost(cfg, [k], [context], dtype, lm_head_rows=k)
    return max(x.flops / ceilings.matmul_flops, x.bytes / ceilings.bandwidth)


def summarise_costs(costs, ks: list[int], roofline: dict[int, float]) -> dict:
    """Each pass ÷ the one-token step, round by round and median; the same for the matrix products and the
    roofline; the times; and c, a draft step (or a lookup) ÷ a one-token target step."""
    rounds = {k: costs.ratio(f"pass {k}", "pass 1") for k in ks}
    return {"rounds": rounds, "ratio": {k: statistics.median(r) for k, r in rounds.items()},
            "matmul_ratio": {k: statistics.median(costs.ratio(f"matmuls {k}", "matmuls 1")) for k in ks},
            "roofline_ratio": {k: roofline[k] / roofline[1] for k in ks},
            "pass_s": {k: costs.median(f"pass {k}") for k in ks},
            "matmul_s": {k: costs.median(f"matmuls {k}") for k in ks},
            "c": {"model draft": statistics.median(costs.ratio("draft step", "pass 1")),
                  "prompt lookup": statistics.median(costs.ratio("lookup", "pass 1"))}}


class Run(NamedTuple):
    tokens: list[int]
    decode_s: float       # the decode phase: from the first token (the prefill's) to the last
    decode_tokens: int    # tokens made in it
    stats: object         # SpecDecodingStats; None for the target alone
    guesses: list[int]    # guesses verified by each timed round's pass (a pass over guesses + 1 tokens)


def timed(target: GPT2, draft, prompt: list[int], params: SamplingParams, gamma: int = 0):
    """One generation with its decode phase timed: the target alone (`kv_cache.generate`) when draft is None, else
    speculative decoding. The prefill, the same target pass either way (and the draft's), is left out."""
    def once() -> Run:
        if draft is None:
            marks = []   # on_step fires after the prefill, then after every decode step
            out = generate(target, [prompt], params, on_step=lambda *_: marks.append(time.perf_counter()))[0]
            return Run(out, marks[-1] - marks[0], len(out) - 1, None, [])
        decoder = SpeculativeDecoder(target, draft, prompt, params, gamma)
        first = len(decoder.step())   # the first round: the prefill pass
        guesses, t0 = [], time.perf_counter()
        while decoder.finish_reason is None:
            proposed = decoder.stats.num_draft_tokens
            decoder.step()
            guesses.append(decoder.stats.num_draft_tokens - proposed)
        return Run(decoder.output, time.perf_counter() - t0, len(decoder.output) - first, decoder.stats, guesses)
    return once


def pass_cost(verify: dict[int, float], k: float) -> float:
    """A pass over k new tokens ÷ a one-token step, interpolated between the k measured."""
    ks = sorted(verify)
    return float(np.interp(k, ks, [verify[j] for j in ks]))


def sweep_row(name: str, gamma: int, base: list[Run], runs: list[Run], c: float, verify: dict[int, float]) -> dict:
    """One draft at one γ: α, tokens per pass, the speedup per round (seconds per token, the target alone's ÷
    speculation's), Leviathan's S from the measured α and c, and the run's own cost model: the timed rounds' tokens ÷
    what their passes cost in target steps, Σ (guesses · c + the measured cost of a pass over guesses + 1 tokens)."""
    stats = runs[0].stats   # greedy: every round made the same tokens, so the same counts
    per_pass = expected_tokens_per_pass(stats.alpha, gamma)
    speedups = [(b.decode_s / b.decode_tokens) / (r.decode_s / r.decode_tokens) for b, r in zip(base, runs)]
    predicted = expected_speedup(stats.alpha, gamma, c)   # per_pass / (γc + 1)
    guesses = stats.num_draft_tokens / stats.num_target_passes
    modelled = runs[0].decode_tokens / sum(g * c + pass_cost(verify, g + 1) for g in runs[0].guesses)
    return {"draft": name, "gamma": gamma, "alpha": stats.alpha, "c": c, "speedups": speedups,
            "speedup": statistics.median(speedups), "low": min(speedups), "high": max(speedups),
            "tokens_per_pass": len(runs[0].tokens) / stats.num_target_passes, "formula_tokens_per_pass": per_pass,
            "guesses_per_pass": guesses, "predicted": predicted,
            "fit": [x / predicted for x in speedups], "modelled": modelled}


def make_checks(cost: dict, rows: list[dict]) -> list[Check]:
    """The premise, round by round; measured ÷ predicted speedup per round, its lowest and highest over every draft
    and γ; prompt lookup's speedup at γ = 4, round by round."""
    fits = list(zip(*(r["fit"] for r in rows)))
    lookup = next(r for r in rows if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA)
    return [Check(f"a pass over {PREMISE_K} new tokens ÷ a one-token step", cost["rounds"][PREMISE_K], PREMISE_LINE,
                  "<=", fmt="{:.2f}"),
            Check("measured ÷ predicted speedup, lowest over γ and drafts", [min(f) for f in fits], 1 - FIT, ">=",
                  fmt="{:.2f}"),
            Check("measured ÷ predicted speedup, highest", [max(f) for f in fits], 1 + FIT, "<=", fmt="{:.2f}"),
            Check(f"prompt-lookup speedup at γ = {LOOKUP_GAMMA}", lookup["speedups"], LOOKUP_LINE, ">=", fmt="{:.2f}")]


def explain(cost: dict, rows: list[dict], share: float | None) -> list[str]:
    """The reading of the numbers: how far verification is free and what its extra time is made of, the worst fit
    and how much of it the pass's cost explains, and the best γ per draft (paying if its whole spread is above 1)."""
    v, pass_s, matmul_s = cost["ratio"], cost["pass_s"], cost["matmul_s"]
    free = max(k for k in v if all(v[j] < FREE_LINE for j in v if j <= k))
    extra, extra_mm = pass_s[PREMISE_K] - pass_s[1], matmul_s[PREMISE_K] - matmul_s[1]
    notes = [f"a pass stays under {FREE_LINE}× a step up to k = {free}; at k = {PREMISE_K} it costs "
             f"{v[PREMISE_K]:.2f}× where the roofline says {cost['roofline_ratio'][PREMISE_K]:.2f}×"
             + (f", {ms(extra)} more than a step, {extra_mm / extra:.0%} of that in the matrix products alone: "
                + (f"the matrix kernel: it takes longer on {PREMISE_K} rows than on one, though it reads the same "
                   "weights" if extra_mm >= extra / 2 else
                   "mostly outside them (attention, the k rows of logits, per-operation overhead)")
                if extra > 0 else "")
             + f". No draft, however cheap and right, beats {(LOOKUP_GAMMA + 1) / v[LOOKUP_GAMMA + 1]:.2f}× at "
               f"γ = {LOOKUP_GAMMA}: (γ + 1) ÷ the pass's cost"]
    w = max(rows, key=lambda r: abs(r["speedup"] / r["predicted"] - 1))
    notes.append(f"worst fit: {w['draft']} at γ = {w['gamma']}, {w['speedup']:.2f}× measured against "
                 f"{w['predicted']:.2f}× predicted ({w['speedup'] / w['predicted'] - 1:+.0%}); its own counts and "
                 f"costs ({w['tokens_per_pass']:.2f} tokens and {w['guesses_per_pass']:.2f} guesses per pass"
                 + (f", not γ = {w['gamma']}" if w["guesses_per_pass"] < 0.95 * w["gamma"] else "")
                 + f"; each pass charged its measured cost at its width) predict {w['modelled']:.2f}× "
                   f"({w['speedup'] / w['modelled'] - 1:+.0%})")
    lu = next(r for r in rows if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA)
    notes.append(f"prompt lookup at γ = {LOOKUP_GAMMA}: {lu['tokens_per_pass']:.2f} tokens per target pass (α = "
                 f"{lu['alpha']:.2f}, {lu['guesses_per_pass']:.2f} guesses per pass), so at most "
                 f"{lu['tokens_per_pass']:.2f}× even were verification free; measured {lu['speedup']:.2f}×")
    for name in dict.fromkeys(r["draft"] for r in rows):
        b = max((r for r in rows if r["draft"] == name), key=lambda r: r["speedup"])
        pays = {HOLDS: "pays", NOT_SUPPORTED: "does not pay", INCONCLUSIVE: "may or may not pay (spread too wide)"}[
            Check("speedup", b["speedups"], 1.0, ">=").outcome(share)]
        notes.append(f"{name}: best γ = {b['gamma']}, {b['speedup']:.2f}× (α = {b['alpha']:.2f}, c = {b['c']:.3f}); "
                     f"speculation {pays} for this pair on this device")
    return notes


def plot(lesson, cost: dict, rows: list[dict], gammas: list[int]) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.4))
    v, rounds = cost["ratio"], cost["rounds"]
    ks = list(v)
    ax.errorbar(ks, [v[k] for k in ks], yerr=[[v[k] - min(rounds[k]) for k in ks], [max(rounds[k]) - v[k] for k in ks]],
                capsize=3, fmt="o-", label="target pass, logits at all k (bars: range)")
    ax.plot(ks, [cost["matmul_ratio"][k] for k in ks], "s--", label="its matrix products alone")
    ax.plot(ks, [cost["roofline_ratio"][k] for k in ks], "k:", label="the roofline (measured ceilings)")
    ax.plot([PREMISE_K], [PREMISE_LINE], "v", color="C3", ms=9,
            label=f"the claim: ≤ {PREMISE_LINE}× at k = {PREMISE_K}")
    top = max(PREMISE_LINE, *v.values(), *cost["matmul_ratio"].values())   # an outlier round's bar may run off the top
    ax.set(xlabel="new tokens k in one pass", ylabel="time ÷ a one-token step", ylim=(0, top * 1.4),
           title=f"verification cost after {cost['context']} cached tokens")
    ticks_at(ax, ks)
    for name, color in zip(dict.fromkeys(r["draft"] for r in rows), ("C0", "C1")):
        mine = [r for r in rows if r["draft"] == name]
        gs = [r["gamma"] for r in mine]
        bx.errorbar(gs, [r["speedup"] for r in mine], capsize=3, fmt="o-", color=color,
                    label=f"{name}, α = {statistics.median(r['alpha'] for r in mine):.2f}: measured (bars: range)",
                    yerr=[[r["speedup"] - r["low"] for r in mine], [r["high"] - r["speedup"] for r in mine]])
        bx.plot(gs, [r["predicted"] for r in mine], "--", color=color, label=f"{name}: S (measured α, c)")
        bx.plot(gs, [r["modelled"] for r in mine], ":", color=color, label=f"{name}: its counts and costs")
    best = [(g + 1) / v[g + 1] for g in gammas]
    bx.plot(gammas, best, color="grey", lw=0.8, label="α = 1, c = 0: (γ + 1) ÷ pass cost")
    bx.axhline(1, color="black", lw=0.6)
    bx.set(xlabel="γ, guesses per round", ylabel="speedup over the target alone (decode phase)",
           title="speedup vs γ: measured and predicted", ylim=(0, max(*best, *(max(r["high"], r["predicted"])
                                                                          for r in rows)) * 1.1))
    ticks_at(bx, gammas)
    for a in (ax, bx):
        a.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    save_plot(lesson, fig)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--draft", help="a draft model (preset or folder) with the target's vocabulary; default: "
                                        "the target's first quarter of blocks, sharing its weights")
    args = parser.parse_args(argv)
    lesson = start(NAME, args)
    target, cfg, s = lesson.model, lesson.config, sizes(args.quick)
    draft = (quiet_load_model(args.draft, lesson.device, lesson.dtype) if args.draft
             else shallow_draft(target, max(1, cfg.n_layer // 4)))
    prompt = quoting_prompt(target, s["passage"], s["quoted"])
    greedy = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], ignore_eos=True)
    drafts = {"model draft": draft, "prompt lookup": NgramProposer()}
    sampled = SamplingParams(temperature=1.0, max_tokens=s["sampled_tokens"], ignore_eos=True, seed=0)
    alpha_sampled = timed(target, draft, prompt, sampled, LOOKUP_GAMMA)().stats.alpha
    ks = sorted({1, PREMISE_K, *s["ks"], *(g + 1 for g in s["gammas"])})
    context = min(CONTEXT, cfg.n_ctx - max(ks))
    costs = interleave(cost_fns(target, draft, ks, context), s["cost_repeats"], device=lesson.device,
                       desc="verification cost, in turns")
    roofline = {k: roofline_s(cfg, k, context, lesson.dtype, lesson.ceilings) for k in ks}
    cost = {**summarise_costs(costs, ks, roofline), "context": context}
    v, c = cost["ratio"], cost["c"]
    print_table(["new tokens k", "pass ÷ 1-token step", "range", "matrix products alone", "roofline"],
                [[k, f"{v[k]:.2f}", f"{min(cost['rounds'][k]):.2f}–{max(cost['rounds'][k]):.2f}",
                  f"{cost['matmul_ratio'][k]:.2f}", f"{cost['roofline_ratio'][k]:.2f}"] for k in ks],
                f"one target pass after {context} cached tokens ({ms(cost['pass_s'][1])} for k = 1); "
                f"c = {c['model draft']:.3f} (model draft), {c['prompt lookup']:.4f} (lookup)")

    fns = {"target alone": timed(target, None, prompt, greedy),
           **{f"{n} γ={g}": timed(target, d, prompt, greedy, g) for n, d in drafts.items() for g in s["gammas"]}}
    rounds = interleave(fns, s["repeats"], warmup=0, device=lesson.device,   # the runs above warmed the model up
                        desc="speculation sweep, in turns")
    base, rows = rounds.results("target alone"), []
    for name, g in ((name, g) for name in drafts for g in s["gammas"]):
        runs = rounds.results(f"{name} γ={g}")
        if any(r.tokens != base[0].tokens for r in runs):
            raise RuntimeError(f"{name} at γ = {g} gave tokens other than the target's own greedy ones: a bug in "
                               "minillm/speculative.py (its tests say where)")
        rows.append(sweep_row(name, g, base, runs, c[name], v))
    print_table(["draft", "γ", "α", "tokens/pass", "formula", "guesses/pass", "speedup", "range", "S",
                 "from counts, costs"],
                [[r["draft"], r["gamma"], f"{r['alpha']:.2f}", f"{r['tokens_per_pass']:.2f}",
                  f"{r['formula_tokens_per_pass']:.2f}", f"{r['guesses_per_pass']:.2f}", f"{r['speedup']:.2f}×",
                  f"{r['low']:.2f}–{r['high']:.2f}", f"{r['predicted']:.2f}×", f"{r['modelled']:.2f}×"]
                 for r in rows],
                f"greedy, a {len(prompt)}-token prompt that repeats itself, {s['max_tokens']} new tokens, decode phase "
                f"timed, {s['repeats']} rounds; the target alone: "
                f"{ms(statistics.median(b.decode_s / b.decode_tokens for b in base))} per token")

    load = lesson.load()
    verdict = judge(f"verifying γ + 1 tokens costs about one decode step ({PREMISE_K} tokens ≤ {PREMISE_LINE}×), "
                    f"so the speedup follows Leviathan's formula within {FIT:.0%}, and prompt lookup on a prompt that "
                    f"repeats itself gives ≥ {LOOKUP_LINE}×", make_checks(cost, rows), load)
    verdict.notes += explain(cost, rows, load.share) + [
        f"α was measured on {target.weights_source} weights (draft: {draft.weights_source}) and says nothing about a "
        f"real checkpoint's α; the cost curve holds for any weights. With sampling (temperature 1, Leviathan's rule) "
        f"at γ = {LOOKUP_GAMMA}, the model draft's α is {alpha_sampled:.2f}"]
    print_verdict(verdict)
    plot(lesson, cost, rows, s["gammas"])
    figures = {"verification": cost, "draft": draft.weights_source, "prompt_len": len(prompt),
               "max_tokens": s["max_tokens"], "sweep": rows, "alpha_sampled": alpha_sampled,
               "baseline_rounds": [{"decode_s": b.decode_s, "decode_tokens": b.decode_tokens} for b in base]}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
