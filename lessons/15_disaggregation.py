"""Lesson 15: disaggregation. Prefill and decode on separate workers: what it buys, and what it does not.

The claim
---------
Prefill is compute-bound and decode memory-bound (lesson 02), and one engine
serving both makes them interfere: a long prompt's prefill shares a step with
the running decodes, and every stream stalls (lesson 10). DistServe, Splitwise
and Mooncake, and vLLM's disaggregated prefill, run the phases on separate
workers and move each prompt's KV cache between them (`minillm/kv_producer.py`
and `minillm/kv_consumer.py`: a prefill worker and a decode worker, each an
`LLMEngine` in its own process on its own core, joined by torch.distributed).
Each prediction comes from the pass model (`minillm/bench/pass_cost.py`: a pass
costs t₁, a one-token request's TTFT timed first, plus its FLOPs at the measured
peak), before the workers start:

    interference    colocated, a step that carries the long prompt's prefill beside K
                    decodes lasts (t₁ + FLOPs(P + K)/peak) ÷ (t₁ + FLOPs(K)/peak) decode
                    steps: the streams' p99 ITL in its window ÷ their ITL before lies in
                    the band the model's uncertainty sets (prefill at half the peak to
                    all of it, t₁ off by 1.5×); disaggregated, the decode worker runs
                    no prefill: predicted 1, judged ≤ 1.5 (room for receiving the KV)
    the transfer    every prompt moves prompt_len · 2 · n_layer · n_embd · dtype bytes
                    (a fact: the connector counts what it sends by that formula), and
                    TTFT grows by those bytes over the link's bandwidth (fitted, shown)
    no free lunch   a saturating burst's prefills and decodes run one after the other on
                    either side, and a colocated engine may use both cores: predicted
                    tokens/s disaggregated ÷ best colocated ≤ 1; judged ≤ 1.2 (room for
                    the machine's noise: on one thread the two are the same engine). vLLM's
                    documentation says disaggregation "does not improve throughput"
    where it pays   goodput (the course's one definition, `minillm/bench/goodput.py`:
                    requests/s meeting both a TTFT and an ITL target, here 3× the fastest
                    long TTFT and 2× the fastest median ITL with no long prompt): with no
                    long prompt the decode worker is the colocated engine on one thread,
                    predicted ratio 1, judged ≤ 1.25 (room: true value ≈ 1, a line at 1
                    would flip); once long prompts arrive, colocated streams stall past the
                    target (when the predicted stall exceeds 2×) while the decode worker's
                    do not: predicted (K + n) ÷ n at n long prompts, judged ≥ 1

What this lesson measures
-------------------------
Three servers, each in worker processes started once: colocated on both cores with 1 thread, colocated with
2 threads, and disaggregated (prefill on one core, decode on the other, one thread each). In every round each
serves, in turns, (1) lesson 10's trace (the servers with one thread per engine): K streams decode, and once
each has `warm` tokens a long prompt of P tokens arrives (P = 384 on gpt2; 128 with --quick), and (2) a burst
of requests arriving together (all three). From the workers' own token times: the streams' p99 ITL in the
window from the long prompt's arrival to its first token, their median ITL before it, the long request's TTFT
(and, disaggregated, its split into prefill and transfer), the burst's tokens/s. Then (3) the same streams
with 0, 2 (full run: 4 too) long prompts arriving evenly over their life: each request's TTFT and every
gap, against the targets. Every ratio is taken within a round (at least five rounds).

Predict before you run: how long does the transfer of a 128-token gpt2 prompt
take over loopback TCP (gloo), and how does that compare with its prefill?
"""
from __future__ import annotations

import functools
import statistics
import time

from common import (make_parser, ms, one_thread, plot_checks, plt, predict, print_table, run, save_plot, start,
                    write_results)
