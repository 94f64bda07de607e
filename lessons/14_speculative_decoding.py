"""Lesson 14: speculative decoding. Does checking γ guesses in one target pass pay, as Leviathan's formula says?

The claim
---------
A decode step is memory-bound (lessons 02 and 04), and a pass over k new tokens reads the same weights, so
checking k tokens should cost about one step. A cheap draft guesses γ tokens; the target checks them in one
pass and keeps the prefix it agrees with, plus one token of its own (`minillm/speculative.py`). With
acceptance rate α, ḡ guesses made per pass (γ, or fewer: prompt lookup proposes nothing when the last tokens
never occurred before) and a draft step costing c target steps, Leviathan et al. predict the speedup
S = (1 − α^(ḡ+1)) / ((1 − α) · (ḡc + v)), v a pass over ḡ + 1 tokens in steps (1 in the paper). A loop also
works between passes: ℓ per pass, ℓ₀ per target-alone step, so S = (1 − α^(ḡ+1))(1 + ℓ₀) / ((1 − α)(ḡc + v + ℓ)).

Each part is judged where it applies:
- The premise (v ≈ 1) belongs to the --model's shape, not its weights' values: a pass over 5 new tokens ÷ a
  one-token step is timed on that shape (a random init times the same), predicted first by the pass model
  (`minillm/bench/pass_cost.py`), and judged inside its band (prefill at half the peak to all of it, t₁ off by
  1.5× either way); a low end at or under 1 is reported, not judged (no pass costs under a step). c of the draft
  it would use there (its first quarter of blocks) is reported beside it.
- α and ḡ need trained weights: a random init barely looks at its context. The pair is the --model's checkpoint
  and its classic draft when on disk; otherwise a small byte-level model trained here in seconds on the docstrings
  of a few standard-library modules, its first block the draft (`lessons/drafts.py`); the run says which.
- The speedup to expect at the --model's shape is S from the pair's α and ḡ with that shape's measured v and c
  (the loop's seconds carried over): a prediction, reported. What runs end to end is the pair: its measured
  speedup ÷ S (the formula's tokens per pass, not the run's) at the pair's OWN v, c, ℓ and ℓ₀ is judged, within
  15% either way (timing), for every γ and for lookup at γ = 4; ℓ, ℓ₀: time outside the passes and lookups of a
  generation clocked apart from the judged rounds, ÷ a 1-token pass timed alone. A small pair's step is host-bound,
  its v far from 1: held to its own costs, not to the premise. Lookup's ≥ 1.5× on a repeating prompt is context.

What this lesson measures
-------------------------
1. On the --model's shape and on the pair: a pass over k new tokens after up to 256 cached ones (logits at all k)
   ÷ a one-token step, beside its matrix products alone; c: a draft step, and a lookup that finds nothing, ÷ a step.
2. Greedy, decode phase timed in turns with the target alone, γ = 1, 2, 4, 8, for the draft and for prompt lookup
   (vLLM's n-gram draft), on a passage, the target's greedy continuation and the passage again: α, ḡ, tokens per
   pass against (1 − α^(ḡ+1)) / (1 − α), ℓ, the speedup, and S at v = 1, at the pair's costs and at the shape's.
   First, a sampled run: α under Leviathan's rule (the exercise).
--quick: γ = 4 only, a 42-token prompt, 10 new tokens, 8 generations a round, five rounds; the same lines.

Predict before you run: what share of a decode step is not reading weights on
this CPU? If verifying 5 tokens cost 2× a step, what could any draft give at γ = 4?
"""
from __future__ import annotations

import statistics

from common import make_parser, ms, plt, predict, print_table, run, save_plot, si, start, ticks_at, write_results
from drafts import cost_fns, quoting_prompt, shallow_draft, speculation_pair, summarise_costs, sweep_row, timed
from minillm.bench.verdict import (HOLDS, INCONCLUSIVE, NOT_SUPPORTED, Check, Fact, interleave, judge, print_verdict,
                                   settled)
from minillm.bench.cost import step_cost
from minillm.bench.pass_cost import RATE_FLOOR, band, fixed_cost, verify_ratio
from minillm.model import GPT2
from minillm.sampling_params import SamplingParams
from minillm.speculative import NgramProposer

