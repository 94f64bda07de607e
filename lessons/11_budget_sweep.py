"""Lesson 11: the token budget. What does a budget above 2048 buy?

The claim
---------
Chunked prefill (lesson 10) fills every step up to `max_num_batched_tokens`
tokens. The budget is a trade-off: small → steady ITL but more, smaller steps
(each reads every weight again, and small matmuls use the hardware poorly);
large → fewer, fuller steps, and a long prompt may again hold the decodes up.
vLLM introduced chunked prefill with a default budget of 512 ("the best ITL on
A100 in the initial benchmark (llama 70B and mixtral 8x22B)") and its guide
(Performance and Tuning, "Chunked Prefill", docs/source/models/performance.rst)
says: "We recommend you set `max_num_batched_tokens > 2048` for throughput",
with no figure. This course's seed quoted "~50% more throughput"; no vLLM
source gives that number, so it is printed as the seed's claim, for context.

What the cost model says: a budget changes how the same tokens are cut into
steps, not how many FLOPs they take. Each step costs its roofline time,
max(bytes / bandwidth, FLOPs / peak) (`roofline.py`, `cost.py`); a larger budget
saves the weight reads of the steps it removes, which matters only while a
step is memory-bound (left of the ridge). The lesson plays the scheduler's
plan for the trace (`plan_steps`: the same policies, on token counts) at each
budget, sums the roofline over the steps, and predicts the gain. It leaves out
each step's fixed cost (the host's work, per-op launches: lesson 03), which a
larger budget also saves, so the claim judged is that the larger budget gains
at least 0.8× the predicted ratio (`BAND`); a larger budget that made the run
slower than predicted by a fifth would be past it.

What this lesson measures
-------------------------
A mixed trace: N requests with seeded log-normal lengths (prompt median a
quarter of the context, short outputs, so prefill dominates the work and the
budget matters), arriving as a seeded Poisson process and replayed in real
time (a request joins at the first step boundary after its arrival; its TTFT
counts from its arrival, queueing included). The arrival rate (8/s on a CPU)
is several times what the CPU serves, so the queue stays full and tokens/s
measures capacity. --quick sends its requests at once, 3 tokens out each,
enough of them for three budgets of 512 of prompt: the budgets have room to
differ (the steps at 512 ÷ the steps at 4096 is printed: the most a budget
could gain were a step's cost all fixed). The KV pool holds the whole trace,
so no run preempts and the budget is the only variable.

`max_num_batched_tokens` ∈ {256, 512, 1024, 2048, 4096} with chunking (512 and
4096 with --quick), and 2048 without it (vLLM's budget without chunking,
max(max_model_len, 2048)). Every configuration runs once per round, in turns,
five rounds. We report generated tokens/s, TTFT p50/p99 and ITL p50/p99, and
why the ITL tails differ (all requests at once: lesson 10's stutter turned
round, printed as a `why`).

Predict before you run: how much can a budget above 2048 gain on a CPU, whose
ridge point (lesson 02) is a few FLOP per byte, against a GPU, whose ridge is
hundreds?
"""
from __future__ import annotations

import dataclasses
import statistics

from common import make_parser, ms, plt, predict, print_table, run, save_plot, start, ticks_at, write_results
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict
from minillm.bench.cost import step_cost
from minillm.bench.replay import replay
from minillm.bench.workloads import describe_trace, lognormal_trace, pool_blocks

from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig

NAME = "11_budget_sweep"
SEED_GAIN = 0.50         # the seed's "~50% more throughput", no source: printed, not judged
BAND = 0.8               # measured gain at least this × the predicted one
LARGE, OLD_DEFAULT = 4096, 512
UNCHUNKED_BUDGET = 2048  # vLLM without chunking: max(max_model_len, 2048)
MAX_NUM_SEQS = 256       # vLLM's default cap on running sequences
LARGE_NAME, OLD_NAME, UNCHUNKED_NAME = f"chunked {LARGE}", f"chunked {OLD_DEFAULT}", f"unchunked {UNCHUNKED_BUDGET}"
med = statistics.median


