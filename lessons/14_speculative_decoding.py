"""Lesson 14: speculative decoding. Does checking γ guesses in one target pass pay, as Leviathan's formula says?

The claim
---------
A decode step is memory-bound (lessons 02 and 04), and a pass over k new tokens reads the same weights, so
checking k tokens should cost about one step. A cheap draft guesses γ tokens; the target checks them in one
pass and keeps the prefix it agrees with, plus one token of its own (`minillm/speculative.py`). With
acceptance rate α and a draft step costing c target steps, Leviathan et al. predict the speedup
S = (1 − α^(γ+1)) / ((1 − α) · (γc + 1)), the pass counted as one step, for γ guesses in every pass; a draft
that guesses fewer (prompt lookup proposes nothing when the last tokens never occurred before) is fed the
guesses it made, ḡ per pass, in γ's place. Three lines: a pass over 5 new tokens costs ≤ 1.3× a one-token
step (the premise; the pass model, `minillm/bench/pass_cost.py`, predicts it first); measured ÷ S lies within
0.67–1.15 for every γ and draft (S counts a pass as one step where the premise allows 1.3, and 15% either way
for the timing); prompt lookup (c ≈ 0) on a prompt that repeats itself gives ≥ 1.5× at γ = 4. The notes
compute from the measurements why a line was missed.

α needs trained weights: a random init barely looks at its context. The lesson speculates with the --model's
checkpoint (and its classic draft) when it is on disk; otherwise with a small byte-level model it trains in
seconds on the docstrings of a few standard-library modules, and that model's first block as its draft
(`lessons/drafts.py`); it says which.

What this lesson measures
-------------------------
1. A pass over k new tokens after up to 256 cached ones (logits at all k, as verification needs) ÷ a one-token
   step, beside its matrix products alone; c: a draft step, and a lookup that finds nothing, ÷ that step.
2. Greedy, decode phase timed in turns with the target alone, γ = 1, 2, 4, 8, for a draft and for prompt lookup
   (vLLM's n-gram draft), on a passage, the target's greedy continuation and the passage again: α, ḡ, tokens per
   pass against (1 − α^(ḡ+1)) / (1 − α), the speedup, S, and S with each pass at its measured cost. First, a
   sampled run: α under Leviathan's rule (the exercise).
--quick: γ = 4 only, a 42-token prompt, 10 new tokens, five rounds; the same lines.

Predict before you run: what share of a decode step is not reading weights on
this CPU? If verifying 5 tokens cost 2× a step, what could any draft give at γ = 4?
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import numpy as np

from common import make_parser, ms, plt, predict, print_table, run, save_plot, si, start, ticks_at, write_results
import torch  # after common, which imports minillm: OpenMP's wait policy is set before torch loads it
from drafts import quoting_prompt, speculation_pair
from minillm.bench.verdict import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, Check, interleave, judge, print_verdict, settled
from minillm.bench.cost import step_cost
from minillm.bench.pass_cost import fixed_cost
from minillm.kv_cache import KVCache, Segment, generate
from minillm.bench.steps import decode_step
from minillm.model import GPT2, Conv1D
from minillm.sampling_params import SamplingParams
from minillm.speculative import NgramProposer, SpeculativeDecoder, expected_speedup, expected_tokens_per_pass

NAME = "14_speculative_decoding"
CONTEXT = 256                      # cached tokens before the measured passes
PREMISE_K, PREMISE_LINE = 5, 1.3   # a pass over 5 new tokens costs at most 1.3× a one-token step
FREE_LINE = 1.2                    # the verdict says up to which k a pass stays under 1.2× a step
FIT = 0.15                         # timing noise either way
FIT_BAND = (1 / (PREMISE_LINE * (1 + FIT)), 1 + FIT)  # S counts a pass as one step; the premise allows up to 1.3
LOOKUP_GAMMA, LOOKUP_LINE = 4, 1.5  # prompt lookup at γ = 4 (fixed beforehand) gives at least 1.5×
PAYS = {HOLDS: "pays", NOT_SUPPORTED: "does not pay", INCONCLUSIVE: "may or may not pay (its interval straddles 1×)"}
SIZES = {"quick": dict(gammas=[LOOKUP_GAMMA], passage=16, quoted=10, max_tokens=10, repeats=5, cost_repeats=5, ks=[],
                       train_steps=300, train_length=64),
         "full": dict(gammas=[1, 2, 4, 8], passage=40, quoted=16, max_tokens=24, repeats=5, cost_repeats=7, ks=[16],
                      train_steps=1000, train_length=128)}


def cost_fns(target: GPT2, draft: GPT2, ks: list[int], context: int) -> dict:
    """Target passes over k new tokens after `context` cached ones (caches declared filled: time does not depend on
    the values), logits at all k; their matrix products alone (projections, LM head); a draft step; a lookup."""
    cfg, device, g = target.config, target.device, torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (context + max(ks),), generator=g).tolist()
    ids = torch.tensor([tokens[context:]], device=device)
    layers = [m for m in target.modules() if isinstance(m, Conv1D)]
    xs = {n: torch.randn(max(ks), n, generator=g).to(device, target.dtype) for n in {m.weight.shape[0] for m in layers}}

    def verify(k: int):
        cache, rows = KVCache(cfg, 1, context + k, device, target.dtype), torch.arange(k, device=device)
        return torch.inference_mode()(lambda: target(ids[:, :k], cache.prepare([Segment(0, context, k)]).positions,
                                                     cache=cache, logits_indices=rows))

    def matmuls(k: int):
        return torch.inference_mode()(lambda: [m(xs[m.weight.shape[0]][:k]) for m in layers]
                                      + [torch.nn.functional.linear(xs[cfg.n_embd][:k], target.wte.weight)])

    lookup, greedy = NgramProposer(), SamplingParams(temperature=0.0)   # random tokens: no match, all scanned
    return {**{f"pass {k}": verify(k) for k in ks}, **{f"matmuls {k}": matmuls(k) for k in ks},
            "draft step": decode_step(draft, context),
            "lookup": lambda: lookup.propose(tokens[:context], LOOKUP_GAMMA, greedy, None)}


def summarise_costs(costs, ks: list[int]) -> dict:
    """Each pass (and its matrix products) ÷ k = 1's, round by round and median; their times; c for each draft."""
    rounds = {k: costs.ratio(f"pass {k}", "pass 1") for k in ks}
    return {"rounds": rounds, "ratio": {k: statistics.median(r) for k, r in rounds.items()},
            "matmul_ratio": {k: statistics.median(costs.ratio(f"matmuls {k}", "matmuls 1")) for k in ks},
            "seconds": {what: {k: costs.median(f"{what} {k}") for k in ks} for what in ("pass", "matmuls")},
            "c": {"model draft": statistics.median(costs.ratio("draft step", "pass 1")),
                  "prompt lookup": statistics.median(costs.ratio("lookup", "pass 1"))}}