NAME = "14_speculative_decoding"
CONTEXT = 256                      # cached tokens before the measured passes
PREMISE_K = 5                      # the premise: a pass over 5 new tokens costs about one step
PREMISE = f"on {{}}'s shape, a pass over {PREMISE_K} new tokens ÷ a one-token step"
FREE_LINE = 1.2                    # the notes say up to which k a pass stays under 1.2× a step
FIT = 0.15                         # timing noise either way
FIT_BAND = (1 / (1 + FIT), 1 + FIT)  # the pair's measured speedup ÷ S at its own measured costs
LOOKUP_GAMMA, LOOKUP_CONTEXT = 4, 1.5  # prompt lookup at γ = 4 (fixed beforehand); the ≥ 1.5× it is said to give
PAYS = {HOLDS: "pays", NOT_SUPPORTED: "does not pay", INCONCLUSIVE: "may or may not pay (its interval straddles 1×)"}
SIZES = {"quick": dict(gammas=[LOOKUP_GAMMA], passage=16, quoted=10, max_tokens=10, repeats=5, cost_repeats=5, ks=[],
                       train_steps=300, train_length=64, generations=8),
         "full": dict(gammas=[1, 2, 4, 8], passage=40, quoted=16, max_tokens=24, repeats=5, cost_repeats=7, ks=[16],
                      train_steps=1000, train_length=128, generations=4)}


def checks(figures: dict) -> list[Check]:
    """The premise on the --model's shape, inside the pass model's band (its low end only where it is over 1: no
    pass costs less than a step); on the pair, measured ÷ S at its own costs: the model draft's lowest and highest
    over γ, and prompt lookup's at γ = 4, inside FIT_BAND."""
    f, sh, rows, notes = figures, figures["shape"], figures["sweep"], explain(figures["shape"], figures["sweep"])
    fits = list(zip(*(r["fit"] for r in rows if r["draft"] == "model draft")))
    lookup = next(r for r in rows if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA)
    why = {"premise": notes[0], "fit": notes[1], "lookup": next(n for n in notes if n.startswith("prompt l"))}
    premise, (lo, hi), name = sh["predicted_ratio"][PREMISE_K], sh["premise_band"], PREMISE.format(f["model"])
    low = [(f"{name}, low end of the pass model's band", sh["rounds"][PREMISE_K], lo, ">=", premise, "premise_low")]
    return [Check(name, values, line, op, fmt="{:.2f}", predicted=pred, key=key, why=why[key.split("_")[0]])
            for name, values, line, op, pred, key in low * (lo > 1) + [
        (f"{name}, high end", sh["rounds"][PREMISE_K], hi, "<=", premise, "premise_high"),
        ("the pair's model draft: speedup ÷ S at its own costs, lowest over γ", [min(x) for x in fits],
         FIT_BAND[0], ">=", 1.0, "fit_low"),
        ("the pair's model draft: the same, highest", [max(x) for x in fits], FIT_BAND[1], "<=", 1.0, "fit_high"),
        (f"the pair's prompt lookup at γ = {LOOKUP_GAMMA}: speedup ÷ S at its own costs", lookup["fit"], FIT_BAND[0],
         ">=", 1.0, "lookup")]]


