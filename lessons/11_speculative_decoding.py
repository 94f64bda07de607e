"""Lesson 11: speculative decoding. Does checking γ guesses in one target pass pay, as Leviathan's formula says?

The claim
---------
A decode step is memory-bound (lessons 01 and 04): it reads every weight to
make one token. A pass over k tokens reads the same weights, so checking k
tokens should cost about one step. A cheap draft guesses γ tokens, the target
checks them all in one pass and keeps the prefix it agrees with plus one token
of its own (`minillm/speculative.py`). With acceptance rate α and a draft step
costing c target steps, Leviathan et al. predict the speedup

    S(α, γ, c) = (1 − α^(γ+1)) / ((1 − α) · (γc + 1))

counting the verification pass as one step. vLLM also ships prompt lookup, a
draft with c ≈ 0: it proposes what followed the last n tokens earlier in the
text. The claim, in three lines: a pass over 5 new tokens costs at most 1.3× a
one-token step (the premise); the measured speedup is within 15% of S for every
γ and draft; prompt lookup at γ = 4 (fixed beforehand) on a prompt that repeats
itself is at least 1.5× faster than the target alone.

What this lesson measures
-------------------------
1. The premise: the target's pass over k new tokens after 256 cached ones (k
   from 1 to 16, and every γ + 1), logits at all k as verification needs,
   against k = 1; beside it the same pass's matrix products alone on k rows, to
   tell the matrix kernel from the rest. In the same rounds: a draft step and a
   lookup, for c.
2. Two drafts. The model draft is the target's first quarter of blocks with its
   embeddings, ln_f and head (`--draft NAME` picks a model instead): it shares
   the target's weights, so it costs no memory, and is as cheap as a draft of
   its depth can be. Prompt lookup (n-grams of 1..3).
3. The prompt repeats itself: a passage, the target's own greedy continuation
   of it, then the passage again, so a model that copies from its context (as
   real checkpoints do) writes the continuation again, and lookup proposes it.
   Whether this target does is what α measures. Random-init weights say nothing
   about a real checkpoint's α: the verdict names the weights; a draft as cheap
   that always agreed (α = 1) bounds the best case, plotted from the measured costs.
4. The sweep: greedy decoding with the target alone (`kv_cache.generate`) and
   with each draft for γ = 1..8 (2 and 4 with --quick, a shorter prompt), in
   turns, three rounds (two with --quick). Only the decode phase is timed (the
   prefill is the same target pass either way). Per γ: α, tokens per target
   pass against (1 − α^(γ+1)) / (1 − α), the speedup, and S fed the measured α
   and c. A second prediction charges the measured cost of the γ + 1 pass in
   place of the "1": where S misses, it shows how much of the miss is the premise.

Predict before you run: a pass over 5 tokens reads the weights once; what share
of a step's time is not reading weights, on this CPU? If verification cost
2× a step, what is the best speedup any draft could give at γ = 4?
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import make_parser, ms, plt, print_table, quiet_load_model, run, save_plot, start, ticks_at, write_results
from measure import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, Check, interleave, judge, print_verdict

from minillm.kv_cache import KVCache, Segment, generate
from minillm.model import GPT2, Conv1D
from minillm.sampling import SamplingParams
from minillm.speculative import NgramProposer, SpecDecodingStats, SpeculativeDecoder, expected_tokens_per_pass

NAME = "11_speculative_decoding"
CONTEXT = 256                      # cached tokens before the measured passes
PREMISE_K, PREMISE_LINE = 5, 1.3   # a pass over 5 new tokens costs at most 1.3× a one-token step
FREE_LINE = 1.2                    # the verdict also says up to which k a pass stays under 1.2×
FIT = 0.15                         # measured speedup within ±15% of the formula
LOOKUP_GAMMA, LOOKUP_LINE = 4, 1.5


def sizes(quick: bool) -> dict:
    if quick:
        return {"gammas": [2, 4], "passage": 24, "quoted": 16, "max_tokens": 16, "repeats": 2, "ks": [1, 3, 5]}
    return {"gammas": list(range(1, 9)), "passage": 80, "quoted": 32, "max_tokens": 48, "repeats": 3,
            "ks": list(range(1, 10)) + [16]}


def shallow_draft(target: GPT2, n_layer: int) -> GPT2:
    """The target's first n_layer blocks, its embeddings, ln_f and tied head: a draft sharing (not copying) them."""
    with torch.device("meta"):
        draft = GPT2(target.config.with_(n_layer=n_layer), seed=None)
    draft.wte, draft.wpe, draft.ln_f, draft.h = target.wte, target.wpe, target.ln_f, nn.ModuleList(target.h[:n_layer])
    draft.weights_source = f"the target's first {n_layer} of {target.config.n_layer} blocks"
    return draft.eval()