class Run(NamedTuple):
    tokens: list[int]
    decode_s: float       # the decode phase: from the first token (the prefill's) to the last
    decode_tokens: int    # tokens made in it
    stats: object         # SpecDecodingStats; None for the target alone


def timed(target: GPT2, draft, prompt: list[int], params: SamplingParams, gamma: int = 0):
    """One generation with its decode phase timed, not the prefill: the target alone if draft is None."""
    def once() -> Run:
        if draft is None:
            marks = []   # on_step fires after the prefill, then after every decode step
            out = generate(target, [prompt], params, on_step=lambda *_: marks.append(time.perf_counter()))[0]
            return Run(out, marks[-1] - marks[0], len(out) - 1, None)
        decoder = SpeculativeDecoder(target, draft, prompt, params, gamma)
        first, t0 = len(decoder.step()), time.perf_counter()   # the first round is the prefill pass
        while decoder.finish_reason is None:
            decoder.step()
        return Run(decoder.output, time.perf_counter() - t0, len(decoder.output) - first, decoder.stats)
    return once


def sweep_row(name: str, gamma: int, base: list[Run], runs: list[Run], c: float, verify: dict[int, float]) -> dict:
    """One draft at one γ: α, tokens and guesses per pass, the speedup per round (per-token time ratio), and what
    Leviathan's formula predicts fed the guesses actually made per pass (ḡ, where lookup may propose fewer than γ):
    (1 − α^(ḡ+1)) / ((1 − α) · (ḡc + 1)), its value at γ beside it, and with each pass at its measured cost."""
    stats, ks = runs[0].stats, sorted(verify)   # greedy: every round made the same tokens, so the same counts
    speedups = [(b.decode_s / b.decode_tokens) / (r.decode_s / r.decode_tokens) for b, r in zip(base, runs)]
    per_pass, guesses = len(runs[0].tokens) / stats.num_target_passes, stats.num_draft_tokens / stats.num_target_passes
    predicted = expected_speedup(stats.alpha, guesses, c)   # tokens per pass / (ḡc + 1)
    return {"draft": name, "gamma": gamma, "alpha": stats.alpha, "c": c, "speedups": speedups,
            "speedup": statistics.median(speedups), "low": min(speedups), "high": max(speedups),
            "tokens_per_pass": per_pass, "formula_tokens_per_pass": expected_tokens_per_pass(stats.alpha, guesses),
            "guesses_per_pass": guesses, "predicted": predicted, "fit": [x / predicted for x in speedups],
            "leviathan_at_gamma": expected_speedup(stats.alpha, gamma, c),
            "modelled": per_pass / (guesses * c + float(np.interp(guesses + 1, ks, [verify[k] for k in ks])))}