def serve(model, trace, budget: int, chunked: bool):
    """A function that replays the trace once with this budget; returns the replay's summary and its steps' shape."""
    blocks = pool_blocks(trace)

    def once():
        engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=min(MAX_NUM_SEQS, budget),
                                                  enable_chunked_prefill=chunked),
                           cache_config=CacheConfig(num_gpu_blocks_override=blocks))
        summary = replay(engine, trace).summary()
        prefill = [s for s in engine.timeline if s.num_prefill_tokens]
        decode_only = [s.duration for s in engine.timeline if not s.num_prefill_tokens]
        return {**summary, "prefill_steps": len(prefill),
                "prefill_step_s": med(s.duration for s in prefill) if prefill else 0.0,
                "prefill_beside_decodes": sum(1 for s in prefill if s.num_decode_tokens),
                "decode_step_s": med(decode_only) if decode_only else 0.0}
    return once


def plan_steps(prompts: list[int], outputs: list[int], budget: int, chunked: bool) -> list[tuple[list, list, int]]:
    """The scheduler's plan for requests all queued at once with room for all, on token counts: decode-first
    chunks (`chunked_prefill.py`) or prefill-first whole prompts (`scheduler.py`). Per step: each row's new and
    cached tokens, and the rows that sample."""
    n, cap = len(prompts), min(MAX_NUM_SEQS, budget)
    computed, made, waiting, running, steps = [0] * n, [0] * n, list(range(n)), [], []
    while running or waiting:
        rows, left = [], budget  # (request, new tokens)
        if chunked:
            rows = [(i, 1) for i in running if computed[i] == prompts[i]]  # decodes first
            left -= len(rows)
            for i in (i for i in running if computed[i] < prompts[i]):
                rows.append((i, min(prompts[i] - computed[i], left)))
                left -= rows[-1][1]
        while waiting and len(running) < cap and (min(prompts[waiting[0]], left) if chunked else
                                                   prompts[waiting[0]] <= left and left):
            running.append(waiting.pop(0))
            rows.append((running[-1], min(prompts[running[-1]], left)))
            left -= rows[-1][1]
        if not chunked and not rows:
            rows = [(i, 1) for i in running]
        if not rows:
            raise ValueError(f"a prompt of {prompts[waiting[0]]} tokens never fits budget {budget}")
        rows = [(i, k) for i, k in rows if k > 0]
        steps.append(([k for _, k in rows], [computed[i] + max(0, made[i] - 1) for i, _ in rows],
                      sum(computed[i] == prompts[i] or computed[i] + k == prompts[i] for i, k in rows)))
        for i, k in rows:
            made[i] += computed[i] == prompts[i] or computed[i] + k == prompts[i]
            computed[i] = min(prompts[i], computed[i] + k)
        running = [i for i in running if made[i] < outputs[i]]
    return steps


def planned_seconds(config, dtype, ceilings, steps) -> float:
    """The plan's time on the roofline: each step's bytes at the bandwidth or its FLOPs at the peak."""
    return sum(max(c.bytes / ceilings.bandwidth, c.flops / ceilings.matmul_flops)
               for c in (step_cost(config, new, cached, dtype, lm_head_rows=rows) for new, cached, rows in steps))