from minillm.bench.disagg import burst, mixed_trace, stall_trace
from minillm.bench.goodput import goodput
from minillm.bench.pass_cost import band, fixed_cost, pass_time
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict, settled
from minillm.serving.disaggregated import Workers
from servers import start_workers

NAME = "15_disaggregation"
FLAT_LINE = 1.5        # disaggregated: window p99 ITL ÷ ITL before ≤ 1.5 (predicted 1; room for receiving the KV)
THROUGHPUT_LINE = 1.2  # burst tokens/s, disaggregated ÷ best colocated ≤ 1.2 (predicted ≤ 1; room for noise)
LIGHT_LINE = 1.25      # goodput with no long prompt, disaggregated ÷ best colocated ≤ 1.25 (predicted 1)
HEAVY_LINE = 1.0       # goodput at the heaviest mix, disaggregated ÷ best colocated ≥ 1
ITL_TARGET, TTFT_TARGET = 2.0, 3.0  # × the fastest median ITL with no long prompt; × the fastest long TTFT
MODES = ["colocated, 1 thread", "colocated, 2 threads", "disaggregated"]
TRACED = [MODES[0], MODES[2]]  # the stall trace: one thread per engine on both sides; the burst runs on all three


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"streams": 4, "stream_prompt": 8, "warm": 3, "stream_tokens": 12, "long_prompt": min(128, n_ctx - 8),
                "long_tokens": 2, "burst": 4, "burst_prompt": min(32, n_ctx - 16), "burst_tokens": 8, "repeats": 5,
                "max_repeats": 6, "mixes": [0, 2]}
    # long prompts are two thirds of a round's prefill: at 384 tokens, three mixes, ≤ 7 rounds, a full run stays short
    return {"streams": 4, "stream_prompt": 32, "warm": 6, "stream_tokens": 32, "long_prompt": min(384, n_ctx - 8),
            "long_tokens": 4, "burst": 8, "burst_prompt": min(128, n_ctx - 32), "burst_tokens": 32, "repeats": 5,
            "max_repeats": 7, "mixes": [0, 2, 4]}


def targets(runs: dict[str, list[dict]]) -> dict:
    """Goodput's targets: ITL_TARGET × the fastest server's median gap with no long prompt, TTFT_TARGET × the
    fastest traced server's median TTFT of the long prompt."""
    return {"itl": ITL_TARGET * min(statistics.median(g for r in runs[m] for g in r["mix_0"]["gaps_s"]) for m in MODES),
            "ttft": TTFT_TARGET * min(statistics.median(r["long_ttft_s"] for r in runs[m]) for m in TRACED)}


def goodput_ratios(runs: dict[str, list[dict]], mix: int, target: dict) -> list[float]:
    """Per round: disaggregated goodput ÷ the better colocated one's, at `mix` long prompts per stream life.
    Each side counts one request more than met both targets, so that a round where one met none still has a
    ratio (0 or ∞ otherwise)."""
    def smoothed(trace: dict) -> float:
        return goodput(trace["requests"], trace["span_s"], target)["goodput"] + 1 / trace["span_s"]
    c1, c2, d = (runs[m] for m in MODES)
    return [smoothed(x[f"mix_{mix}"]) / max(smoothed(a[f"mix_{mix}"]), smoothed(b[f"mix_{mix}"]))
            for a, b, x in zip(c1, c2, d)]


def one_round(workers: Workers, s: dict, vocab: int, trace: bool = True) -> dict:
    """The stall trace (unless `trace` is False), the burst, the mixed traces; and the bytes the connector moved."""
    before = workers.worker_stats().get("prefill", {}).get("bytes_sent")
    out = (stall_trace(workers, s, vocab) if trace else {}) | burst(workers, s, vocab)
    out |= {f"mix_{n}": mixed_trace(workers, s, vocab, n) for n in s["mixes"]}
    out["bytes_sent"] = None if before is None else workers.worker_stats()["prefill"]["bytes_sent"] - before
    return out