def checks(figures: dict) -> list[Check]:
    """The premise against the pass model's prediction; measured ÷ predicted speedup (the guesses made), lowest and
    highest over drafts and γ, inside FIT_BAND; prompt lookup's speedup."""
    f = figures
    cost, rows = f["verification"], f["sweep"]
    fits, notes = list(zip(*(r["fit"] for r in rows))), explain(cost, rows)
    lookup = next(r for r in rows if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA)
    why = {"premise": notes[0], "fit": notes[1], "lookup": next(n for n in notes if n.startswith("prompt l"))}
    return [Check(name, values, line, op, fmt="{:.2f}", predicted=pred, key=key, why=why[key.split("_")[0]])
            for name, values, line, op, pred, key in [
        (f"a pass over {PREMISE_K} new tokens ÷ a one-token step", cost["rounds"][PREMISE_K], PREMISE_LINE, "<=",
         f["premise_predicted"], "premise"),
        ("measured ÷ predicted speedup, lowest over γ and drafts", [min(x) for x in fits], FIT_BAND[0], ">=", 1.0,
         "fit_low"),
        ("measured ÷ predicted speedup, highest", [max(x) for x in fits], FIT_BAND[1], "<=", 1.0, "fit_high"),
        (f"prompt-lookup speedup at γ = {LOOKUP_GAMMA}", lookup["speedups"], LOOKUP_LINE, ">=", f["lookup_predicted"],
         "lookup")]]


def explain(cost: dict, rows: list[dict]) -> list[str]:
    """How far verification is free and why not further; the worst fit and its counts' and costs' S; each best γ."""
    v, pass_s, matmul_s = cost["ratio"], cost["seconds"]["pass"], cost["seconds"]["matmuls"]
    free = max(k for k in v if all(v[j] < FREE_LINE for j in v if j <= k))
    extra, extra_mm = pass_s[PREMISE_K] - pass_s[1], matmul_s[PREMISE_K] - matmul_s[1]
    cause = ("the matrix kernel, slower on more rows though it reads the same weights" if extra_mm >= extra / 2
             else "mostly outside them (attention, the k rows of logits, per-operation overhead)")
    notes = [f"a pass stays under {FREE_LINE}× a step up to k = {free}; at k = {PREMISE_K} it costs {v[PREMISE_K]:.2f}×"
             + (f", {ms(extra)} more than a step, {extra_mm / extra:.0%} of that in the matrix products alone: {cause}"
                if extra > 0 else "") + f". No draft, however cheap and right, beats "
             f"{(LOOKUP_GAMMA + 1) / v[LOOKUP_GAMMA + 1]:.2f}× at γ = {LOOKUP_GAMMA}: (γ + 1) ÷ the pass's cost"]
    w = max(rows, key=lambda r: abs(r["speedup"] / r["predicted"] - 1))
    off = {k: f"{w['speedup'] / w[k] - 1:+.0%}" for k in ("predicted", "modelled")}
    notes.append(f"worst fit: {w['draft']} at γ = {w['gamma']}, {w['speedup']:.2f}× against S = {w['predicted']:.2f}× "
                 f"({off['predicted']}) for the {w['guesses_per_pass']:.2f} guesses it made per pass (at γ guesses "
                 f"the formula says {w['leviathan_at_gamma']:.2f}×); with each pass at its measured cost, not 1, "
                 f"{w['modelled']:.2f}× ({off['modelled']})")
    for name in dict.fromkeys(r["draft"] for r in rows):
        b = max((r for r in rows if r["draft"] == name), key=lambda r: r["speedup"])
        pays = PAYS[Check("speedup", b["speedups"], 1.0, ">=").outcome()]
        notes.append(f"{name}: best γ = {b['gamma']}, {b['speedup']:.2f}× (α = {b['alpha']:.2f}, c = {b['c']:.3f}; "
                     f"{b['tokens_per_pass']:.2f} tokens per pass, the most it could give were verification and "
                     f"drafting free); speculation {pays} for this pair on this device")
    return notes