def quoting_prompt(target: GPT2, passage: int, quoted: int, seed: int = 0) -> list[int]:
    """A passage, the target's greedy continuation of it, and the passage again."""
    text = torch.randint(0, target.config.vocab_size, (passage,), generator=torch.Generator().manual_seed(seed)).tolist()
    return text + generate(target, [text], SamplingParams(temperature=0.0, max_tokens=quoted, ignore_eos=True))[0] + text


def cost_fns(target: GPT2, draft: GPT2, ks: list[int], context: int) -> dict:
    """Target passes over k new tokens after `context` cached ones (logits at all k), their matrix products alone,
    a draft step and a lookup. Time does not depend on the cached values, so the caches are declared filled."""
    cfg, device = target.config, target.device
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (context + max(ks),), generator=g).tolist()
    ids = torch.tensor([tokens[context:]], device=device)

    def forward(model: GPT2, k: int):
        cache = KVCache(model.config, 1, context + k, device, model.dtype)
        return torch.inference_mode()(lambda: model(ids[:, :k], cache.prepare([Segment(0, context, k)]).positions,
                                                    cache=cache, logits_indices=torch.arange(k, device=device)))

    def matmuls(k: int):
        layers = [m for m in target.modules() if isinstance(m, Conv1D)]
        xs = {n: torch.randn(k, n, generator=g).to(device, target.dtype) for n in {m.weight.shape[0] for m in layers}}
        return torch.inference_mode()(lambda: [m(xs[m.weight.shape[0]]) for m in layers]
                                      + [F.linear(xs[cfg.n_embd], target.wte.weight)])   # and the LM head

    lookup = NgramProposer()   # random tokens: no match, the whole sequence scanned, its worst case
    return {**{f"pass {k}": forward(target, k) for k in ks}, **{f"matmuls {k}": matmuls(k) for k in ks},
            "draft step": forward(draft, 1),
            "lookup": lambda: lookup.propose(tokens[:context], LOOKUP_GAMMA, SamplingParams(temperature=0.0), None)}


class Run(NamedTuple):
    tokens: list[int]
    decode_s: float                  # the decode phase: after the first token (the prefill), to the last
    decode_tokens: int               # tokens made in it
    stats: SpecDecodingStats | None


def baseline(target: GPT2, prompt: list[int], params: SamplingParams):
    def once() -> Run:
        marks = []   # on_step fires after the prefill, then after every decode step
        out = generate(target, [prompt], params, on_step=lambda *_: marks.append(time.perf_counter()))[0]
        return Run(out, marks[-1] - marks[0], len(out) - 1, None)
    return once


def speculate(target: GPT2, draft, prompt: list[int], params: SamplingParams, gamma: int):
    def once() -> Run:
        decoder = SpeculativeDecoder(target, draft, prompt, params, gamma)
        first = len(decoder.step())   # the prefill round (the target's prefill pass and the draft's), untimed
        t0 = time.perf_counter()
        while decoder.finish_reason is None:
            decoder.step()
        return Run(decoder.output, time.perf_counter() - t0, len(decoder.output) - first, decoder.stats)
    return once


def sweep_row(name: str, gamma: int, base: list[Run], runs: list[Run], c: float, verify: dict[int, float]) -> dict:
    """One draft at one γ: α, tokens per pass, speedup per round (seconds per token, target alone ÷ speculative),
    Leviathan's S from the measured α and c, and S charging the measured cost of the γ + 1 pass."""
    stats = runs[0].stats   # greedy: every round made the same tokens, so the same counts
    alpha, per_pass = stats.alpha, expected_tokens_per_pass(stats.alpha, gamma)
    speedups = [(b.decode_s / b.decode_tokens) / (r.decode_s / r.decode_tokens) for b, r in zip(base, runs)]
    predicted = per_pass / (gamma * c + 1)
    return {"draft": name, "gamma": gamma, "alpha": alpha, "c": c, "speedups": speedups,
            "speedup": statistics.median(speedups), "low": min(speedups), "high": max(speedups),
            "tokens_per_pass": len(runs[0].tokens) / stats.num_target_passes, "formula_tokens_per_pass": per_pass,
            "guesses_per_pass": stats.num_draft_tokens / stats.num_target_passes, "predicted": predicted,
            "fit": [x / predicted for x in speedups], "predicted_v": per_pass / (gamma * c + verify[gamma + 1]),
            "ceiling": (gamma + 1) / verify[gamma + 1]}


