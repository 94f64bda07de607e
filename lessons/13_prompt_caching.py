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

SGLang reports "up to 5×" on such workloads. The claim judged here, with S = 768
shared tokens and U = 32 of each request's own (gpt2's shape): a hit's TTFT is
at least 5× lower, a workload of requests sharing that system prompt gets at
least 2× the throughput, and on traffic that shares nothing, caching (hashing
every block, looking every prompt up) keeps throughput within 3% of caching off.

That last line is a small difference between two noisy runs: two runs of the
same work on a CPU differ by more than 3% (docs/lessons_notes.md), so their
ratio cannot tell 3% from 0 in any number of rounds a lesson can afford. But
the control computes the same tokens in the same forward passes either way
(the lesson checks that); all caching adds is host work, between the passes.
So the line is judged on the host's time alone: each run's makespan less its
forward passes and sampling (`bench.replay.serve`'s `host_s`), which puts both
runs on the same forward time, and the raw ratio is shown beside it.

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
                skip 768 of their 800 prompt tokens, so if prefill is most of the
                time the 2× line is within reach. Before measuring, the lesson
                bounds the gain from the cost model and the measured ceilings:
                each prefill at the measured peak, each decode step at its bytes
                over the measured bandwidth.
    control     2 requests of 416 distinct tokens at once, answers of 32: nothing to share.
    turns       2 conversations of 3 turns (128 tokens, then 64 a turn), each resending the
                history: served once each way, shown (hit rate, prefill saved), not judged.

Sizes scale with the context (gpt2's above); --quick keeps the proportions that decide each line, so the
same lines apply: the sweep at S ∈ {96, 384} with U = 16 (again (S + U) / U = 25 at the checked point);
`shared` of 6 requests with a 96-token system prompt, 4 tokens of each request's own and 4-token answers
(prompt ÷ answer = 25, as in the full run); the control of 100-token prompts; turns of 32 then 8 tokens.
The sweep, shared and control runs go in turns, caching off and on, five rounds (--quick too), the sweep's
apart from the workloads' so that rounds one line still needs do not re-run the other; every ratio is
taken within a round. Five is the fewest rounds whose range holds the median of the rounds' ratios with ≥
90% probability (1 − 2/2⁵ = 94%): two rounds, whose range holds it only half the time, let a line within
the noise be decided either way. On a CPU the model runs on one thread: on shared cores, a second thread
would make each small step wait, and a round's runs would differ more than caching does.

The verdict: per round, the checked TTFT off ÷ on ≥ 5, shared throughput on ÷ off ≥ 2, control
throughput on ÷ off with the forward time set equal (off's makespan ÷ (off's makespan + on's host
time − off's)) ≥ 0.97. Where a line is missed, the lesson computes why from the run: the share of
the uncached run's time spent in steps that prefill, and the share of prefill tokens caching
saved, bound the throughput gain at 1 / (1 − share · saved) even if saved tokens cost nothing.

Predict before you run: a gpt2 prefill of 800 tokens costs about as much as
how many decode steps? With 32-token answers, what throughput gain can caching
the first 768 prompt tokens buy at most?
"""
from __future__ import annotations

import contextlib
import statistics

from common import (make_parser, ms, one_thread, plt, predict, print_table, run, save_plot, start, ticks_at,
                    write_results)
from minillm.bench.caching import BLOCK_SIZE, caching_bound, gains, runner, same_forward_gains, throughput_bound
from minillm.bench.cost import decode_cost, prefill_cost
from minillm.bench.verdict import Check, interleave, judge, print_verdict, settled
from minillm.bench.workloads import multi_turn_workload, no_sharing_workload, shared_prefix_workload, ttft_sweep

NAME = "13_prompt_caching"
TTFT_LINE = 5.0        # SGLang's "up to 5×", on the TTFT of a hit
THROUGHPUT_LINE = 2.0  # the shared-prompt workload's throughput, on ÷ off
CONTROL_LINE = 0.97    # nothing shared: within 3% of caching off
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


def make_checks(s: dict, ttft_speedups: list[float], shared_gains: list[float], control_gains: list[float]) -> list[Check]:
    """The claim's three lines, one value per round: TTFT off ÷ on of the checked hit, throughput on ÷ off of the
    shared workload and of the control."""
    return [Check(f"TTFT off ÷ on, a hit on {s['sweep'][-1]} shared + {s['sweep_suffix']} own tokens", ttft_speedups,
                  TTFT_LINE, ">=", fmt="{:.2f}"),
            Check(f"throughput on ÷ off, {s['requests']} requests sharing {s['prefix']} tokens", shared_gains,
                  THROUGHPUT_LINE, ">=", fmt="{:.2f}"),
            Check("throughput on ÷ off, the control (nothing shared), the same forward time", control_gains,
                  CONTROL_LINE, ">=", fmt="{:.3f}")]


def predicted_bound(cfg, s: dict, ceilings, dtype) -> dict:
    """The throughput bound before measuring: n prefills of P = prefix + suffix tokens at the measured peak, and
    `answer` decode steps of the n sequences at their bytes over the measured bandwidth; caching saves the full blocks
    of the prefix for all but the first request."""
    n, P = s["requests"], s["prefix"] + s["suffix"]
    prefill = n * prefill_cost(cfg, P, 1, dtype).flops / ceilings.matmul_flops
    decode = s["answer"] * decode_cost(cfg, P, n, dtype).bytes / ceilings.bandwidth
    saved = (n - 1) * (s["prefix"] // BLOCK_SIZE * BLOCK_SIZE) / (n * P)
    return caching_bound(prefill, decode, saved) | {"prefill_s": prefill, "decode_s": decode}


def explain(checks: list[Check], bound: dict, s: dict, ttft: dict, raw_control: list[float]) -> list[str]:
    """The lesson's reading of its numbers: why each line was met or missed, from what this run measured.
    `ttft` holds the sweep's median TTFTs, caching "off" and "on", one per shared length; `raw_control` the
    control's throughput on ÷ off as measured, one per round."""
    ttft_check, gain, control = checks
    (S, U), (on, off) = (s["sweep"], s["sweep_suffix"]), (ttft["on"], ttft["off"])
    notes = [f"TTFT: a hit at S = {S[-1]} computes {U} of {S[-1] + U} prompt tokens, an ideal "
             f"{(S[-1] + U) / U:.0f}× by tokens; measured {ttft_check.median:.1f}×. A hit took {ms(on[-1])} at "
             f"S = {S[-1]}, and already {ms(on[0])} ({on[0] / on[-1]:.0%} of it) at S = {S[0]}: that part is the cost "
             f"of any forward pass over {U} tokens, and "
             + (f"the other {ms(on[-1] - on[0])} grows with the cached keys attended over" if on[-1] > on[0]
                else "it does not grow with S here") + f"; uncached, {ms(off[0])} and {ms(off[-1])}"]
    reach = "cannot reach" if bound["bound"] < THROUGHPUT_LINE else "leaves room for"
    notes.append(f"throughput: without caching, steps that prefill took {bound['prefill_share']:.0%} of the shared "
                 f"workload's time and decode-only steps {1 - bound['prefill_share']:.0%}; caching computed "
                 f"{bound['tokens_saved']:.0%} fewer prefill tokens, so even if their time fell to zero the run "
                 f"could be at most {bound['bound']:.2f}× faster, which {reach} the {THROUGHPUT_LINE:g}× line "
                 f"(measured {gain.median:.2f}×). Decode is untouched: shorter answers would raise the bound, "
                 "longer ones lower it")
    lo, hi = min(raw_control), max(raw_control)
    notes.append(f"control: both runs computed every prompt token in the same forward passes, so caching's cost is "
                 f"the host time it adds (hashing every full block, looking every prompt up): with the forward time "
                 f"set equal, throughput on ÷ off {control.median:.3f}. The raw ratio of the two runs, "
                 f"{statistics.median(raw_control):.3f} ({lo:.3f}–{hi:.3f} over the rounds), is mostly the "
                 "machine's noise: two runs of the same work differ by more than the 3% the line is about")
    return notes


def predict_gains(lesson, s: dict) -> dict:
    """A hit's TTFT gain by tokens, and the throughput bound of the shared workload from the ceilings."""
    pb = predicted_bound(lesson.config, s, lesson.ceilings, lesson.dtype)
    predict(lesson, f"a hit at S = {s['sweep'][-1]} computes {s['sweep_suffix']} of its "
            f"{s['sweep'][-1] + s['sweep_suffix']} prompt tokens: an ideal {(s['sweep'][-1] + s['sweep_suffix']) / s['sweep_suffix']:.0f}× "
            f"by tokens, less once a pass's fixed costs count",
            f"shared workload: {s['requests']} prefills of {s['prefix'] + s['suffix']} tokens take about "
            f"{ms(pb['prefill_s'])} at the measured peak and {s['answer']} decode steps {ms(pb['decode_s'])} at "
            f"the measured bandwidth: prefill is {pb['prefill_share']:.0%} of the time, caching saves "
            f"{pb['tokens_saved']:.0%} of the prefill tokens, so throughput can gain at most "
            f"{pb['bound']:.2f}× ({'the' if pb['bound'] >= THROUGHPUT_LINE else 'not even the'} "
            f"{THROUGHPUT_LINE:g}× line is reachable in principle)")
    return pb


def speedups(r) -> list[float]:
    """The checked hit's TTFT off ÷ on, one per round of the sweep."""
    off, on = ([run["records"][-1]["ttft_s"] for run in r.results(f"sweep {c}")] for c in ("off", "on"))
    return [a / b for a, b in zip(off, on)]


def checks_of(sweep, loads, s: dict) -> list[Check]:
    """The three checks, from the sweep's rounds and the throughput workloads' rounds (timed apart: see measure)."""
    return make_checks(s, speedups(sweep), gains(loads, "shared"), same_forward_gains(loads, "control"))


def measure(lesson, s: dict):
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
                           until=settled(lambda r: make_checks(s, speedups(r), [THROUGHPUT_LINE], [1.0])[:1]))
        rounds = interleave({n: f for n, f in fns.items() if not n.startswith("sweep")}, s["repeats"], warmup=0,
                            device=lesson.device, desc="workloads, caching off and on, in turns",
                            until=settled(lambda r: make_checks(s, [TTFT_LINE], gains(r, "shared"),
                                                                same_forward_gains(r, "control"))[1:]))
        runs = {name: r.results(name) for r in (sweep, rounds) for name in r.names}
        if any(a["prefill_tokens_computed"] != b["prefill_tokens_computed"]
               for a, b in zip(runs["control off"], runs["control on"])):
            raise RuntimeError("the control shared prompt tokens: its line assumes the same forward work either way")
        for c in ("off", "on"):  # shown, not judged: one run each way
            runs[f"turns {c}"] = [runner(model, work["turns"], c == "on")()]
    med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731

    def row(w: str, c: str) -> list:  # times: medians of the rounds; counts: the same in every round
        name, counts = f"{w} {c}", runs[f"{w} {c}"][0]
        return [w, c, ms(med(name, "ttft_p50_s")), ms(med(name, "ttft_p90_s")),
                ms(med(name, "hit_ttft_p50_s")) if counts["hit_rate"] else "-", f"{med(name, 'throughput'):.1f}",
                ms(med(name, "host_s")),
                counts["prefill_tokens_computed"], counts["prompt_tokens"], f"{counts['hit_rate']:.0%}",
                counts["peak_blocks_in_use"]]

    print_table(["workload", "caching", "TTFT p50", "TTFT p90", "hit TTFT p50", "tokens/s", "host", "prefilled", "of prompt",
                 "hit rate", "peak blocks"], [row(w, c) for w in ("shared", "turns", "control") for c in ("off", "on")],
                f"medians of {rounds.count} rounds (turns: one run each way); host = the run's time outside forward passes "
                "and sampling; prefilled = prompt tokens computed:")
    sweep_rows = {c: [[r["ttft_s"] for r in run["records"][c == "on":]] for run in runs[f"sweep {c}"]]
                  for c in ("off", "on")}
    ttft = {c: [statistics.median(col) for col in zip(*sweep_rows[c])] for c in ("off", "on")}
    print_table(["shared tokens S", "own tokens U", "TTFT off", "TTFT on", "off ÷ on", "cached"],
                [[p, s["sweep_suffix"], ms(ttft["off"][i]), ms(ttft["on"][i]),
                  f"{ttft['off'][i] / ttft['on'][i]:.1f}×",
                  runs["sweep on"][0]["records"][i + 1]["cached_tokens"]] for i, p in enumerate(s["sweep"])],
                f"one request at a time, after one that filled the cache (medians of {sweep.count} rounds):")
    return {"rounds": rounds, "sweep_rounds": sweep, "runs": runs, "sweep_rows": sweep_rows, "ttft": ttft}


def judge_claim(lesson, s: dict, m: dict):
    """The three checks, each with its reading of the numbers; the throughput bound measured round by round."""
    runs, checks = m["runs"], checks_of(m["sweep_rounds"], m["rounds"], s)
    verdict = judge(f"prefix caching cuts a hit's TTFT at least {TTFT_LINE:g}× (SGLang: up to 5×), at least doubles "
                    "the throughput of requests sharing a system prompt, and costs under 3% when nothing is shared",
                    checks, lesson.load(), [m["sweep_rounds"], m["rounds"]])
    bounds = [throughput_bound(off, on) for off, on in zip(runs["shared off"], runs["shared on"])]
    bound = {k: statistics.median(b[k] for b in bounds) for k in bounds[0]}
    for check, why in zip(checks, explain(checks, bound, s, m["ttft"], gains(m["rounds"], "control"))):  # one reading per line, printed either way
        check.why = why
        verdict.notes += [] if check.outcome() == "NOT SUPPORTED" else [why]
    print_verdict(verdict)
    return verdict, bound, bounds


def plot(lesson, s: dict, m: dict, pb: dict, bound: dict, verdict) -> float:
    """The figure; returns the conversations' throughput on ÷ off, drawn (and saved) beside the judged ratios."""
    runs, ttft, sweep_rows, checks, count = m["runs"], m["ttft"], m["sweep_rows"], verdict.checks, m["rounds"].count
    med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    ax = axes[0]
    for c, color in (("off", "C3"), ("on", "C0")):
        cols = list(zip(*sweep_rows[c]))
        mid = [1e3 * m for m in ttft[c]]
        ax.errorbar(s["sweep"], mid, fmt="o-", color=color, capsize=3, label=f"caching {c}",
                    yerr=[[m - 1e3 * min(col) for m, col in zip(mid, cols)],
                          [1e3 * max(col) - m for m, col in zip(mid, cols)]])
    ax.plot(s["sweep"], [1e3 * t / TTFT_LINE for t in ttft["off"]], "k:",
            label=f"the claim's line: caching off ÷ {TTFT_LINE:g} (judged at S = {s['sweep'][-1]})")
    ax.set(xlabel=f"shared-prefix length S (tokens; each request adds {s['sweep_suffix']} of its own)",
           ylabel="TTFT (ms), one request at a time", ylim=(0, None), xlim=(0, None),
           title=f"TTFT of a hit ({checks[0].median:.2f}× lower at S = {s['sweep'][-1]})\n"
                 f"(medians of {m['sweep_rounds'].count} rounds; bars: range)")
    ticks_at(ax, [0] + s["sweep"])
    ax = axes[1]
    names = ["shared", "turns", "control"]
    for j, (c, color) in enumerate((("off", "C3"), ("on", "C0"))):
        mid = [med(f"{w} {c}", "throughput") for w in names]
        ax.bar([i + 0.4 * j - 0.2 for i in range(3)], mid, 0.4, color=color, label=f"caching {c}",
               yerr=[[m - min(r["throughput"] for r in runs[f"{w} {c}"]) for m, w in zip(mid, names)],
                     [max(r["throughput"] for r in runs[f"{w} {c}"]) - m for m, w in zip(mid, names)]], capsize=3)
    on_off = {"shared": checks[1].median, "control": checks[2].median,
              "turns": med("turns on", "throughput") / med("turns off", "throughput")}
    for i, (w, line) in enumerate((("shared", THROUGHPUT_LINE), ("control", CONTROL_LINE))):
        x = names.index(w) + 0.2
        ax.plot([x - 0.2, x + 0.2], [line * med(f"{w} off", "throughput")] * 2, "k:", lw=2,
                label="the claim's line: caching off × 2 (shared), × 0.97 (control)" if i == 0 else None)
    ax.set_xticks(range(3), [f"{w}{' (one run)' * (w == 'turns')}\non ÷ off {on_off[w]:.2f}×"
                             + "\n(the same forward time)" * (w == "control") for w in names])
    ax.set(ylabel="generated tokens/s", title=f"throughput by workload\n(medians of {count} rounds; bars: range)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax = axes[2]
    for j, c in enumerate(("off", "on")):
        pre, dec = med(f"shared {c}", "prefill_steps_s"), med(f"shared {c}", "decode_steps_s")
        ax.bar(j, pre, 0.6, color="C1", label="steps that prefill" if j == 0 else None)
        ax.bar(j, dec, 0.6, bottom=pre, color="C2", label="decode-only steps" if j == 0 else None)
    ax.set(xticks=[0, 1], xticklabels=["caching off", "caching on"], ylabel="seconds of engine steps, shared workload",
           title=f"where the time went (medians)\ncaching prefill can gain ≤ {bound['bound']:.2f}× "
                 f"(predicted: ≤ {pb['bound']:.2f}×)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    for ax in axes:  # below the axes: never over the data
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    save_plot(lesson, fig, verdict)
    return on_off["turns"]


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    pb = predict_gains(lesson, s)
    m = measure(lesson, s)
    verdict, bound, bounds = judge_claim(lesson, s, m)
    on_off_turns = plot(lesson, s, m, pb, bound, verdict)
    figures = {"sizes": s, "ttft_sweep": {"prefixes": s["sweep"], "ttft_off_s": m["ttft"]["off"],
                                          "ttft_on_s": m["ttft"]["on"]},
               "throughput_bound": bound, "per_round_bounds": bounds, "predicted_bound": pb,
               "on_off_turns": on_off_turns, "claim": {"ttft_line": TTFT_LINE, "throughput_line": THROUGHPUT_LINE,
                                                       "control_cost_limit": 1 - CONTROL_LINE},
               "runs": {name: [{k: v for k, v in r.items() if k != "records"} for r in rs]
                        for name, rs in m["runs"].items()}}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
