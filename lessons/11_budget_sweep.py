"""Lesson 11: the token budget. Does a budget above 2048 buy ~50% more throughput?

The claim
---------
Chunked prefill (lesson 10) fills every step up to `max_num_batched_tokens`
tokens. The budget is a trade-off: small → steady ITL but more, smaller steps
(each reads every weight again, and small matmuls use the hardware poorly);
large → fewer, fuller steps, and a long prompt may again hold the decodes up.
vLLM introduced chunked prefill with a default budget of 512 (tuned for ITL on
an A100) and advised a budget above 2048 for throughput, which is quoted as
"~50% more throughput with max_num_batched_tokens > 2048". Whether it holds
depends on the hardware: a bigger step only helps while a smaller one leaves
the matmul units idle, i.e. while steps sit left of the ridge (lesson 02).

What this lesson measures
-------------------------
A mixed trace: N requests with seeded log-normal lengths (prompt median a
quarter of the context, short outputs, so prefill dominates the work and the
budget matters), arriving as a seeded Poisson process and replayed in real
time (a request joins at the first step boundary after its arrival; its TTFT
counts from its arrival, queueing included). The arrival rate (8/s on a CPU)
is several times what the CPU serves, so the queue stays full and tokens/s
measures capacity; --quick sends its 6 requests (prompt median an eighth of
the context) at once, a full queue from the start. The KV pool holds the
whole trace, so no run preempts and the budget is the only variable.

`max_num_batched_tokens` ∈ {256, 512, 1024, 2048, 4096} with chunking (512 and
4096 with --quick), and 2048 without it (vLLM's budget without chunking,
max(max_model_len, 2048)). Every configuration runs once per round, in turns,
three rounds (two with --quick). We report generated tokens/s, TTFT p50/p99
and ITL p50/p99.

The verdict, round by round: tokens/s at a budget of 4096 (one budget above
2048, fixed before measuring, so no lucky maximum is picked) against 512, the
old default; "~50%" counts as holding from +40% on.

Predict before you run: how much can a budget above 2048 gain on a CPU, whose
ridge point (lesson 02) is a few FLOP per byte, against a GPU, whose ridge is
hundreds?
"""
from __future__ import annotations

import statistics

from common import make_parser, ms, plt, predict, print_table, run, save_plot, start, ticks_at, write_results
from minillm.bench.verdict import Check, interleave, judge, print_verdict
from minillm.bench.replay import replay
from minillm.bench.workloads import describe_trace, lognormal_trace, pool_blocks

from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig

NAME = "11_budget_sweep"
CLAIM_GAIN = 0.50        # "~50% more throughput ..."
CLAIM_SLACK = 0.10       # "~": a gain of ≥ 40% counts as about 50%
LARGE, OLD_DEFAULT = 4096, 512
UNCHUNKED_BUDGET = 2048  # vLLM without chunking: max(max_model_len, 2048)
MAX_NUM_SEQS = 256       # vLLM's default cap on running sequences


def serve(model, trace, budget: int, chunked: bool):
    """A function that replays the trace once with this budget; returns the replay's summary."""
    blocks = pool_blocks(trace)
    return lambda: replay(LLMEngine(model,
                                    SchedulerConfig(max_num_batched_tokens=budget,
                                                    max_num_seqs=min(MAX_NUM_SEQS, budget),
                                                    enable_chunked_prefill=chunked),
                                    cache_config=CacheConfig(num_gpu_blocks_override=blocks)), trace).summary()


def sizes(n_ctx: int, quick: bool, on_gpu: bool) -> dict:
    if quick:
        return {"requests": 6, "rate": None, "prompt_median": n_ctx / 8, "output_median": 4,
                "budgets": [OLD_DEFAULT, LARGE], "repeats": 2}
    return {"requests": 64 if on_gpu else 12, "rate": 200.0 if on_gpu else 8.0, "prompt_median": n_ctx / 4,
            "output_median": 16, "budgets": [256, 512, 1024, 2048, 4096], "repeats": 3}


LARGE_NAME, OLD_NAME, UNCHUNKED_NAME = f"chunked {LARGE}", f"chunked {OLD_DEFAULT}", f"unchunked {UNCHUNKED_BUDGET}"