def plot(lesson, cost: dict, rows: list[dict], gammas: list[int], verdict) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.4))
    v, rounds, mm, ks = cost["ratio"], cost["rounds"], cost["matmul_ratio"], list(cost["ratio"])
    ax.errorbar(ks, list(v.values()), yerr=[[v[k] - min(rounds[k]) for k in ks], [max(rounds[k]) - v[k] for k in ks]],
                capsize=3, fmt="o-", label="target pass, logits at all k (bars: range)")
    ax.plot(ks, list(mm.values()), "s--", label="its matrix products alone")
    ax.axhline(PREMISE_LINE, color="C3", ls=":", lw=1)
    ax.plot([PREMISE_K], [PREMISE_LINE], "v", color="C3", ms=9, label=f"the claim's line: ≤ {PREMISE_LINE}× at k = {PREMISE_K}")
    ax.set(xlabel="new tokens k in one pass", ylabel="time ÷ a one-token step", title=f"verification cost after "
           f"{cost['context']} cached tokens\n(medians of {len(rounds[ks[0]])} rounds)", ylim=(0, max(PREMISE_LINE, *v.values(), *mm.values()) * 1.4))
    names, n = list(dict.fromkeys(r["draft"] for r in rows)), len(rows[0]["speedups"])
    ranges = lambda mine: [[r["speedup"] - r["low"] for r in mine], [r["high"] - r["speedup"] for r in mine]]  # noqa
    series = (("speedup", "measured"), ("predicted", "S (α, c, ḡ guesses made)"), ("modelled", "its counts and costs"))
    if len(gammas) > 1:  # a sweep: measured, and the two predictions beside it (offset so no marker hides another)
        for name, color in zip(names, ("C0", "C1")):
            mine = [r for r in rows if r["draft"] == name]
            gs = [r["gamma"] for r in mine]
            bx.errorbar(gs, [r["speedup"] for r in mine], yerr=ranges(mine), capsize=3, fmt="o-", color=color,
                        label=f"{name}, α = {statistics.median(r['alpha'] for r in mine):.2f}: measured (bars: range)")
            for (key, label), x, fmt in zip(series[1:], (1.06, 1 / 1.06), ("x--", "s:")):
                bx.plot([g * x for g in gs], [r[key] for r in mine], fmt, color=color, label=f"{name}: {label}",
                        **({"ms": 9} if key == "predicted" else {"mfc": "none"}))
        bx.set_xscale("log", base=2)
        ticks_at(bx, gammas)
        bx.set(xlabel="γ, guesses per round", title=f"speedup vs γ: measured (medians of {n} rounds) and predicted")
    else:  # one γ: bars, not a one-point sweep
        mine = [next(r for r in rows if r["draft"] == name) for name in names]
        for j, (key, label) in enumerate(series):
            bx.bar([i + (j - 1) * 0.27 for i in range(len(names))], [r[key] for r in mine], 0.27, capsize=3,
                   yerr=ranges(mine) if j == 0 else None, label=label + (" (median; bars: range)" if j == 0 else ""),
                   color=f"C{j}")
        bx.set_xticks(range(len(names)), [f"{r['draft']}\nα = {r['alpha']:.2f}" for r in mine])
        bx.set(title=f"speedup at γ = {gammas[0]}: measured (medians of {n} rounds) and predicted")
    bx.axhline(1, color="black", lw=0.6)
    bx.axhline(LOOKUP_LINE, color="C3", ls=":", lw=1, label=f"the claim's line for prompt lookup: ≥ {LOOKUP_LINE}×")
    bx.set(ylabel="speedup over the target alone (decode phase)",
           ylim=(0, max(LOOKUP_LINE, *(max(r["high"], r["predicted"], r["modelled"]) for r in rows)) * 1.15))
    ticks_at(ax, ks)
    for a in (ax, bx):
        a.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    save_plot(lesson, fig, verdict)