def summarise_costs(costs, ks: list[int]) -> dict:
    """The cost rounds as the lesson reads them: each pass ÷ the one-token step round by round, medians, and c."""
    rounds = {k: costs.ratio(f"pass {k}", "pass 1") for k in ks}
    return {"rounds": rounds, "ratio": {k: statistics.median(r) for k, r in rounds.items()},
            "matmul_ratio": {k: statistics.median(costs.ratio(f"matmuls {k}", "matmuls 1")) for k in ks},
            "pass_s": {k: costs.median(f"pass {k}") for k in ks}, "matmul_s": {k: costs.median(f"matmuls {k}") for k in ks},
            "c": {"model draft": statistics.median(costs.ratio("draft step", "pass 1")),
                  "prompt lookup": statistics.median(costs.ratio("lookup", "pass 1"))}}


def make_checks(cost: dict, rows: list[dict]) -> list[Check]:
    """The premise round by round; measured ÷ predicted speedup per round, the lowest and the highest over every
    draft and γ; prompt lookup's speedup at γ = 4 per round."""
    fits = list(zip(*(r["fit"] for r in rows)))
    lookup = next(r for r in rows if r["draft"] == "prompt lookup" and r["gamma"] == LOOKUP_GAMMA)
    return [Check(f"a pass over {PREMISE_K} new tokens ÷ a one-token step", cost["rounds"][PREMISE_K], PREMISE_LINE,
                  "<=", fmt="{:.2f}"),
            Check("measured ÷ predicted speedup, lowest of every γ and draft", [min(f) for f in fits], 1 - FIT, ">=",
                  fmt="{:.2f}"),
            Check("measured ÷ predicted speedup, highest", [max(f) for f in fits], 1 + FIT, "<=", fmt="{:.2f}"),
            Check(f"prompt-lookup speedup at γ = {LOOKUP_GAMMA}", lookup["speedups"], LOOKUP_LINE, ">=", fmt="{:.2f}")]


def explain(cost: dict, rows: list[dict], share: float | None) -> list[str]:
    """The reading of the numbers: how far verification is free and what its cost is made of, the worst fit and
    its cause, and the best γ per draft (paying only if its whole spread, widened by the load, is above 1)."""
    v, pass_s, matmul_s = cost["ratio"], cost["pass_s"], cost["matmul_s"]
    free = max(k for k in v if all(v[j] < FREE_LINE for j in v if j <= k))
    extra, extra_mm = pass_s[PREMISE_K] - pass_s[1], matmul_s[PREMISE_K] - matmul_s[1]
    notes = [f"a pass stays under {FREE_LINE}× a step up to k = {free} (the roofline keeps it memory-bound, one "
             f"weight read, up to k ≈ {cost['k_ridge']:.0f}); at k = {PREMISE_K} it costs {v[PREMISE_K]:.2f}×"
             + (f": {ms(extra)} more than a step, {extra_mm / extra:.0%} of that in the matrix products alone, so "
                + ("mostly the matrix kernel, slower per weight on a few rows than on one" if extra_mm >= extra / 2 else
                   "mostly outside the matrix products (attention, the k rows of logits, per-operation overhead)")
                if extra > 0 else ""),
             f"so no draft, however cheap and right, could beat (γ + 1) ÷ pass cost = "
             f"{(LOOKUP_GAMMA + 1) / v[LOOKUP_GAMMA + 1]:.2f}× at γ = {LOOKUP_GAMMA}"]
    w = max(rows, key=lambda r: abs(r["speedup"] / r["predicted"] - 1))
    notes.append(f"worst fit: {w['draft']} at γ = {w['gamma']}, {w['speedup']:.2f}× measured against "
                 f"{w['predicted']:.2f}× predicted ({w['speedup'] / w['predicted'] - 1:+.0%}); charging the measured "
                 f"cost of its {w['gamma'] + 1}-token pass ({v[w['gamma'] + 1]:.2f}× a step) predicts "
                 f"{w['predicted_v']:.2f}× ({w['speedup'] / w['predicted_v'] - 1:+.0%})"
                 + (f"; it proposed {w['guesses_per_pass']:.2f} guesses per pass, not γ = {w['gamma']}"
                    if w["guesses_per_pass"] < 0.95 * w["gamma"] else ""))
    for name in dict.fromkeys(r["draft"] for r in rows):
        b = max((r for r in rows if r["draft"] == name), key=lambda r: r["speedup"])
        pays = {HOLDS: "pays", NOT_SUPPORTED: "does not pay", INCONCLUSIVE: "may or may not pay (spread too wide)"}[
            Check("speedup", b["speedups"], 1.0, ">=").outcome(share)]
        notes.append(f"{name}: best γ = {b['gamma']}, {b['speedup']:.2f}× (α = {b['alpha']:.2f}, c = {b['c']:.3f}); "
                     f"speculation {pays} for this pair on this device")
    return notes