def sizes(n_ctx: int, quick: bool, on_gpu: bool) -> dict:
    if quick:  # three budgets of 512 of prompt, at once, 3 tokens out each: the budgets have room to differ
        return {"requests": -(-3 * OLD_DEFAULT // (n_ctx // 4)), "rate": None, "prompt_median": n_ctx / 4,
                "output_median": 3, "fixed_output": 3, "budgets": [OLD_DEFAULT, LARGE], "repeats": 5}
    return {"requests": 64 if on_gpu else 12, "rate": 200.0 if on_gpu else 8.0, "prompt_median": n_ctx / 4,
            "output_median": 16, "budgets": [256, 512, 1024, 2048, 4096], "repeats": 5}


def predict_gain(lesson, trace, configs: dict) -> dict:
    """Every configuration's plan and its time on the roofline; the predicted gain of LARGE over OLD_DEFAULT."""
    prompts, outputs = [len(r.prompt) for r in trace], [r.max_tokens for r in trace]
    plans = {name: plan_steps(prompts, outputs, b, c) for name, (b, c) in configs.items()}
    secs = {name: planned_seconds(lesson.config, lesson.dtype, lesson.ceilings, p) for name, p in plans.items()}
    gain, room = secs[OLD_NAME] / secs[LARGE_NAME], len(plans[OLD_NAME]) / len(plans[LARGE_NAME])
    predict(lesson, f"{len(trace)} requests, {sum(prompts):,} prompt tokens: at budget {OLD_DEFAULT} the plan runs "
            f"{len(plans[OLD_NAME])} steps, {ms(secs[OLD_NAME])} on the roofline, at {LARGE} {len(plans[LARGE_NAME])} "
            f"steps, {ms(secs[LARGE_NAME])}: tokens/s should grow {gain:.2f}× (the seed said ~{1 + SEED_GAIN:g}×); "
            f"{BAND}× that is the claim's line. Were a step's cost all fixed, the gain would be the steps' ratio, "
            f"{room:.2f}×", expect={"gain": gain})
    return {"predicted_gain": gain, "planned_steps": {n: len(p) for n, p in plans.items()}, "planned_s": secs,
            "steps_ratio": room}


def checks(figures: dict) -> list[Check]:
    """Per round: tokens/s at the large budget ÷ at the old default, against the predicted gain × BAND."""
    a, b = figures["configs"][LARGE_NAME]["runs"], figures["configs"][OLD_NAME]["runs"]
    pred = figures["predicted_gain"]

    def where(runs, name):
        m = lambda key: med(r[key] for r in runs)  # noqa: E731
        return (f"{name}: {m('steps'):.0f} steps ({figures['planned_steps'][name]} planned) of "
                f"{m('mean_tokens_per_step'):.0f} tokens in {m('seconds'):.2f} s ({ms(m('seconds') / m('steps'))} a step)")
    return [Check(f"tokens/s at budget {LARGE} ÷ at {OLD_DEFAULT}, chunked",
                  [x["throughput"] / y["throughput"] for x, y in zip(a, b)], BAND * pred, ">=", fmt="{:.2f}",
                  predicted=pred, key="gain",
                  why=f"where the time went: {where(a, LARGE_NAME)}; {where(b, OLD_NAME)}: the larger budget's fewer "
                      "steps did not save what their roofline time predicts")]


def facts(figures: dict) -> list[Fact]:
    return [Fact(f"steps at {OLD_DEFAULT} ÷ steps at {LARGE} (the most a budget could gain, were a step's cost all "
                 "fixed)", figures["steps_ratio"], fmt="{:.2f}", why="the plan's count, set by the trace, not measured")]


def itl_why(figures: dict) -> str:
    """Why the ITL tails differ between chunked and unchunked, from the runs' steps."""
    c, u = figures["configs"][OLD_NAME]["runs"], figures["configs"][UNCHUNKED_NAME]["runs"]
    m = lambda runs, key: med(r[key] for r in runs)  # noqa: E731
    steps = lambda n: f"{n:.0f} step{'s' * (n != 1)}"  # noqa: E731
    waits = ("the wait lands in TTFT" if m(u, "prefill_steps") <= 1 else
             "the streams started by the first of them wait the later ones between two tokens, the rest wait in TTFT")
    return (f"why ITL p99 is {m(c, 'itl_p99_s') / m(u, 'itl_p99_s'):.1f}× chunked ({OLD_DEFAULT}) what it is "
            f"unchunked: every request is queued at t = 0, so unchunked prefills whole prompts in steps of their "
            f"own ({steps(m(u, 'prefill_steps'))}; median {ms(m(u, 'prefill_step_s'))}) before any decode resumes: "
            f"{waits} (p99 {ms(m(u, 'ttft_p99_s'))}), and its other gaps are decode-only steps "
            f"({ms(m(u, 'decode_step_s'))}; ITL p50 {ms(m(u, 'itl_p50_s'))}, p99 {ms(m(u, 'itl_p99_s'))}); chunked lets "
            f"the first prompts stream while later ones are still cut into chunks, so steps carry a chunk beside "
            f"running decodes ({steps(m(c, 'prefill_beside_decodes'))}; median {ms(m(c, 'prefill_step_s'))}), and "
            f"a stream's token waits that long (ITL p99 {ms(m(c, 'itl_p99_s'))}, TTFT p99 {ms(m(c, 'ttft_p99_s'))}). "
            "Lesson 10 is the other case: one long prompt arriving while streams run, whose one step chunking splits")


def measure(lesson, s: dict, trace: list, configs: dict, stats: dict, p: dict):
    """The trace replayed at every budget, in turns, until the check is decided; a table of their medians."""
    serve(lesson.model, trace[:2], 512, True)()  # warm-up, untimed
    fig_of = lambda r: {**p, "configs": {n: {"runs": r.results(n)} for n in configs}}  # noqa: E731
    rounds = interleave({name: serve(lesson.model, trace, *c) for name, c in configs.items()}, s["repeats"],
                        warmup=0, device=lesson.device, desc="budgets, in turns",
                        until=lambda r: all(c.outcome() != "INCONCLUSIVE" for c in checks(fig_of(r))))
    points = {name: rounds.results(name) for name in configs}
    m = lambda name, key: med(p[key] for p in points[name])  # noqa: E731
    arrivals = f"Poisson {s['rate']:g}/s" if s["rate"] else "all at t = 0"
    print_table(["budget", "chunked", "tokens/s", "range", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "steps",
                 "planned", "tokens/step"],
                [[b, "yes" if c else "no", f"{m(n, 'throughput'):.1f}",
                  f"{min(p['throughput'] for p in points[n]):.1f}–{max(p['throughput'] for p in points[n]):.1f}",
                  ms(m(n, "ttft_p50_s")), ms(m(n, "ttft_p99_s")), ms(m(n, "itl_p50_s")), ms(m(n, "itl_p99_s")),
                  points[n][0]["steps"], p["planned_steps"][n], f"{points[n][0]['mean_tokens_per_step']:.0f}"]
                 for n, (b, c) in configs.items()],
                f"{stats['requests']} requests, {arrivals}, prompt mean {stats['prompt_mean']:.0f}, output "
                f"mean {stats['output_mean']:.0f} (medians of {rounds.count} rounds; steps: round 1):")
    return rounds, points


def judge_claim(lesson, figures: dict, rounds):
    m = lambda name, key: med(p[key] for p in figures["configs"][name]["runs"])  # noqa: E731
    verdict = judge(f"a budget above 2048 ({LARGE}) gains over {OLD_DEFAULT} what the roofline predicts for the steps "
                    f"it saves: at least {BAND}× the predicted gain", checks(figures), lesson.load(), [rounds],
                    facts=facts(figures))
    verdict.notes.append(f"context: the seed's ~{SEED_GAIN:.0%} (no source; vLLM's tuning guide recommends > 2048 for "
                         f"throughput, with no figure): this run {verdict.checks[0].median - 1:+.0%}; against "
                         f"{UNCHUNKED_NAME} (vLLM without chunking) "
                         f"{m(LARGE_NAME, 'throughput') / m(UNCHUNKED_NAME, 'throughput'):.2f}×")
    verdict.notes.append(itl_why(figures))
    print_verdict(verdict)
    return verdict


def plot(lesson, configs: dict, figures: dict, count: int, verdict) -> None:
    points = {n: c["runs"] for n, c in figures["configs"].items()}
    m = lambda name, key: med(p[key] for p in points[name])  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    chunked = [n for n, (_, c) in configs.items() if c]
    xs, xu = [configs[n][0] for n in chunked], configs[UNCHUNKED_NAME][0]
    for ax, key, label in ((axes[0], "throughput", "generated tokens/s"), (axes[1], "ttft", "TTFT (ms)"),
                           (axes[2], "itl", "ITL (ms)")):
        series = [(key, "", 1)] if key == "throughput" else [(f"{key}_p50_s", " p50", 1e3), (f"{key}_p99_s", " p99", 1e3)]
        for (k, suffix, scale), color in zip(series, ("C0", "C1")):
            mid = [m(n, k) * scale for n in chunked]
            ax.errorbar(xs, mid, capsize=3, fmt="o-", color=color, label=f"chunked{suffix}",
                        yerr=[[v - min(p[k] for p in points[n]) * scale for v, n in zip(mid, chunked)],
                              [max(p[k] for p in points[n]) * scale - v for v, n in zip(mid, chunked)]])
            ax.plot(xu, m(UNCHUNKED_NAME, k) * scale, "s", color=color, mfc="none", label=f"unchunked{suffix}")
        ax.axvspan(2048, max(xs + [xu]) * 1.3, color="grey", alpha=0.12,
                   label="budgets > 2048" if key == "throughput" else None)
        ax.set_xscale("log", base=2)
        ticks_at(ax, xs + [xu])
        ax.set(xlabel="max_num_batched_tokens", ylabel=label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room above the highest marker
    check = verdict.checks[0]
    line = check.line * m(OLD_NAME, "throughput")
    axes[0].axhline(line, color="k", ls=":", label=f"the claim's line: {BAND}× predicted gain × budget {OLD_DEFAULT}")
    axes[0].set_ylim(0, max(axes[0].get_ylim()[1], 1.25 * line))
    for ax in axes:  # below the axes: never over the data
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[0].set_title(f"throughput: {LARGE} ÷ {OLD_DEFAULT} round by round {check.median:.2f}× (predicted "
                      f"{check.predicted:.2f}×)\n(points: medians of {count} rounds; bars: range)")
    axes[1].set_title("time to first token")
    axes[2].set_title("inter-token latency (why: in the verdict)")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    cfg = lesson.config
    s = sizes(cfg.n_ctx, args.quick, lesson.device.type == "cuda")
    trace = lognormal_trace(s["requests"], cfg.n_ctx, cfg.vocab_size, s["prompt_median"], s["output_median"],
                            sigma=0.6, seed=0, rate=s["rate"])
    if s.get("fixed_output"):  # no long output's tail of decode-only steps to cap the gain
        trace = [dataclasses.replace(r, max_tokens=s["fixed_output"]) for r in trace]
    stats = describe_trace(trace)
    configs = {f"chunked {b}": (b, True) for b in s["budgets"]}
    configs[UNCHUNKED_NAME] = (max(UNCHUNKED_BUDGET, stats["longest"]), False)
    p = predict_gain(lesson, trace, configs)
    rounds, points = measure(lesson, s, trace, configs, stats, p)
    figures = {"trace": {**stats, "rate_per_s": s["rate"], "prompt_median": s["prompt_median"],
                         "output_median": s["output_median"], "sigma": 0.6, "seed": 0}, **p,
               "configs": {n: {"budget": b, "chunked": c, "runs": points[n]} for n, (b, c) in configs.items()},
               "seed_gain": SEED_GAIN}
    verdict = judge_claim(lesson, figures, rounds)
    plot(lesson, configs, figures, rounds.count, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