def predict_costs(lesson, target: GPT2, s: dict) -> tuple[list[int], int, float, float]:
    """The pass lengths k to time, the cached context, and the pass model's (pass_cost.py) premise and most lookup
    can give (every guess right, drafting free), printed."""
    ks = sorted({1, PREMISE_K, *s["ks"], *(g + 1 for g in s["gammas"])})
    context, cfg = min(CONTEXT, target.config.n_ctx - max(ks)), target.config
    one, five = (step_cost(cfg, [k], [context], lesson.dtype, lm_head_rows=k) for k in (1, PREMISE_K))
    t1 = fixed_cost(target)
    peak, every = lesson.ceilings.matmul_flops, step_cost(cfg, [LOOKUP_GAMMA + 1], [context], lesson.dtype,
                                                           lm_head_rows=LOOKUP_GAMMA + 1)
    premise = (t1 + five.flops / peak) / (t1 + one.flops / peak)
    lookup = (t1 + every.flops / peak) / (t1 + one.flops / peak)  # a pass checking γ guesses, in steps
    predict(lesson, f"a pass over {PREMISE_K} new tokens after {context} cached reads the same "
            f"{si(one.weight_bytes, 'B')} of weights as a one-token step and does {five.flops / one.flops:.1f}× its "
            f"FLOPs, at {five.intensity:.1f} FLOP/B; with t₁ = {ms(t1)} (a one-token request's TTFT) and the FLOPs at "
            f"the measured peak it costs {premise:.2f} steps (the line: {PREMISE_LINE}×), and speculation then pays "
            f"about its tokens per pass, (1 − α^(ḡ+1)) / (1 − α) for ḡ guesses per pass, less the draft's cost; "
            f"prompt lookup at γ = {LOOKUP_GAMMA} at most {LOOKUP_GAMMA + 1} tokens per pass of {lookup:.2f} steps",
            expect={"premise": premise, "fit_low": 1.0, "fit_high": 1.0, "lookup": (LOOKUP_GAMMA + 1) / lookup})
    return ks, context, premise, (LOOKUP_GAMMA + 1) / lookup