def predictions(lesson, s: dict) -> dict:
    """t₁ timed, then the pass model's predictions (the docstring's), printed; the bytes each round moves."""
    c, K, P, n = lesson.config, s["streams"], s["long_prompt"], s["mixes"][-1]
    with one_thread():
        t1 = fixed_cost(lesson.model)
    ctx, per_token = s["stream_prompt"] + s["warm"], c.kv_bytes_per_token(lesson.dtype)
    stall = lambda rate: (pass_time(c, [P] + [1] * K, [0] + [ctx] * K, t1, rate, lesson.dtype)  # noqa: E731
                          / pass_time(c, [1] * K, [ctx] * K, t1, rate, lesson.dtype))
    peak = lesson.ceilings.matmul_flops
    p = {"fixed_s": t1, "stall": stall(peak), "stall_band": band(stall(peak), stall(peak / 2)), "flat": 1.0,
         "burst": 1.0, "light": 1.0, "per_token": per_token}
    stalls = p["stall_band"][0] > ITL_TARGET  # the model says the colocated streams miss the ITL target
    p["heavy"] = (K + n) / n if stalls else 1.0
    p["heavy_undecided"] = "" if stalls else (
        f"the pass model predicts a {P}-token prefill stalls {K} streams by {p['stall_band'][0]:.2f}–"
        f"{p['stall_band'][1]:.2f}× their ITL, not clearly past the {ITL_TARGET:g}× target, so this run cannot show "
        "where disaggregation pays; a larger --model (a longer prefill) can")
    streams = K * s["stream_prompt"]
    p["moved"] = (streams + P + s["burst"] * s["burst_prompt"] + sum(streams + m * P for m in s["mixes"])) * per_token
    predict(lesson, f"t₁ = {ms(t1)} (a one-token request's TTFT); colocated, the step carrying the {P}-token prefill "
            f"beside {K} decodes lasts {p['stall']:.2f} decode steps (band {p['stall_band'][0]:.2f}–"
            f"{p['stall_band'][1]:.2f}: prefill at half the peak to all of it, t₁ off by 1.5×); disaggregated 1 "
            f"(judged ≤ {FLAT_LINE:g})",
            f"each round moves {p['moved']:,} bytes ({per_token:,} per token: 2 · {c.n_layer} · {c.n_embd} · "
            f"{per_token // (2 * c.n_layer * c.n_embd)} bytes)",
            f"a saturating burst: disaggregated tokens/s ÷ the best colocated ≤ 1 (judged ≤ {THROUGHPUT_LINE:g})",
            f"goodput (requests/s meeting TTFT ≤ {TTFT_TARGET:g}× the fastest long TTFT and every gap ≤ "
            f"{ITL_TARGET:g}× the fastest ITL), disaggregated ÷ best colocated: 1 with no long prompt (judged ≤ "
            f"{LIGHT_LINE:g}); {p['heavy']:.2f} at {n} long prompts (judged ≥ {HEAVY_LINE:g})"
            + (f": {p['heavy_undecided']}" if p["heavy_undecided"] else ""),
            expect={"stall_low": p["stall"], "stall_high": p["stall"], "flat": p["flat"], "burst": p["burst"],
                    "goodput_heavy": p["heavy"], "goodput_light": p["light"]})
    return p