def facts(figures: dict) -> list[Fact]:
    """Figures that cannot refute the claim: c at the shape; the pair's own pass cost (which its S is priced at);
    the premise where its band's low end is ≤ 1; ℓ₀ and each ℓ (in S); S at the shape for each draft and γ, a
    prediction no run here can time end to end without its checkpoint."""
    f, sh, shape, rows = figures, figures["shape"], f"{figures['model']}'s shape", figures["sweep"]
    low = [Fact(PREMISE.format(f["model"]) + f" (its band's low end, {sh['premise_band'][0]:.2f}, not judged)",
                sh["ratio"][PREMISE_K], predicted=sh["predicted_ratio"][PREMISE_K], fmt="{:.2f}",
                why="a low end at or under 1 cannot fail: no pass over more tokens costs less than a one-token step")]
    loop = "the loop's own work (outside the passes) ÷ a pass over 1 token timed alone, clocked apart from the judged "
    return [Fact(f"c at {shape}: a step of its first {sh['blocks']} blocks ÷ a step", sh["c"]["model draft"],
                 predicted=sh["c_predicted"]["model draft"], fmt="{:.2f}",
                 why="predicted as the share of the weights it reads; the S at this shape uses the measured one"),
            Fact(f"the pair's pass over {PREMISE_K} tokens ÷ its step", f["verification"]["ratio"][PREMISE_K],
                 predicted=f["verification"]["predicted_ratio"][PREMISE_K], fmt="{:.2f}",
                 why="a small model's step is host-bound (per-operation overhead), so the pair's S is priced at this")
            ] + low * (sh["premise_band"][0] <= 1) + [
        Fact("ℓ₀, the pair's target alone: loop work per step", rows[0]["loop_alone"], fmt="{:.2f}",
             why=loop + "rounds; a target-alone step costs 1 + ℓ₀ passes timed alone")] + [
        Fact(f"ℓ, the pair's {r['draft']} at γ = {r['gamma']}: loop work per pass", r["loop"], fmt="{:.2f}",
             why=loop + "rounds; in S's denominator, ḡc + v + ℓ") for r in rows] + [
        Fact(f"S at {shape}, {r['draft']} at γ = {r['gamma']}", r["at_shape"], predicted=r["at_shape_predicted"],
             fmt="{:.2f}", why=f"the pair's α = {r['alpha']:.2f} and ḡ = {r['guesses_per_pass']:.2f} at this shape's "
             "measured v and c; only its checkpoint can time it end to end" + (
                 f"; a prompt that repeats itself is said to give lookup ≥ {LOOKUP_CONTEXT}×"
                 if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA else "")) for r in rows]


def explain(cost: dict, rows: list[dict]) -> list[str]:
    """How far verification is free on the shape and why not further; the pair's worst fit to S at its own costs,
    beside S at v = 1, and its tokens per pass against the formula's; each draft's best γ, and its S at the shape."""
    v, pass_s, matmul_s = cost["ratio"], cost["seconds"]["pass"], cost["seconds"]["matmuls"]
    free = max(k for k in v if all(v[j] < FREE_LINE for j in v if j <= k))
    extra, extra_mm = pass_s[PREMISE_K] - pass_s[1], matmul_s[PREMISE_K] - matmul_s[1]
    cause = ("the matrix kernel, slower on more rows though it reads the same weights" if extra_mm >= extra / 2
             else "mostly outside them (attention, the k rows of logits, per-operation overhead)")
    notes = [f"on the shape a pass stays under {FREE_LINE}× a step up to k = {free}; at k = {PREMISE_K} it costs "
             f"{v[PREMISE_K]:.2f}×" + (f", {ms(extra)} more than a step, {extra_mm / extra:.0%} of that in the matrix "
                                       f"products alone: {cause}" if extra > 0 else "") + f". No draft, however "
             f"cheap and right, beats {(LOOKUP_GAMMA + 1) / v[LOOKUP_GAMMA + 1]:.2f}× there at γ = {LOOKUP_GAMMA}: "
             "(γ + 1) ÷ the pass's cost"]
    w = max(rows, key=lambda r: abs(r["speedup"] / r["modelled"] - 1))
    off = {k: f"{w['speedup'] / w[k] - 1:+.0%}" for k in ("predicted", "modelled")}
    notes.append(f"worst fit: {w['draft']} at γ = {w['gamma']}, {w['speedup']:.2f}× against S = {w['modelled']:.2f}× "
                 f"({off['modelled']}) at the pair's own costs (c = {w['c']:.3f}, {w['guesses_per_pass']:.2f} guesses "
                 f"per pass, ℓ = {w['loop']:.2f}, ℓ₀ = {w['loop_alone']:.2f}); with each pass priced at one step, "
                 f"{w['predicted']:.2f}× ({off['predicted']}), and at γ guesses {w['leviathan_at_gamma']:.2f}×; "
                 + per_pass(w))
    for name in dict.fromkeys(r["draft"] for r in rows):
        b = max((r for r in rows if r["draft"] == name), key=lambda r: r["speedup"])
        pays = PAYS[Check("speedup", b["speedups"], 1.0, ">=").outcome()]
        notes.append(f"{name}: best γ = {b['gamma']}, {b['speedup']:.2f}× (α = {b['alpha']:.2f}, c = {b['c']:.3f}; "
                     f"{b['tokens_per_pass']:.2f} tokens per pass, the most it could give were verification and "
                     f"drafting free); {per_pass(b)}; speculation {pays} for this pair on this device; at the shape's "
                     f"costs S = {b['at_shape']:.2f}×")
    return notes