def measure_speculation(lesson, target: GPT2, draft: GPT2, prompt: list[int], cost: dict, s: dict):
    """The target alone against each draft at each γ, greedy, in turns: (one row per draft and γ, rounds)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], ignore_eos=True)
    drafts = {"model draft": draft, "prompt lookup": NgramProposer()}
    fns = {"target alone": timed(target, None, prompt, greedy),
           **{f"{n} γ={g}": timed(target, d, prompt, greedy, g) for n, d in drafts.items() for g in s["gammas"]}}
    rows_of = lambda r: [sweep_row(n, g, r.results("target alone"), r.results(f"{n} γ={g}"),  # noqa: E731
                                   cost["c"][n], cost["ratio"]) for n in drafts for g in s["gammas"]]
    rounds = interleave(fns, s["repeats"], warmup=0, device=lesson.device,   # the runs before warmed the model up
                        desc="speculation sweep, in turns",
                        until=settled(lambda r: checks({"verification": cost, "sweep": rows_of(r),
                                                        "premise_predicted": 1.0, "lookup_predicted": 1.0})))
    rows = rows_of(rounds)
    per_token = ms(statistics.median(b.decode_s / b.decode_tokens for b in rounds.results("target alone")))
    print_table(["draft", "γ", "α", "guesses/pass ḡ", "tokens/pass", "formula", "speedup", "range", "S(ḡ)", "S(γ)",
                 "counts, costs"],
                [[r["draft"], r["gamma"], f"{r['alpha']:.2f}", f"{r['guesses_per_pass']:.2f}",
                  f"{r['tokens_per_pass']:.2f}", f"{r['formula_tokens_per_pass']:.2f}", f"{r['speedup']:.2f}×",
                  f"{r['low']:.2f}–{r['high']:.2f}", f"{r['predicted']:.2f}×", f"{r['leviathan_at_gamma']:.2f}×",
                  f"{r['modelled']:.2f}×"] for r in rows],
                f"greedy, a {len(prompt)}-token prompt that repeats itself, {s['max_tokens']} new tokens, "
                f"{rounds.count} rounds; the target alone: {per_token} per token")
    return rows, rounds


def judge_claim(lesson, f: dict, rounds: list):
    """The checks, each explained by the run's own numbers, and the notes the run's numbers say."""
    checks_ = checks(f)
    verdict = judge(f"verifying γ + 1 tokens costs about one decode step ({PREMISE_K} tokens ≤ {PREMISE_LINE}×), "
                    "so the speedup follows Leviathan's formula fed the guesses actually made (measured ÷ predicted "
                    f"{FIT_BAND[0]:.2f}–{FIT_BAND[1]:.2f}), and prompt lookup on a prompt that repeats itself gives ≥ "
                    f"{LOOKUP_LINE}×, on trained weights", checks_, lesson.load(), rounds)
    told = {c.why for c in checks_ if c.outcome() == "NOT SUPPORTED"}  # printed as the why of their check
    verdict.notes += [n for n in dict.fromkeys(explain(f["verification"], f["sweep"])) if n not in told] + [
        f"speculated with: {f['pair']}. Sampled (temperature 1, Leviathan's rule, γ = {LOOKUP_GAMMA}), the model "
        f"draft's α is {f['alpha_sampled']:.2f}"]
    print_verdict(verdict)
    return verdict


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--draft", default="auto", help="the draft: auto (the classic pair when its weights are "
                        "present: distilgpt2 for gpt2, gpt2 for the larger; else shallow), shallow (the target's "
                        "first blocks), or any checkpoint with the target's vocabulary")
    args = parser.parse_args(argv)
    lesson = start(NAME, args)
    s = SIZES["quick" if args.quick else "full"]
    target, draft, passage, pair = speculation_pair(lesson, args, s)
    print(f"speculating with: {pair}")
    prompt = quoting_prompt(target, passage, s["quoted"])
    sampled = SamplingParams(temperature=1.0, max_tokens=s["max_tokens"], ignore_eos=True, seed=0)
    alpha_sampled = timed(target, draft, prompt, sampled, LOOKUP_GAMMA)().stats.alpha  # the exercise's rule
    ks, context, premise_predicted, lookup_predicted = predict_costs(lesson, target, s)
    premise = lambda r: [Check("premise", summarise_costs(r, ks)["rounds"][PREMISE_K], PREMISE_LINE, "<=")]  # noqa
    costs = interleave(cost_fns(target, draft, ks, context), s["cost_repeats"], device=lesson.device,
                       desc="verification cost, in turns", until=settled(premise))
    cost = {**summarise_costs(costs, ks), "context": context}
    rows, rounds = measure_speculation(lesson, target, draft, prompt, cost, s)
    figures = {"verification": cost, "premise_predicted": premise_predicted, "lookup_predicted": lookup_predicted,
               "target": target.weights_source,
               "draft": draft.weights_source, "pair": pair, "prompt_len": len(prompt), "max_tokens": s["max_tokens"],
               "sweep": rows, "alpha_sampled": alpha_sampled, "fit_band": FIT_BAND}
    verdict = judge_claim(lesson, figures, [costs, rounds])
    plot(lesson, cost, rows, s["gammas"], verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