def checks(figures: dict) -> list[Check]:
    """The five checks, one value per round: the stall (both ends of its band), the flat decode ITL, the burst,
    goodput at the heaviest and the lightest mix."""
    f = figures
    runs, p, s = f["runs"], f["predicted"], f["setup"]
    c1, c2, d = (runs[m] for m in MODES)
    target, light, heavy = targets(runs), s["mixes"][0], s["mixes"][-1]
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    good = {n: [statistics.median(goodput(r[f"mix_{n}"]["requests"], r[f"mix_{n}"]["span_s"], target)["goodput"]
                                  for r in rs) for rs in (c1, c2, d)] for n in (light, heavy)}
    stall = [r["window_p99_itl_s"] / r["itl_before_median_s"] for r in c1]
    stall_why = (f"the window's p99 gap was {ms(med(c1, 'window_p99_itl_s'))} against {ms(med(c1, 'itl_before_median_s'))}"
                 f" before, the long prefill's TTFT {ms(med(c1, 'long_ttft_s'))}; the model (t₁ = {ms(p['fixed_s'])}) "
                 f"predicted {p['stall']:.2f}×")
    return [
        *[Check(f"colocated stall ({end} end of the model's band): streams' p99 ITL in the long prompt's window ÷ "
                "their ITL before, 1 thread", stall, p["stall_band"][i], op, fmt="{:.2f}", predicted=p["stall"],
                key=f"stall_{end}", why=stall_why) for i, (end, op) in enumerate((("low", ">="), ("high", "<=")))],
        Check("disaggregated: decode worker's p99 ITL in the same window ÷ ITL before",
              [r["window_p99_itl_s"] / r["itl_before_median_s"] for r in d], FLAT_LINE, "<=", fmt="{:.2f}",
              predicted=p["flat"], key="flat",
              why=f"the decode worker's p99 gap was {ms(med(d, 'window_p99_itl_s'))} against "
                  f"{ms(med(d, 'itl_before_median_s'))} before: receiving {s['long_prompt']} tokens of KV "
                  f"({ms(med(d, 'long_transfer_s'))}) and the prefill worker's core were not free of it"),
        Check("burst tokens/s: disaggregated ÷ best colocated (1 or 2 threads)",
              [x["throughput"] / max(a["throughput"], b["throughput"]) for a, b, x in zip(c1, c2, d)],
              THROUGHPUT_LINE, "<=", fmt="{:.2f}", predicted=p["burst"], key="burst",
              why=f"disaggregated served {med(d, 'throughput'):.1f} tokens/s against "
                  f"{med(c1, 'throughput'):.1f} and {med(c2, 'throughput'):.1f} colocated"),
        Check(f"goodput, {heavy} long prompts per stream life: disaggregated ÷ best colocated",
              goodput_ratios(runs, heavy, target), HEAVY_LINE, ">=", fmt="{:.2f}", predicted=p["heavy"],
              key="goodput_heavy", undecided=p["heavy_undecided"],
              why=f"{good[heavy][2]:.2f} requests/s met both targets disaggregated against {max(good[heavy][:2]):.2f} "
                  "for the best colocated engine: the long prefills did not stall the colocated streams past the ITL "
                  f"target {ms(target['itl'])} often enough to outweigh its second core"),
        Check(f"goodput, {light} long prompts: disaggregated ÷ best colocated", goodput_ratios(runs, light, target),
              LIGHT_LINE, "<=", fmt="{:.2f}", predicted=p["light"], key="goodput_light",
              why=f"with nothing to interfere, {good[light][2]:.2f} requests/s met both targets disaggregated "
                  f"against {max(good[light][:2]):.2f} colocated: more than the same engine on one thread should")]


def facts(f: dict) -> list[Fact]:
    """The bytes the connector moved: it counts what it sends by the formula, so they cannot refute it."""
    sent = [r["bytes_sent"] for r in f["runs"][MODES[2]]]
    return [Fact("KV bytes moved per round", statistics.median(sent), predicted=f["bytes_moved_per_round"],
                 fmt="{:,.0f}", why="the connector sends each prompt's KV blocks, so its count equals "
                                    "Σ prompt_len · 2 · n_layer · n_embd · dtype bytes by construction")]