def per_pass(r: dict) -> str:
    """The run's tokens per pass against (1 − α^(ḡ+1)) / (1 − α), which S takes; below it, why."""
    made, formula = r["tokens_per_pass"], r["formula_tokens_per_pass"]
    return f"it made {made:.2f} tokens per pass where the formula fed α = {r['alpha']:.2f} expects {formula:.2f}" + (
        ": its guesses are not accepted independently of each other (a first miss ends rounds more often than α "
        "says), so S overestimates what it makes" if made < formula / (1 + FIT) else "")


def plot(lesson, f: dict, gammas: list[int], verdict) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.4))
    sh, pair, rows = f["shape"], f["verification"], f["sweep"]
    v, rounds, ks = sh["ratio"], sh["rounds"], list(sh["ratio"])
    ax.errorbar(ks, list(v.values()), yerr=[[v[k] - min(rounds[k]) for k in ks], [max(rounds[k]) - v[k] for k in ks]],
                capsize=3, fmt="o-", label=f"{f['model']}'s shape: a pass, logits at all k (bars: range)")
    ax.plot(ks, list(sh["matmul_ratio"].values()), "s--", label="its matrix products alone")
    ax.plot(ks, [sh["predicted_ratio"][k] for k in ks], "x:", color="C0", ms=9, label="the pass model's prediction")
    ax.fill_between([PREMISE_K - 0.3, PREMISE_K + 0.3], *([b] * 2 for b in sh["premise_band"]), color="grey",
                    alpha=0.3, label=f"its band at k = {PREMISE_K}: {sh['premise_band'][0]:.2f}–{sh['premise_band'][1]:.2f}")
    ax.plot(ks, [pair["ratio"][k] for k in ks], "^-", color="C2", label="the pair (small, host-bound): a pass")
    ax.set(xlabel="new tokens k in one pass", ylabel="time ÷ a one-token step", title=f"verification cost after "
           f"{sh['context']} cached tokens (the pair: {pair['context']})\n(medians of {len(rounds[ks[0]])} rounds)",
           ylim=(0, max(sh["premise_band"][1], *v.values(), *pair["ratio"].values()) * 1.3))
    names, n = list(dict.fromkeys(r["draft"] for r in rows)), len(rows[0]["speedups"])
    ranges = lambda mine: [[r["speedup"] - r["low"] for r in mine], [r["high"] - r["speedup"] for r in mine]]  # noqa
    series = (("speedup", "the pair, measured"), ("modelled", "the pair's S at its own costs"),
              ("at_shape", f"S at {f['model']}'s shape's costs"))
    if len(gammas) > 1:  # a sweep: measured, and the two S beside it (offset so no marker hides another)
        for name, color in zip(names, ("C0", "C1")):
            mine = [r for r in rows if r["draft"] == name]
            gs = [r["gamma"] for r in mine]
            bx.errorbar(gs, [r["speedup"] for r in mine], yerr=ranges(mine), capsize=3, fmt="o-", color=color,
                        label=f"{name}, α = {statistics.median(r['alpha'] for r in mine):.2f}: {series[0][1]} (bars: range)")
            for (key, label), x, fmt in zip(series[1:], (1.06, 1 / 1.06), ("x--", "s:")):
                bx.plot([g * x for g in gs], [r[key] for r in mine], fmt, color=color, label=f"{name}: {label}",
                        **({"ms": 9} if key == "modelled" else {"mfc": "none"}))
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
    bx.axhline(LOOKUP_CONTEXT, color="C3", ls=":", lw=1, label=f"context: lookup is said to give ≥ {LOOKUP_CONTEXT}×")
    bx.set(ylabel="speedup over the target alone (decode phase)",
           ylim=(0, max(LOOKUP_CONTEXT, *(max(r["high"], r["modelled"], r["at_shape"]) for r in rows)) * 1.15))
    ticks_at(ax, ks)
    for a in (ax, bx):
        a.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    save_plot(lesson, fig, verdict)


