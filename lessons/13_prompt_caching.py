"""Lesson 13: prompt caching. A request that starts like an earlier one skips the prefill of what they share.

The claim
---------
Real traffic repeats itself: every chat request carries the same system
prompt, every turn of a conversation resends the history before it. With
`enable_prefix_caching=True` (`minillm/prefix_caching.py`) the engine keeps
each full KV block under the hash of its whole prefix, and a new request
takes the blocks it shares instead of computing them again. Prefill is
compute-bound and its work grows with the tokens computed (lesson 02), so

    TTFT of a hit  ≈ t(prefill of the uncached suffix)       ideal gain (S + U) / U
    throughput     gains only as much as the work was prefill: decode is untouched

How much lower, before measuring: a pass costs a fixed part t₁ (the TTFT of a
one-token request, timed first: an engine step's host work, one read of the weights) plus
its FLOPs at the measured peak (`minillm/bench/caching.py`), so a hit's gain is
(t₁ + FLOPs(S + U)/peak) / (t₁ + FLOPs(U after S)/peak): (S + U) / U when the
prefill is all of the pass, 1 when the pass is all fixed cost. The same model
predicts the throughput gain of a workload sharing a system prompt (its decode
steps untouched). The claim judged: each gain measured ÷ predicted lies in the
band the model's own uncertainty sets: prefill runs between half the peak and
all of it (lesson 02's share), which moves the prediction from P(peak) to
P(peak/2), and t₁, timed once, may be off by 1.5× either way; so the band is
[min(P(peak), P(peak/2)) / 1.5, max(P(peak), P(peak/2)) · 1.5], in units of the
prediction at the peak. SGLang's "up to 5×" is a throughput figure for
prefix-heavy workloads (RadixAttention); it is printed beside the throughput
check as context, not as its line. On traffic that shares nothing, caching
adds only host work (hashing every full block, looking every prompt up): the
run reports that cost as a fact, not a verdict, since two runs of the same
work on a CPU differ by more than it (docs/lessons_notes.md).

What this lesson measures
-------------------------
Every run gets a fresh engine whose pool holds its whole workload (nothing is preempted:
caching is the only difference; `minillm/bench/caching.py`), greedy answers of fixed length.

    TTFT sweep  one request at a time (no queue), max_tokens 1: one request warms
                the system prompt, then one request per shared length S ∈ {96, 192,
                384, 768}, each with its own U = 32 tokens. TTFT with caching off
                and on, against S; the check is at the largest S.
    shared      8 requests at once: the 768-token system prompt, 32 tokens of their
                own, answers of 32 tokens. Throughput = generated tokens ÷ makespan.
                Prefix-heavy, as SGLang's serving figures are: 7 of 8 requests
                skip 768 of their 800 prompt tokens. Also shown: the most caching
                could gain if the saved tokens cost nothing (Amdahl's law on the
                uncached run's prefill share), from the cost model and as measured.
    control     2 requests of 416 distinct tokens at once, answers of 32: nothing to share
                (the same tokens computed either way, checked); caching's host cost, a fact.
    turns       2 conversations of 3 turns (128 tokens, then 64 a turn), each resending the
                history: served once each way, shown (hit rate, prefill saved), not judged.

Sizes scale with the context (gpt2's above); --quick keeps the proportions: the sweep at S ∈ {96, 384}
with U = 16 ((S + U) / U = 25 at the checked point, as in the full run); `shared` of 6 requests with a
96-token system prompt, 4 tokens of each request's own and 4-token answers; the control of 100-token
prompts; turns of 32 then 8 tokens. The sweep, shared and control runs go in turns, caching off and on, at
least five rounds (the fewest whose range holds their median with ≥ 90% probability), the sweep's apart from
the workloads' so that rounds one check still needs do not re-run the other; every ratio is taken within a
round. On a CPU the model runs on one thread: on shared cores a second thread makes each small step wait.

Predict before you run: a gpt2 prefill of 800 tokens costs about as much as
how many decode steps? With 32-token answers, what throughput gain can caching
the first 768 prompt tokens buy at most?
"""
from __future__ import annotations

import contextlib
import statistics

from common import make_parser, ms, one_thread, plt, predict, print_table, run, save_plot, start, ticks_at, write_results
from minillm.bench.caching import BLOCK_SIZE, gains, predictions, runner, same_forward_gains, throughput_bound
from minillm.bench.pass_cost import fixed_cost
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict, settled
from minillm.bench.workloads import multi_turn_workload, no_sharing_workload, shared_prefix_workload, ttft_sweep