def measure(lesson, s: dict, p: dict) -> dict:
    """The three servers, started once and warmed up, served in turns until the checks are decided; a table of
    their medians. The workers are closed whatever happens."""
    c = lesson.config
    started = time.perf_counter()
    servers = start_workers(lesson.args, c, str(lesson.device), MODES)
    try:
        for w in servers.values():  # warm-up, untimed: the first forward passes of each worker
            burst(w, s | {"burst": 2, "burst_tokens": 2}, c.vocab_size)
        startup_s = time.perf_counter() - started
        print(f"five worker processes built their models and served a first burst in {startup_s:.1f} s")
        rounds = interleave({m: functools.partial(one_round, servers[m], s, c.vocab_size, m != MODES[1])
                             for m in MODES},
                            s["repeats"], warmup=0, device=lesson.device, desc="three servers, in turns",
                            until=settled(lambda r: checks({"setup": s, "predicted": p,
                                                            "runs": {m: r.results(m) for m in MODES}})),
                            max_repeats=s["max_repeats"])
        stats = {m: w.worker_stats() for m, w in servers.items()}
    finally:
        for w in servers.values():
            w.close()
    runs = {m: rounds.results(m) for m in MODES}
    med = lambda m, key: statistics.median(r[key] for r in runs[m])  # noqa: E731
    print_table(["server", "p99 ITL in window", "ITL before", "÷ (median of rounds)", "long TTFT", "burst tokens/s"],
                [[m, ms(med(m, "window_p99_itl_s")), ms(med(m, "itl_before_median_s")),
                  f"{statistics.median(r['window_p99_itl_s'] / r['itl_before_median_s'] for r in runs[m]):.2f}",
                  ms(med(m, "long_ttft_s")),
                  f"{med(m, 'throughput'):.1f}"] if m in TRACED else [m, "", "", "", "", f"{med(m, 'throughput'):.1f}"]
                 for m in MODES],
                f"{s['streams']} streams when a {s['long_prompt']}-token prompt arrives; a burst of {s['burst']} "
                f"(medians of {rounds.count} rounds):")
    return {"rounds": rounds, "runs": runs, "stats": stats, "startup_s": startup_s}


def read_run(s: dict, p: dict, m: dict) -> dict:
    """The figures the checks, facts, notes and plot read: the runs, the targets, goodput by mix, the link."""
    runs = m["runs"]
    target, per_token = targets(runs), p["per_token"]
    transfer_s = statistics.median(r["long_transfer_s"] for r in runs["disaggregated"])
    good = {mode: {n: statistics.median(goodput(r[f"mix_{n}"]["requests"], r[f"mix_{n}"]["span_s"], target)["goodput"]
                                        for r in runs[mode]) for n in s["mixes"]} for mode in MODES}
    ratios = {n: statistics.median(goodput_ratios(runs, n, target)) for n in s["mixes"]}
    return {"setup": s, "predicted": p, "kv_bytes_per_token": per_token, "bytes_moved_per_round": p["moved"],
            "runs": runs, "long_prompt_bytes": s["long_prompt"] * per_token, "long_transfer_s": transfer_s,
            "fitted_bandwidth_Bps": s["long_prompt"] * per_token / transfer_s, "targets_s": target,
            "goodput_requests_per_s": good, "goodput_ratio_median": ratios,
            "goodput_first_mix_where_disaggregated_wins": next((n for n in s["mixes"] if ratios[n] > 1), None),
            "workers_after": m["stats"], "startup_s": m["startup_s"]}