def predict_gain(lesson, stats: dict, last: float) -> None:
    predict(lesson, f"the trace offers {stats['requests']} requests " + (f"over {last:.2f} s of arrivals" if last else
                                                                      "queued at once") + "; a bigger budget "
            "packs more prompt tokens into a step, which gains throughput only where a step's time grows more "
            "slowly than its tokens (a GPU's spare compute) and only while requests queue: an engine that keeps "
            "up with the arrivals serves them at their rate whatever its budget")


def make_check(rounds, last: float) -> Check:
    """Per round: tokens/s at the large budget ÷ at the old default, explained by where each one's time went."""
    a, b = rounds.results(LARGE_NAME), rounds.results(OLD_NAME)
    gain = [x["throughput"] / y["throughput"] for x, y in zip(a, b)]
    m_of = lambda runs, key: round(statistics.median(r[key] for r in runs))  # noqa: E731
    ratio = lambda key: statistics.median(r[key] for r in a) / statistics.median(r[key] for r in b)  # noqa: E731

    def budget(runs, name):
        m = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        return (f"{name}: {m('steps'):.0f} steps of {m('mean_tokens_per_step'):.0f} tokens in "
                f"{m('seconds'):.2f} s ({ms(m('seconds') / m('steps'))} a step)")
    return Check(f"tokens/s at budget {LARGE} ÷ at {OLD_DEFAULT}, chunked", gain, 1 + CLAIM_GAIN - CLAIM_SLACK,
                 ">=", fmt="{:.2f}",
                 why=f"where the time went: {budget(a, LARGE_NAME)}; {budget(b, OLD_NAME)}; " + (
                     f"the last request arrived at {last:.2f} s, "
                     f"{last / statistics.median(r['seconds'] for r in a):.0%} of the {LARGE} run; "
                     if last else "every request was queued at t = 0; ") + (
                         f"both budgets ran steps of at most {m_of(a, 'max_tokens_per_step')} tokens, so the "
                         "larger one never bound: the requests did not queue enough prompt tokens to fill even "
                         "the smaller"
                         if ratio("max_tokens_per_step") < 1.2 else
                         f"{LARGE} fed steps of up to {m_of(a, 'max_tokens_per_step')} tokens against "
                         f"{m_of(b, 'max_tokens_per_step')}, in {m_of(a, 'steps')} steps against "
                         f"{m_of(b, 'steps')}: " + (
                             "as many, since the longest output sets their count, so there was no step's fixed "
                             "cost to save" if m_of(a, "steps") >= m_of(b, "steps") else
                             "a step's time grew with its tokens, so larger steps saved only the fixed cost of "
                             "the steps they removed")))


def measure(lesson, s: dict, trace: list, configs: dict, stats: dict, last: float):
    """The trace replayed at every budget, in turns, until the check is decided; a table of their medians."""
    serve(lesson.model, trace[:2], 512, True)()  # warm-up, untimed
    rounds = interleave({name: serve(lesson.model, trace, *c) for name, c in configs.items()}, s["repeats"],
                        warmup=0, device=lesson.device, desc="budgets, in turns",
                        until=lambda r: make_check(r, last).outcome() != "INCONCLUSIVE")
    points = {name: rounds.results(name) for name in configs}
    med = lambda name, key: statistics.median(p[key] for p in points[name])  # noqa: E731
    arrivals = f"Poisson {s['rate']:g}/s" if s["rate"] else "all at t = 0"
    print_table(["budget", "chunked", "tokens/s", "range", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "steps",
                 "tokens/step"],
                [[b, "yes" if c else "no", f"{med(n, 'throughput'):.1f}",
                  f"{min(p['throughput'] for p in points[n]):.1f}–{max(p['throughput'] for p in points[n]):.1f}",
                  ms(med(n, "ttft_p50_s")), ms(med(n, "ttft_p99_s")), ms(med(n, "itl_p50_s")), ms(med(n, "itl_p99_s")),
                  points[n][0]["steps"], f"{points[n][0]['mean_tokens_per_step']:.0f}"] for n, (b, c) in configs.items()],
                f"{stats['requests']} requests, {arrivals}, prompt mean {stats['prompt_mean']:.0f}, output "
                f"mean {stats['output_mean']:.0f} (medians of {rounds.count} rounds; steps: round 1):")
    return rounds, points