NAME = "13_prompt_caching"
SGLANG = "SGLang reports up to 5× higher throughput on prefix-heavy workloads (RadixAttention)"
DECIDING_ROUNDS = 5    # the fewest rounds whose whole range is a ≥ 90% interval of their median (verdict.py)


def sizes(n_ctx: int, quick: bool) -> dict:
    """Token counts in units u = n_ctx / 32 (32 tokens for gpt2), so the tiny test model keeps the proportions."""
    u = n_ctx // 32
    if quick:  # at least a block (tiny: u = 4) so that something is shared
        return {"sweep": [max(3 * u, BLOCK_SIZE), 12 * u], "sweep_suffix": max(1, u // 2), "requests": 6,
                "prefix": max(3 * u, 2 * BLOCK_SIZE), "suffix": max(1, u // 8), "answer": max(1, u // 8),
                "control_requests": 2, "control_prompt": max(3 * u, 2 * BLOCK_SIZE) + max(1, u // 8),
                "conversations": 2, "turns": 2, "first": u, "user": max(1, u // 4), "repeats": DECIDING_ROUNDS}
    return {"sweep": [3 * u, 6 * u, 12 * u, 24 * u], "sweep_suffix": u, "requests": 8, "prefix": 24 * u, "suffix": u,
            "answer": u, "control_requests": 2, "control_prompt": 13 * u, "conversations": 2, "turns": 3,
            "first": 4 * u, "user": 2 * u, "repeats": DECIDING_ROUNDS}


def explain(f: dict) -> dict:
    """The lesson's reading of its numbers, from the figures: why each gain is where it is."""
    s, p, r, sw, b = f["sizes"], f["predicted"], f["per_round"], f["ttft_sweep"], f["throughput_bound"]
    (S, U), (on, off) = (s["sweep"], s["sweep_suffix"]), (sw["ttft_on_s"], sw["ttft_off_s"])
    ttft = (f"a hit at S = {S[-1]} computes {U} of {S[-1] + U} prompt tokens, an ideal {(S[-1] + U) / U:.0f}× by "
            f"tokens; the model predicts {p['ttft_gain']:.2f}× because every pass also pays t₁ = {ms(p['fixed_s'])} "
            f"(a one-token request's TTFT); measured {statistics.median(r['ttft_gain']):.2f}×. A hit took {ms(on[-1])} at "
            f"S = {S[-1]} and {ms(on[0])} at S = {S[0]} (predicted {ms(p['ttft_on_s'][-1])} and "
            f"{ms(p['ttft_on_s'][0])}); uncached {ms(off[0])} and {ms(off[-1])} (predicted "
            f"{ms(p['ttft_off_s'][0])} and {ms(p['ttft_off_s'][-1])})")
    shared = (f"without caching, steps that prefill took {b['prefill_share']:.0%} of the shared workload's time and "
              f"decode-only steps {1 - b['prefill_share']:.0%}; caching computed {b['tokens_saved']:.0%} fewer "
              f"prefill tokens, so even if their time fell to zero the run could be at most {b['bound']:.2f}× "
              f"faster; predicted {p['shared_gain']:.2f}×, "
              f"measured {statistics.median(r['shared_gain']):.2f}×. Decode is untouched: shorter answers raise "
              f"the gain, longer ones lower it. {SGLANG}: the same quantity, on their workloads and hardware")
    return {"ttft": ttft, "shared": shared}


def checks(figures: dict) -> list[Check]:
    """A hit's TTFT gain and the shared workload's throughput gain, one value per round, each inside the band the
    cost model allows (a check for each end), with the model's prediction at the peak."""
    f = figures
    s, p, r, why = f["sizes"], f["predicted"], f["per_round"], explain(f)
    names = {"ttft": f"TTFT off ÷ on, a hit on {s['sweep'][-1]} shared + {s['sweep_suffix']} own tokens",
             "shared": f"throughput on ÷ off, {s['requests']} requests sharing {s['prefix']} tokens"}
    return [Check(f"{names[q]}, {end} end of the model's band", r[f"{q}_gain"], p[f"{q}_band"][i], op, fmt="{:.2f}",
                  predicted=p[f"{q}_gain"], key=f"{q}_gain_{end}", why=why[q])
            for q in ("ttft", "shared") for i, (end, op) in enumerate((("low", ">="), ("high", "<=")))]


def facts(f: dict) -> list[Fact]:
    """What the run reports but cannot refute the claim with: caching's host cost on the control, the turns."""
    r = f["per_round"]
    return [Fact("caching's host cost with nothing shared: on's host time − off's, ÷ off's run",
                 statistics.median(r["control_host_share"]), fmt="{:.1%}",
                 why="both runs computed the same prompt tokens in the same passes (checked), so this is all caching "
                     f"adds; the raw throughput ratio of the two runs, {statistics.median(r['control_raw']):.3f} "
                     f"({min(r['control_raw']):.3f}–{max(r['control_raw']):.3f} over the rounds), is the machine's "
                     "noise, larger than this cost, so no line on it could be decided"),
            Fact("throughput on ÷ off, multi-turn conversations (one run each way)", f["on_off_turns"], fmt="{:.2f}")]


def in_band(values: list[float], band: list[float]) -> list[Check]:
    """Both ends of a band, for `settled`: rounds are added while either straddles its end."""
    return [Check("low end", values, band[0], ">="), Check("high end", values, band[1], "<=")]


def predict_gains(lesson, s: dict) -> dict:
    """t₁ timed (the least TTFT of 5 one-token requests), then the model's predictions."""
    with one_thread() if lesson.device.type == "cpu" else contextlib.nullcontext():
        t1 = fixed_cost(lesson.model)
    p = predictions(lesson.config, s, t1, lesson.ceilings.matmul_flops, lesson.dtype)
    S, U = s["sweep"][-1], s["sweep_suffix"]
    predict(lesson, f"a pass costs t₁ = {ms(t1)} (a one-token request's TTFT, timed) + its FLOPs at the measured peak; a hit at "
            f"S = {S} computes {U} of {S + U} prompt tokens (ideal {(S + U) / U:.0f}× by tokens): TTFT "
            f"{ms(p['ttft_off_s'][-1])} → {ms(p['ttft_on_s'][-1])}, {p['ttft_gain']:.2f}× (band "
            f"{p['ttft_band'][0]:.2f}–{p['ttft_band'][1]:.2f}×: prefill at {p['rate_floor']:.0%} to 100% of the peak, "
            f"t₁ off by {p['fixed_slack']:g}× either way)",
            f"shared workload: {s['requests']} requests, {s['prefix']} shared + {s['suffix']} own tokens, "
            f"{s['answer']} out: throughput {p['shared_gain']:.2f}× (band {p['shared_band'][0]:.2f}–"
            f"{p['shared_band'][1]:.2f}×); decode steps are untouched. {SGLANG}",
            expect={f"{q}_gain_{end}": p[f"{q}_gain"] for q in ("ttft", "shared") for end in ("low", "high")})
    return p


def speedups(r) -> list[float]:
    """The checked hit's TTFT off ÷ on, one per round of the sweep."""
    off, on = ([run["records"][-1]["ttft_s"] for run in r.results(f"sweep {c}")] for c in ("off", "on"))
    return [a / b for a, b in zip(off, on)]


def measure(lesson, s: dict, p: dict) -> dict:
    """Every workload caching off and on, in turns (the conversations once each way); their medians printed."""
    model, cfg = lesson.model, lesson.config
    work = {"sweep": ttft_sweep(s["sweep"], s["sweep_suffix"], cfg.vocab_size),
            "shared": shared_prefix_workload(s["requests"], s["prefix"], s["suffix"], s["answer"], cfg.vocab_size),
            "control": no_sharing_workload(s["control_requests"], s["control_prompt"], s["answer"], cfg.vocab_size,
                                           seed=2),
            "turns": multi_turn_workload(s["conversations"], s["turns"], s["first"], s["user"], s["answer"],
                                         cfg.vocab_size, seed=1)}
    served = {"sweep off": work["sweep"][1:], "sweep on": work["sweep"],  # uncached, no request warms anything
              **{f"{w} {c}": work[w] for w in ("shared", "control") for c in ("off", "on")}}
    fns = {name: runner(model, convs, name.endswith(" on"), 1 if name.startswith("sweep") else None)
           for name, convs in served.items()}
    with one_thread() if lesson.device.type == "cpu" else contextlib.nullcontext():
        runner(model, no_sharing_workload(2, 32, 2, cfg.vocab_size), True)()  # the first passes allocate: unshown
        # rounds of their own (the docstring says why), each adding rounds only while its own checks straddle
        sweep = interleave({n: f for n, f in fns.items() if n.startswith("sweep")}, s["repeats"], warmup=0,
                           device=lesson.device, desc="TTFT sweep, caching off and on, in turns",
                           until=settled(lambda r: in_band(speedups(r), p["ttft_band"])))
        rounds = interleave({n: f for n, f in fns.items() if not n.startswith("sweep")}, s["repeats"], warmup=0,
                            device=lesson.device, desc="workloads, caching off and on, in turns",
                            until=settled(lambda r: in_band(gains(r, "shared"), p["shared_band"])))
        runs = {name: r.results(name) for r in (sweep, rounds) for name in r.names}
        if any(a["prefill_tokens_computed"] != b["prefill_tokens_computed"]
               for a, b in zip(runs["control off"], runs["control on"])):
            raise RuntimeError("the control shared prompt tokens: its host cost assumes the same forward work")
        for c in ("off", "on"):  # shown, not judged: one run each way
            runs[f"turns {c}"] = [runner(model, work["turns"], c == "on")()]
    med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731

    def row(w: str, c: str) -> list:  # times: medians of the rounds; counts: the same in every round
        name, counts = f"{w} {c}", runs[f"{w} {c}"][0]
        return [w, c, ms(med(name, "ttft_p50_s")), ms(med(name, "ttft_p90_s")),
                ms(med(name, "hit_ttft_p50_s")) if counts["hit_rate"] else "-", f"{med(name, 'throughput'):.1f}",
                ms(med(name, "host_s")), counts["prefill_tokens_computed"], counts["prompt_tokens"],
                f"{counts['hit_rate']:.0%}", counts["peak_blocks_in_use"]]

    print_table(["workload", "caching", "TTFT p50", "TTFT p90", "hit TTFT p50", "tokens/s", "host", "prefilled",
                 "of prompt", "hit rate", "peak blocks"], [row(w, c) for w in ("shared", "turns", "control")
                                                            for c in ("off", "on")],
                f"medians of {rounds.count} rounds (turns: one run each way); host = the run's time outside forward "
                "passes and sampling; prefilled = prompt tokens computed:")
    sweep_rows = {c: [[r["ttft_s"] for r in run["records"][c == "on":]] for run in runs[f"sweep {c}"]]
                  for c in ("off", "on")}
    ttft = {c: [statistics.median(col) for col in zip(*sweep_rows[c])] for c in ("off", "on")}
    print_table(["shared tokens S", "own tokens U", "TTFT off", "predicted", "TTFT on", "predicted", "off ÷ on",
                 "cached"], [[x, s["sweep_suffix"], ms(ttft["off"][i]), ms(p["ttft_off_s"][i]), ms(ttft["on"][i]),
                              ms(p["ttft_on_s"][i]), f"{ttft['off'][i] / ttft['on'][i]:.1f}×",
                              runs["sweep on"][0]["records"][i + 1]["cached_tokens"]] for i, x in enumerate(s["sweep"])],
                f"one request at a time, after one that filled the cache (medians of {sweep.count} rounds):")
    return {"rounds": rounds, "sweep_rounds": sweep, "runs": runs, "sweep_rows": sweep_rows, "ttft": ttft}


def figures_of(s: dict, p: dict, m: dict) -> dict:
    """Every figure the checks, facts, notes and plot read: one value each."""
    runs, rounds = m["runs"], m["rounds"]
    bounds = [throughput_bound(off, on) for off, on in zip(runs["shared off"], runs["shared on"])]
    turns = runs["turns on"][0]["throughput"] / runs["turns off"][0]["throughput"]
    host = [(b["host_s"] - a["host_s"]) / a["makespan_s"] for a, b in zip(runs["control off"], runs["control on"])]
    return {"sizes": s, "predicted": p, "ttft_sweep": {"prefixes": s["sweep"], "ttft_off_s": m["ttft"]["off"],
                                                      "ttft_on_s": m["ttft"]["on"]},
            "per_round": {"ttft_gain": speedups(m["sweep_rounds"]), "shared_gain": gains(rounds, "shared"),
                          "control_raw": gains(rounds, "control"), "control_host_share": host,
                          "control_same_forward": same_forward_gains(rounds, "control")},
            "throughput_bound": {k: statistics.median(b[k] for b in bounds) for k in bounds[0]},
            "per_round_bounds": bounds, "on_off_turns": turns,
            "runs": {name: [{k: v for k, v in r.items() if k != "records"} for r in rs] for name, rs in runs.items()}}


def plot(lesson, f: dict, m: dict, verdict) -> None:
    """TTFT against S, measured and predicted; throughput by workload with the shared band; where the time went."""
    s, p, runs, sweep_rows = f["sizes"], f["predicted"], m["runs"], m["sweep_rows"]
    med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.8))
    ax = axes[0]
    for c, color in (("off", "C3"), ("on", "C0")):
        mid, cols = [1e3 * x for x in f["ttft_sweep"][f"ttft_{c}_s"]], list(zip(*sweep_rows[c]))
        ax.errorbar(s["sweep"], mid, fmt="o-", color=color, capsize=3, label=f"caching {c}: measured",
                    yerr=[[x - 1e3 * min(col) for x, col in zip(mid, cols)],
                          [1e3 * max(col) - x for x, col in zip(mid, cols)]])
        ax.plot(s["sweep"], [1e3 * x for x in p[f"ttft_{c}_s"]], "x--", color=color, alpha=0.7,
                label=f"caching {c}: predicted (t₁ + FLOPs at the peak)")
    ax.set(xlabel=f"shared-prefix length S (tokens; each request adds {s['sweep_suffix']} of its own)",
           ylabel="TTFT (ms), one request at a time", ylim=(0, None), xlim=(0, None),
           title=f"TTFT of a hit: {statistics.median(f['per_round']['ttft_gain']):.2f}× lower at S = {s['sweep'][-1]} "
                 f"(predicted {p['ttft_gain']:.2f}×)\n(medians of {m['sweep_rounds'].count} rounds; bars: range)")
    ticks_at(ax, [0] + s["sweep"])
    ax = axes[1]
    names = ["shared", "turns", "control"]
    for j, (c, color) in enumerate((("off", "C3"), ("on", "C0"))):
        mid = [med(f"{w} {c}", "throughput") for w in names]
        ax.bar([i + 0.4 * j - 0.2 for i in range(3)], mid, 0.4, color=color, label=f"caching {c}",
               yerr=[[x - min(r["throughput"] for r in runs[f"{w} {c}"]) for x, w in zip(mid, names)],
                     [max(r["throughput"] for r in runs[f"{w} {c}"]) - x for x, w in zip(mid, names)]], capsize=3)
    off = med("shared off", "throughput")
    ax.fill_between([0.0, 0.4], [p["shared_band"][0] * off] * 2, [p["shared_band"][1] * off] * 2, color="grey",
                    alpha=0.25, label=f"the model's band for caching on: off × {p['shared_band'][0]:.2f}–"
                                      f"{p['shared_band'][1]:.2f}")
    ax.plot([0.0, 0.4], [p["shared_gain"] * off] * 2, "k--", label=f"predicted: off × {p['shared_gain']:.2f}")
    on_off = {"shared": statistics.median(f["per_round"]["shared_gain"]), "turns": f["on_off_turns"],
              "control": statistics.median(f["per_round"]["control_raw"])}
    ax.set_xticks(range(3), [f"{w}{' (one run)' * (w == 'turns')}\non ÷ off {on_off[w]:.2f}×" for w in names])
    ax.set(ylabel="generated tokens/s", title=f"throughput by workload\n(medians of {m['rounds'].count} rounds and "
                                              "of their ratios; bars: range)")
    ax.set_ylim(0, max(ax.get_ylim()[1], p["shared_band"][1] * off) * 1.1)
    ax = axes[2]
    for j, c in enumerate(("off", "on")):
        pre, dec = med(f"shared {c}", "prefill_steps_s"), med(f"shared {c}", "decode_steps_s")
        ax.bar(j, pre, 0.6, color="C1", label="steps that prefill" if j == 0 else None)
        ax.bar(j, dec, 0.6, bottom=pre, color="C2", label="decode-only steps" if j == 0 else None)
    ax.set(xticks=[0, 1], xticklabels=["caching off", "caching on"], ylabel="seconds of engine steps, shared workload",
           title=f"where the time went (medians)\nso caching prefill can gain ≤ {f['throughput_bound']['bound']:.2f}×")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    for ax in axes:  # below the axes: never over the data
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1 if ax is axes[0] else 2)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    p = predict_gains(lesson, s)
    m = measure(lesson, s, p)
    f = figures_of(s, p, m)
    verdict = judge("prefix caching cuts a hit's TTFT and raises the throughput of requests sharing a system prompt "
                    "by what the prefill cost model predicts (each within the model's band)", checks(f),
                    lesson.load(), [m["sweep_rounds"], m["rounds"]], facts=facts(f))
    verdict.notes += [why for c, why in zip(checks(f)[::2], explain(f).values()) if c.outcome() != "NOT SUPPORTED"]
    print_verdict(verdict)
    plot(lesson, f, m, verdict)
    write_results(lesson, f, verdict)
    return {"figures": f, "verdict": verdict}


if __name__ == "__main__":
    run(main)