def judge_claim(lesson, f: dict):
    """The verdict, with the transfer's price and where disaggregation pays as notes."""
    runs, s = f["runs"], f["setup"]
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    verdict = judge("colocated, a long prompt stalls the running streams by what the pass model predicts, and "
                    "disaggregated it does not; disaggregation does not raise throughput; and its goodput passes "
                    "colocated serving's once long prompts arrive, not before", checks(f), lesson.load(),
                    [f["rounds"]], facts=facts(f))
    verdict.notes.append(f"the transfer's price: the long prompt's {f['long_prompt_bytes']:,} bytes landed "
                         f"{ms(f['long_transfer_s'])} after its prefill worker sampled its first token, a link of "
                         f"{f['fitted_bandwidth_Bps'] / 1e6:.0f} MB/s fitted from this run; its TTFT was "
                         f"{ms(med('disaggregated', 'long_ttft_s'))} disaggregated against "
                         f"{ms(med('colocated, 1 thread', 'long_ttft_s'))} colocated on 1 thread")
    ratios, first = f["goodput_ratio_median"], f["goodput_first_mix_where_disaggregated_wins"]
    verdict.notes.append(
        f"where it pays, on this machine: under TTFT ≤ {ms(f['targets_s']['ttft'])} and ITL ≤ "
        f"{ms(f['targets_s']['itl'])}, disaggregated goodput ÷ best colocated is "
        f"{', '.join(f'{ratios[n]:.2f} at {n}' for n in s['mixes'])} long prompts per stream life (medians of "
        "rounds); " + (f"it first passes 1 at {first}" if first is not None else "it never passes 1 in the mixes measured"))
    print_verdict(verdict)
    return verdict


def plot(lesson, f: dict, verdict) -> None:
    """The streams' ITL, the burst, goodput by mix (every axis from 0), and the checks on a row of their own."""
    s, runs, good, target = f["setup"], f["runs"], f["goodput_requests_per_s"], f["targets_s"]
    fig = plt.figure(figsize=(16, 10.5))
    grid = fig.add_gridspec(2, 3, height_ratios=[1, 1.1])
    axes = [fig.add_subplot(grid[0, i]) for i in range(3)] + [fig.add_subplot(grid[1, :])]
    for key, offset, label in (("itl_before_median_s", -0.2, "median ITL before"),
                               ("window_p99_itl_s", 0.2, "p99 ITL in the long prompt's window")):
        vals = [[1e3 * r[key] for r in runs[m]] for m in TRACED]
        meds = [statistics.median(v) for v in vals]
        axes[0].bar([i + offset for i in range(len(TRACED))], meds, 0.4, label=label,
                    yerr=[[x - min(v) for x, v in zip(meds, vals)], [max(v) - x for x, v in zip(meds, vals)]])
    axes[0].set_xticks(list(range(len(TRACED))), TRACED, fontsize=8)
    axes[0].set(ylabel="ms (median of the rounds; bars: their range)", title="the streams' inter-token latency")
    vals = [[r["throughput"] for r in runs[m]] for m in MODES]
    axes[1].bar(range(len(MODES)), [statistics.median(v) for v in vals], 0.6, color="C2", label="median")
    for i, v in enumerate(vals):
        axes[1].plot([i] * len(v), v, "k.", label="one round" if i == 0 else None)
    axes[1].set_xticks(range(len(MODES)), [m.replace(", ", ",\n") for m in MODES], fontsize=8)
    axes[1].set(ylabel="generated tokens/s", title="a saturating burst")
    for m in MODES:
        axes[2].plot(s["mixes"], [good[m][n] for n in s["mixes"]], "o-", label=m)
    axes[2].set(xlabel="long prompts per stream lifetime (the load mix)", xticks=s["mixes"],
                ylabel="requests/s meeting both targets (median of rounds)",
                title=f"goodput: TTFT ≤ {ms(target['ttft'])}, every gap ≤ {ms(target['itl'])}")
    for ax in axes[:3]:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # from 0, with room for the legend over the bars
        ax.legend(fontsize=8, loc="upper right")
    plot_checks(axes[3], verdict)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    p = predictions(lesson, s)
    m = measure(lesson, s, p)
    f = read_run(s, p, m)
    verdict = judge_claim(lesson, f | {"rounds": m["rounds"]})
    plot(lesson, f, verdict)
    write_results(lesson, f, verdict)
    return {"figures": f, "verdict": verdict}


if __name__ == "__main__":
    run(main)