def judge_claim(lesson, rounds, points: dict, last: float):
    med = lambda name, key: statistics.median(p[key] for p in points[name])  # noqa: E731
    verdict = judge(f"a budget above 2048 ({LARGE}) gives ~{CLAIM_GAIN:.0%} more throughput than {OLD_DEFAULT}",
                    [make_check(rounds, last)], lesson.load(), [rounds])
    large, old = LARGE_NAME, OLD_NAME
    vs_unchunked = med(large, "throughput") / med(UNCHUNKED_NAME, "throughput")
    verdict.notes.append(f"against {UNCHUNKED_NAME} (vLLM without chunking): {vs_unchunked:.2f}×;"
                         f" TTFT p99 {ms(med(large, 'ttft_p99_s'))} at {LARGE} against {ms(med(old, 'ttft_p99_s'))} at "
                         f"{OLD_DEFAULT}, ITL p99 {ms(med(large, 'itl_p99_s'))} against {ms(med(old, 'itl_p99_s'))}")
    print_verdict(verdict)
    return verdict


def plot(lesson, configs: dict, points: dict, count: int, verdict) -> None:
    med = lambda name, key: statistics.median(p[key] for p in points[name])  # noqa: E731
    unchunked = UNCHUNKED_NAME
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    chunked = [n for n, (_, c) in configs.items() if c]
    xs = [configs[n][0] for n in chunked]
    for ax, key, label in ((axes[0], "throughput", "generated tokens/s"), (axes[1], "ttft", "TTFT (ms)"),
                           (axes[2], "itl", "ITL (ms)")):
        series = [(key, "", 1)] if key == "throughput" else [(f"{key}_p50_s", " p50", 1e3), (f"{key}_p99_s", " p99", 1e3)]
        for (k, suffix, scale), color in zip(series, ("C0", "C1")):
            mid = [med(n, k) * scale for n in chunked]
            ax.errorbar(xs, mid, capsize=3, fmt="o-", color=color, label=f"chunked{suffix}",
                        yerr=[[m - min(p[k] for p in points[n]) * scale for m, n in zip(mid, chunked)],
                              [max(p[k] for p in points[n]) * scale - m for m, n in zip(mid, chunked)]])
            ax.plot(configs[unchunked][0], med(unchunked, k) * scale, "s", color=color, mfc="none",
                    label=f"unchunked{suffix}")
        ax.axvspan(2048, max(xs + [configs[unchunked][0]]) * 1.3, color="grey", alpha=0.12,
                   label="budgets > 2048 (the claim)" if key == "throughput" else None)
        ax.set_xscale("log", base=2)
        ticks_at(ax, xs + [configs[unchunked][0]])
        ax.set(xlabel="max_num_batched_tokens", ylabel=label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room above the highest marker
    line = (1 + CLAIM_GAIN - CLAIM_SLACK) * med(OLD_NAME, "throughput")
    axes[0].axhline(line, color="k", ls=":",
                    label=f"the claim's line: {1 + CLAIM_GAIN - CLAIM_SLACK:g}× budget {OLD_DEFAULT}")
    axes[0].set_ylim(0, max(axes[0].get_ylim()[1], 1.25 * line))
    for ax in axes:  # below the axes: never over the data
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[0].set_title(f"throughput ({LARGE} ÷ {OLD_DEFAULT}: {verdict.checks[0].median:.2f}×)\n(medians of {count} "
                      "rounds; bars: range)")
    axes[1].set_title("time to first token")
    axes[2].set_title("inter-token latency")
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    cfg = lesson.config
    s = sizes(cfg.n_ctx, args.quick, lesson.device.type == "cuda")
    trace = lognormal_trace(s["requests"], cfg.n_ctx, cfg.vocab_size, s["prompt_median"], s["output_median"],
                            sigma=0.6, seed=0, rate=s["rate"])
    stats, last = describe_trace(trace), max(r.arrival_s for r in trace)
    configs = {f"chunked {b}": (b, True) for b in s["budgets"]}
    configs[UNCHUNKED_NAME] = (max(UNCHUNKED_BUDGET, stats["longest"]), False)
    predict_gain(lesson, stats, last)
    rounds, points = measure(lesson, s, trace, configs, stats, last)
    verdict = judge_claim(lesson, rounds, points, last)
    plot(lesson, configs, points, rounds.count, verdict)
    figures = {"trace": {**stats, "rate_per_s": s["rate"], "prompt_median": s["prompt_median"],
                         "output_median": s["output_median"], "sigma": 0.6, "seed": 0},
               "configs": {n: {"budget": b, "chunked": c, "runs": points[n]} for n, (b, c) in configs.items()},
               "gain_per_round": verdict.checks[0].values, "claimed_gain": CLAIM_GAIN}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