def plot(lesson, cost: dict, rows: list[dict], gammas: list[int]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    ks, v, rounds, k_ridge = list(cost["ratio"]), cost["ratio"], cost["rounds"], cost["k_ridge"]
    axes[0].errorbar(ks, [v[k] for k in ks], yerr=[[v[k] - min(rounds[k]) for k in ks], [max(rounds[k]) - v[k] for k in ks]],
                     capsize=3, fmt="o-", label="target pass, logits at all k (range)")
    axes[0].plot(ks, [cost["matmul_ratio"][k] for k in ks], "s--", label="its matrix products alone")
    axes[0].plot(ks, [max(1.0, k / k_ridge) for k in ks], "k:", label=f"roofline (memory-bound to k ≈ {k_ridge:.0f})")
    axes[0].plot([PREMISE_K], [PREMISE_LINE], "v", color="C3", label=f"the claim: ≤ {PREMISE_LINE}× at k = {PREMISE_K}")
    axes[0].set(xlabel="new tokens k in one pass", ylabel="time ÷ one-token step", title="verification cost",
                ylim=(0, max(max(r) for r in [*rounds.values(), cost["matmul_ratio"].values()]) * 1.1))
    ticks_at(axes[0], ks)
    for name, color in zip(dict.fromkeys(r["draft"] for r in rows), ("C0", "C1")):
        mine = [r for r in rows if r["draft"] == name]
        gs = [r["gamma"] for r in mine]
        axes[1].errorbar(gs, [r["speedup"] for r in mine], capsize=3, fmt="o-", color=color, label=f"{name}: measured",
                         yerr=[[r["speedup"] - r["low"] for r in mine], [r["high"] - r["speedup"] for r in mine]])
        axes[1].plot(gs, [r["predicted"] for r in mine], "--", color=color, label=f"{name}: S (measured α, c)")
        axes[1].plot(gs, [r["predicted_v"] for r in mine], ":", color=color, label=f"{name}: S, pass cost charged")
        axes[2].plot(gs, [r["tokens_per_pass"] for r in mine], "o-", color=color, label=f"{name}: measured")
        axes[2].plot(gs, [r["formula_tokens_per_pass"] for r in mine], "--", color=color,
                     label=f"{name}: (1 − α^(γ+1)) / (1 − α), α = {statistics.median(r['alpha'] for r in mine):.2f}")
    axes[1].plot(gammas, [(g + 1) / v[g + 1] for g in gammas], color="grey", lw=0.8, label="α = 1, c = 0: (γ + 1) ÷ pass cost")
    axes[1].axhline(1, color="black", lw=0.6)
    axes[1].set(ylabel="speedup over the target alone (decode phase)", title="speedup vs γ (bars: range over rounds)",
                ylim=(0, max(max(r["high"], r["predicted"], (r["gamma"] + 1) / v[r["gamma"] + 1]) for r in rows) * 1.1))
    axes[2].set(ylabel="tokens per target pass", title="tokens per target pass", ylim=(0, max(gammas) + 1.5))
    for ax in axes:
        if ax is not axes[0]:
            ax.set_xlabel("γ, guesses per round")
            ticks_at(ax, gammas)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
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
    ks = sorted(set(s["ks"]) | {g + 1 for g in s["gammas"]} | {1, PREMISE_K})
    context = min(CONTEXT, cfg.n_ctx - max(ks))
    costs = interleave(cost_fns(target, draft, ks, context), 5 if args.quick else 7, device=lesson.device,
                       desc="verification cost, in turns")
    cost = {**summarise_costs(costs, ks), "context": context,
            "k_ridge": lesson.ceilings.ridge * lesson.dtype.itemsize / 2}   # 2k FLOPs per weight read
    v, c = cost["ratio"], cost["c"]
    print_table(["new tokens k", "pass ÷ 1-token step", "range", "matrix products alone ÷ 1 row"],
                [[k, f"{v[k]:.2f}", f"{min(cost['rounds'][k]):.2f}–{max(cost['rounds'][k]):.2f}",
                  f"{cost['matmul_ratio'][k]:.2f}"] for k in ks],
                f"one target pass after {context} cached tokens ({ms(cost['pass_s'][1])} for k = 1); "
                f"c = {c['model draft']:.3f} (model draft), {c['prompt lookup']:.4f} (lookup)")

    prompt = quoting_prompt(target, s["passage"], s["quoted"])
    greedy = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], ignore_eos=True)
    drafts = {"model draft": draft, "prompt lookup": NgramProposer()}
    fns = {"target alone": baseline(target, prompt, greedy)}
    fns.update({f"{n} γ={g}": speculate(target, d, prompt, greedy, g) for n, d in drafts.items() for g in s["gammas"]})
    fns["target alone"]()   # warm-up, untimed
    rounds = interleave(fns, s["repeats"], warmup=0, device=lesson.device, desc="speculation sweep, in turns")
    base, rows = rounds.results("target alone"), []
    for name, g in ((name, g) for name in drafts for g in s["gammas"]):
        runs = rounds.results(f"{name} γ={g}")
        if any(r.tokens != base[0].tokens for r in runs):
            raise RuntimeError(f"{name} at γ = {g} gave tokens other than the target's own greedy ones: a bug in "
                               "minillm/speculative.py (its tests say where)")
        rows.append(sweep_row(name, g, base, runs, c[name], v))
    print_table(["draft", "γ", "α", "tokens/pass", "formula", "guesses/pass", "speedup", "range", "predicted S",
                 "S, pass cost charged"],
                [[r["draft"], r["gamma"], f"{r['alpha']:.2f}", f"{r['tokens_per_pass']:.2f}",
                  f"{r['formula_tokens_per_pass']:.2f}", f"{r['guesses_per_pass']:.2f}", f"{r['speedup']:.2f}×",
                  f"{r['low']:.2f}–{r['high']:.2f}", f"{r['predicted']:.2f}×", f"{r['predicted_v']:.2f}×"] for r in rows],
                f"greedy, a {len(prompt)}-token prompt that repeats itself, {s['max_tokens']} new tokens, the decode phase "
                f"timed, {s['repeats']} rounds; target alone {ms(statistics.median(b.decode_s / b.decode_tokens for b in base))}"
                " per token")

    sampled = SamplingParams(temperature=1.0, max_tokens=s["max_tokens"], ignore_eos=True, seed=0)
    alpha_sampled = {n: speculate(target, d, prompt, sampled, LOOKUP_GAMMA)().stats.alpha for n, d in drafts.items()}
    load = lesson.load()
    verdict = judge(f"verifying γ + 1 tokens costs about one decode step ({PREMISE_K} tokens ≤ {PREMISE_LINE}×), so "
                    f"the speedup follows Leviathan's formula within {FIT:.0%}, and prompt lookup on a prompt that repeats "
                    f"itself gives ≥ {LOOKUP_LINE}×", make_checks(cost, rows), load)
    verdict.notes += explain(cost, rows, load.share) + [
        f"α was measured on {target.weights_source} weights (draft: {draft.weights_source}) and says nothing about a "
        f"real checkpoint's α; the cost curve holds for any weights. With sampling (temperature 1, Leviathan's rule) "
        f"at γ = {LOOKUP_GAMMA}, α = " + ", ".join(f"{a:.2f} ({n})" for n, a in alpha_sampled.items())]
    print_verdict(verdict)
    plot(lesson, cost, rows, s["gammas"])
    figures = {"verification": cost, "draft": draft.weights_source, "prompt_len": len(prompt),
               "max_tokens": s["max_tokens"], "sweep": rows, "alpha_sampled": alpha_sampled,
               "baseline_rounds": [{"decode_s": b.decode_s, "decode_tokens": b.decode_tokens} for b in base]}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