def predict_costs(lesson, target: GPT2, s: dict) -> dict:
    """Before timing anything: the pass lengths k to time and, for the --model's shape and for the pair, the cached
    context, t₁ and the pass model's cost of each pass in steps; the premise's band and c of the shape's draft as
    the share of the weights a step reads (lookup reads none), printed."""
    ks = sorted({1, PREMISE_K, *s["ks"], *(g + 1 for g in s["gammas"])})
    p, blocks, peak = {}, max(1, lesson.config.n_layer // 4), lesson.ceilings.matmul_flops
    for who, model in (("shape", lesson.model), ("verification", target)):
        cfg, t1 = model.config, fixed_cost(model)
        context = min(CONTEXT, cfg.n_ctx - max(ks))
        v = lambda k, rate: verify_ratio(cfg, k, context, t1, rate, lesson.dtype)  # noqa: E731
        p[who] = {"context": context, "fixed_s": t1, "predicted_ratio": {k: v(k, peak) for k in ks},
                  "premise_band": band(v(PREMISE_K, peak), v(PREMISE_K, peak * RATE_FLOOR))}
    sh, cfg = p["shape"], lesson.config
    one, five = (step_cost(cfg, [k], [sh["context"]], lesson.dtype, lm_head_rows=k) for k in (1, PREMISE_K))
    part = step_cost(cfg.with_(n_layer=blocks), [1], [sh["context"]], lesson.dtype).weight_bytes / one.weight_bytes
    sh.update(blocks=blocks, c_predicted={"model draft": part, "prompt lookup": 0.0})
    premise, (lo, hi) = sh["predicted_ratio"][PREMISE_K], sh["premise_band"]
    predict(lesson, f"on {lesson.args.model}'s shape ({lesson.model.weights_source}: a pass's time does not depend on "
            f"the values) a pass over {PREMISE_K} new tokens after {sh['context']} cached reads the same "
            f"{si(one.weight_bytes, 'B')} of weights as a one-token step and does {five.flops / one.flops:.1f}× its "
            f"FLOPs, at {five.intensity:.1f} FLOP/B; with t₁ = {ms(sh['fixed_s'])} (a one-token request's TTFT) and "
            f"the FLOPs at the measured peak it costs {premise:.2f} steps (band {lo:.2f}–{hi:.2f}: prefill at "
            f"{RATE_FLOOR:.0%} to 100% of the peak, t₁ off by 1.5×); a draft of its first {blocks} blocks reads "
            f"{part:.0%} of the weights a step reads",
            f"the pair's own pass over {PREMISE_K}, by the same model (t₁ = {ms(p['verification']['fixed_s'])}): "
            f"{p['verification']['predicted_ratio'][PREMISE_K]:.2f} steps. Speculation pays its tokens per pass, "
            "(1 − α^(ḡ+1)) / (1 − α) for ḡ guesses per pass, ÷ what a pass costs in target-alone steps, (ḡc + v + ℓ) "
            "÷ (1 + ℓ₀); on the pair, measured ÷ that S at its own measured costs (ℓ, ℓ₀ clocked before the judged "
            f"rounds) lies in {FIT_BAND[0]:.2f}–{FIT_BAND[1]:.2f}",
            expect={**({"premise_low": premise} if lo > 1 else {}), "premise_high": premise, "fit_low": 1.0,
                    "fit_high": 1.0, "lookup": 1.0})
    return {"ks": ks, **p}


def measure_costs(lesson, model: GPT2, draft: GPT2, p: dict, s: dict, ks: list[int], desc: str):
    """Each pass, its matrix products, a draft step, a lookup, in turns till the premise clears its band's ends."""
    in_band = lambda r: [Check(end, summarise_costs(r, ks)["rounds"][PREMISE_K], b, op)  # noqa: E731
                         for end, b, op in zip(("low", "high"), p["premise_band"], (">=", "<="))]
    costs = interleave(cost_fns(model, draft, ks, p["context"], LOOKUP_GAMMA), s["cost_repeats"],
                       device=lesson.device, desc=desc, until=settled(in_band))
    return {**summarise_costs(costs, ks), **p}, costs


def measure_speculation(lesson, target: GPT2, draft: GPT2, prompt: list[int], f: dict, s: dict):
    """The target alone against each draft at each γ, greedy, in turns: (one row per draft and γ, rounds)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], ignore_eos=True)
    drafts = {"model draft": draft, "prompt lookup": NgramProposer()}
    runs = {"target alone": (None, 0), **{f"{n} γ={g}": (d, g) for n, d in drafts.items() for g in s["gammas"]}}
    fns = {key: timed(target, d, prompt, greedy, g, s["generations"]) for key, (d, g) in runs.items()}
    clocked = {key: timed(target, d, prompt, greedy, g, s["generations"], clock=True)() for key, (d, g) in runs.items()}
    rows_of = lambda r: [sweep_row(n, g, r.results("target alone"), r.results(f"{n} γ={g}"),  # noqa: E731
                                   (clocked["target alone"], clocked[f"{n} γ={g}"]), f["verification"], f["shape"])
                         for n in drafts for g in s["gammas"]]
    on_pair = lambda r: [c for c in checks({**f, "sweep": rows_of(r)}) if not c.key.startswith("premise")]  # noqa
    rounds = interleave(fns, s["repeats"], warmup=0, device=lesson.device,   # the runs before warmed the model up
                        desc="speculation sweep, in turns", until=settled(on_pair))
    rows = rows_of(rounds)
    per_token = ms(statistics.median(b.decode_s / b.decode_tokens for b in rounds.results("target alone")))
    print_table(["draft", "γ", "α", "guesses/pass ḡ", "tokens/pass", "formula", "ℓ", "speedup", "range", "S(v = 1)",
                 "S(own costs)", "S(shape)"],
                [[r["draft"], r["gamma"], f"{r['alpha']:.2f}", f"{r['guesses_per_pass']:.2f}",
                  f"{r['tokens_per_pass']:.2f}", f"{r['formula_tokens_per_pass']:.2f}", f"{r['loop']:.2f}",
                  f"{r['speedup']:.2f}×",
                  f"{r['low']:.2f}–{r['high']:.2f}", f"{r['predicted']:.2f}×", f"{r['modelled']:.2f}×",
                  f"{r['at_shape']:.2f}×"] for r in rows],
                f"the pair, greedy, a {len(prompt)}-token prompt that repeats itself, {s['max_tokens']} new tokens, "
                f"{rounds.count} rounds; the target alone: {per_token} per token")
    return rows, rounds


def judge_claim(lesson, f: dict, rounds: list):
    """The checks, each explained by the run's own numbers, the facts, and the notes the run's numbers say."""
    checks_ = checks(f)
    verdict = judge(f"on {f['model']}'s shape, verifying {PREMISE_K} tokens costs what the pass model predicts, "
                    "about one decode step; on a trained pair, the speedup follows Leviathan's formula in α and the "
                    "guesses made, priced at the pair's own costs and loop work (measured ÷ S "
                    f"{FIT_BAND[0]:.2f}–{FIT_BAND[1]:.2f}), prompt lookup's too", checks_, lesson.load(), rounds,
                    facts=facts(f))
    told = {c.why for c in checks_ if c.outcome() == NOT_SUPPORTED}  # printed as the why of their check
    verdict.notes += [n for n in dict.fromkeys(explain(f["shape"], f["sweep"])) if n not in told] + [
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
    p = predict_costs(lesson, target, s)
    shape, shape_rounds = measure_costs(lesson, lesson.model, shallow_draft(lesson.model, p["shape"]["blocks"]),
                                        p["shape"], s, p["ks"], f"{args.model}'s shape: verification cost, in turns")
    own, own_rounds = measure_costs(lesson, target, draft, p["verification"], s, p["ks"],
                                    "the pair: verification cost, in turns")
    figures = {"model": args.model, "shape": shape, "verification": own, "target": target.weights_source, "pair": pair,
               "draft": draft.weights_source, "prompt_len": len(prompt), "alpha_sampled": alpha_sampled,
               "max_tokens": s["max_tokens"], "fit_band": FIT_BAND}
    figures["sweep"], rounds = measure_speculation(lesson, target, draft, prompt, figures, s)
    verdict = judge_claim(lesson, figures, [shape_rounds, own_rounds, rounds])
    plot(lesson, figures, s["gammas"], verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
