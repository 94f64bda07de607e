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
Four predictions:

    interference    colocated, a long prompt raises the running streams' p99 ITL
                    (≥ 2× their ITL before it arrived); disaggregated, the decode
                    worker's ITL stays flat (≤ 1.5×) under the same load
    the transfer    every prompt moves prompt_len · 2 · n_layer · n_embd · dtype bytes,
                    exactly, and TTFT grows by those bytes over the link's bandwidth
    no free lunch   on the same cores and a saturating load, total tokens/s is not
                    higher disaggregated than colocated at its best thread setting
                    (1 or 2 threads, both measured): vLLM's documentation says
                    disaggregation "does not improve throughput"
    where it pays   goodput under a tight ITL target (stream tokens/s that came
                    within 1.5× the fastest ITL of the token before): with no long
                    prompt the best colocated engine wins, with enough of them the
                    decode worker does; the load mix where they cross is the boundary

What this lesson measures
-------------------------
Three servers, each in worker processes started once: colocated on both cores
with 1 thread, colocated with 2 threads, and disaggregated (prefill on one
core, decode on the other, one thread each). In every round each serves, in
turns, (1) lesson 10's trace (the two servers with one thread per engine): K streams decode, and once each has `warm`
tokens a long prompt of P tokens arrives (P = 512 on gpt2; 128 with --quick),
and (2) a burst of requests arriving together (all three). From the workers' own token
times: the streams' p99 ITL in the window from the long prompt's arrival to its
first token, their median ITL before it, the long request's TTFT (and,
disaggregated, its split into prefill and transfer), and the burst's tokens/s.
The bytes moved are counted by the connector. Then (3) the same streams with 0,
2 (and, full run, 1 and 4) long prompts arriving evenly over their life: every
gap between two of a stream's tokens, against the target. The verdict is taken
round by round: each ratio is computed within a round.

Predict before you run: how long does the transfer of a 128-token gpt2 prompt
take over loopback TCP (gloo), and how does that compare with its prefill?
"""
from __future__ import annotations

import functools
import statistics
import time

from common import make_parser, ms, plot_checks, plt, predict, print_table, run, save_plot, start, write_results
from minillm.bench.disagg import build_model, burst, goodput, mixed_trace, stall_trace
from minillm.bench.verdict import Check, interleave, judge, print_verdict, settled
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from minillm.serving.disaggregated import WorkerConfig, Workers, split_cores

NAME = "15_disaggregation"
STALL_LINE = 2.0   # colocated: window p99 ITL ÷ ITL before ≥ 2
FLAT_LINE = 1.5    # disaggregated: ≤ 1.5
THROUGHPUT_LINE = 1.0  # disaggregated tokens/s ÷ best colocated ≤ 1
GOODPUT_LINE = 1.0     # disaggregated goodput ÷ best colocated: ≤ 1 with no long prompt, ≥ 1 at the heaviest mix
TARGET = 1.5           # the tight ITL target: 1.5 × the fastest server's median ITL with no long prompt
MODES = ["colocated, 1 thread", "colocated, 2 threads", "disaggregated"]
TRACED = [MODES[0], MODES[2]]  # the stall trace: one thread per engine on both sides; the burst runs on all three


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"streams": 4, "stream_prompt": 8, "warm": 3, "stream_tokens": 12, "long_prompt": min(128, n_ctx - 8),
                "long_tokens": 2, "burst": 4, "burst_prompt": min(32, n_ctx - 16), "burst_tokens": 8, "repeats": 3,
                "max_repeats": 4, "mixes": [0, 2]}
    return {"streams": 4, "stream_prompt": 32, "warm": 6, "stream_tokens": 32, "long_prompt": min(512, n_ctx - 8),
            "long_tokens": 4, "burst": 8, "burst_prompt": min(128, n_ctx - 32), "burst_tokens": 32, "repeats": 5,
            "max_repeats": None, "mixes": [0, 1, 2, 4]}


def start_workers(args, config, device: str) -> dict[str, Workers]:
    """The three servers, each in processes of its own, built from the same seeded model."""
    factory = functools.partial(build_model, args.model, device, args.dtype)
    first, second = split_cores()
    both = sorted(first + second)
    # the engine's default budget: a long prompt shares one step with the decodes
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16)
    cache = CacheConfig(num_gpu_blocks_override=256)  # 4,096 tokens of KV per worker: every request of a round at once
    gpu = device.startswith("cuda")
    coloc = functools.partial(WorkerConfig, sched, cache, device=device, cores=both)
    return {"colocated, 1 thread": Workers.colocated(factory, config, coloc()),
            "colocated, 2 threads": Workers.colocated(factory, config, coloc(threads=2)),
            "disaggregated": Workers.disaggregated(
                factory, config, WorkerConfig(sched, cache, device="cuda:0" if gpu else device,
                                              cores=first),
                WorkerConfig(sched, cache, device="cuda:1" if gpu else device, cores=second))}


def itl_target(rounds_by_mode: dict[str, list[dict]]) -> float:
    """The tight ITL target: TARGET × the fastest server's median gap between tokens with no long prompt."""
    return TARGET * min(statistics.median(g for r in runs for g in r["mix_0"]["gaps_s"])
                        for runs in rounds_by_mode.values())


def goodput_ratios(rounds_by_mode: dict[str, list[dict]], mix: int, target_s: float) -> list[float]:
    """Per round: disaggregated goodput ÷ the better colocated one's, at `mix` long prompts per stream life.
    Each side counts one token more than met the target, so that a round where one met it with none still
    has a ratio (0 or ∞ otherwise); with tens of tokens per trace that moves a ratio by a few percent."""
    def smoothed(trace: dict) -> float:
        return goodput(trace, target_s) + 1 / trace["span_s"]
    c1, c2, d = (rounds_by_mode[m] for m in MODES)
    return [smoothed(x[f"mix_{mix}"]) / max(smoothed(a[f"mix_{mix}"]), smoothed(b[f"mix_{mix}"]))
            for a, b, x in zip(c1, c2, d)]


def one_round(workers: Workers, s: dict, vocab: int, trace: bool = True) -> dict:
    """The stall trace (unless `trace` is False), the burst, the mixed traces; and the bytes the connector moved."""
    before = workers.worker_stats().get("prefill", {}).get("bytes_sent")
    out = (stall_trace(workers, s, vocab) if trace else {}) | burst(workers, s, vocab)
    out |= {f"mix_{n}": mixed_trace(workers, s, vocab, n) for n in s["mixes"]}
    out["bytes_sent"] = None if before is None else workers.worker_stats()["prefill"]["bytes_sent"] - before
    return out


def predict_transfer(lesson, s: dict) -> dict:
    """The four predictions; returns the KV bytes per token and the bytes each round must move, exactly."""
    c = lesson.config
    per_token = c.kv_bytes_per_token(lesson.dtype)
    streams = s["streams"] * s["stream_prompt"]
    moved = (streams + s["long_prompt"] + s["burst"] * s["burst_prompt"]
             + sum(streams + n * s["long_prompt"] for n in s["mixes"])) * per_token
    predict(lesson, f"colocated, the {s['long_prompt']}-token prompt shares a step with {s['streams']} decodes: their "
            f"p99 ITL in its window ≥ {STALL_LINE:g}× their ITL before it; disaggregated ≤ {FLAT_LINE:g}×",
            f"each round moves exactly {moved:,} bytes ({per_token:,} per token: 2 · {c.n_layer} · {c.n_embd} · "
            f"{per_token // (2 * c.n_layer * c.n_embd)} bytes)",
            f"a saturating burst: disaggregated tokens/s ≤ {THROUGHPUT_LINE:g}× the best colocated",
            f"goodput under a tight ITL target ({TARGET:g}× the fastest ITL with no long prompt): lower "
            f"disaggregated with no long prompt (one core decodes, against the best of both), higher with "
            f"{s['mixes'][-1]} long prompts per stream life; the boundary lies between")
    return {"per_token": per_token, "moved": moved}


def make_checks(rounds, s: dict, moved: int) -> list[Check]:
    """The six checks, one value per round: the stall, the flat decode ITL, the burst, goodput at the heaviest and
    the lightest mix, and the bytes moved."""
    c1, c2, d = (rounds.results(m) for m in MODES)
    target = itl_target({m: rounds.results(m) for m in MODES})
    light, heavy = s["mixes"][0], s["mixes"][-1]
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    good = {n: [statistics.median(goodput(r[f"mix_{n}"], target) for r in runs) for runs in (c1, c2, d)]
            for n in (light, heavy)}  # per mix: the three servers' median goodput (the JSON's goodput_tokens_per_s)
    return [
        Check("colocated (1 thread): streams' p99 ITL in the long prompt's window ÷ ITL before",
              [r["window_p99_itl_s"] / r["itl_before_median_s"] for r in c1], STALL_LINE, ">=", fmt="{:.2f}",
              why=f"the window's p99 gap was {ms(med(c1, 'window_p99_itl_s'))} against "
                  f"{ms(med(c1, 'itl_before_median_s'))} before: the long prefill took "
                  f"{ms(med(c1, 'long_ttft_s'))}, too short to stand out from a decode step here"),
        Check("disaggregated: decode worker's p99 ITL in the same window ÷ ITL before",
              [r["window_p99_itl_s"] / r["itl_before_median_s"] for r in d], FLAT_LINE, "<=", fmt="{:.2f}",
              why=f"the decode worker's p99 gap was {ms(med(d, 'window_p99_itl_s'))} against "
                  f"{ms(med(d, 'itl_before_median_s'))} before: receiving {s['long_prompt']} tokens of KV "
                  f"({ms(med(d, 'long_transfer_s'))}) and the prefill worker's core were not free of it"),
        Check("burst tokens/s: disaggregated ÷ best colocated (1 or 2 threads)",
              [x["throughput"] / max(a["throughput"], b["throughput"]) for a, b, x in zip(c1, c2, d)],
              THROUGHPUT_LINE, "<=", fmt="{:.2f}",
              why=f"disaggregated served {med(d, 'throughput'):.1f} tokens/s against "
                  f"{med(c1, 'throughput'):.1f} and {med(c2, 'throughput'):.1f} colocated"),
        Check(f"goodput under a {ms(target)} ITL target, {heavy} long prompts per stream life: "
              "disaggregated ÷ best colocated", goodput_ratios({m: rounds.results(m) for m in MODES}, heavy, target),
              GOODPUT_LINE, ">=", fmt="{:.2f}",
              why=f"the decode worker kept {good[heavy][2]:.1f} stream tokens/s within the target against "
                  f"{max(good[heavy][:2]):.1f} for the best colocated engine: the long prompts' prefills did not "
                  "stall the colocated streams past the target often enough to outweigh its single core"),
        Check(f"goodput under the same target, {light} long prompts: disaggregated ÷ best colocated",
              goodput_ratios({m: rounds.results(m) for m in MODES}, light, target),
              GOODPUT_LINE, "<=", fmt="{:.2f}",
              why=f"with nothing to interfere, the decode worker's own core kept {good[light][2]:.1f} stream "
                  f"tokens/s within the target against {max(good[light][:2]):.1f} for the best colocated engine"),
        Check("bytes moved per round − Σ prompt_len · 2 · n_layer · n_embd · dtype bytes",
              [abs(r["bytes_sent"] - moved) for r in d], 0, "<=", timed=False, fmt="{:.0f}",
              why=f"the connector counted {d[0]['bytes_sent']:,} bytes against {moved:,}")]


def measure(lesson, s: dict, moved: int) -> dict:
    """The three servers, started once and warmed up, served in turns until the checks are decided; a table of
    their medians. The workers are closed whatever happens."""
    c = lesson.config
    started = time.perf_counter()
    servers = start_workers(lesson.args, c, str(lesson.device))
    try:
        for w in servers.values():  # warm-up, untimed: the first forward passes of each worker
            burst(w, s | {"burst": 2, "burst_tokens": 2}, c.vocab_size)
        startup_s = time.perf_counter() - started
        print(f"five worker processes built their models and served a first burst in {startup_s:.1f} s")
        rounds = interleave({m: functools.partial(one_round, servers[m], s, c.vocab_size, m != MODES[1])
                             for m in MODES},
                            s["repeats"], warmup=0, device=lesson.device, desc="three servers, in turns",
                            until=settled(lambda r: make_checks(r, s, moved)), max_repeats=s["max_repeats"])
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


def judge_claim(lesson, s: dict, m: dict, cost: dict):
    """The verdict, with the transfer's price and where disaggregation pays as notes; returns it and what the
    notes read (the fitted link, the ITL target, goodput by mix)."""
    runs = m["runs"]
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    verdict = judge(f"colocated, a long prompt raises the streams' p99 ITL ≥ {STALL_LINE:g}×; disaggregated, it "
                    f"stays ≤ {FLAT_LINE:g}×; the bytes moved are exactly 2·n_layer·n_embd·dtype bytes per prompt "
                    "token; disaggregation does not raise throughput; and its goodput under a tight ITL target "
                    "passes colocated serving's once long prompts arrive", make_checks(m["rounds"], s, cost["moved"]),
                    lesson.load(), [m["rounds"]])
    transfer_s, long_bytes = med("disaggregated", "long_transfer_s"), s["long_prompt"] * cost["per_token"]
    bandwidth = long_bytes / transfer_s
    verdict.notes.append(f"the transfer's price: the long prompt's {long_bytes:,} bytes landed "
                         f"{ms(transfer_s)} after its prefill worker sampled its first token, a link of "
                         f"{bandwidth / 1e6:.0f} MB/s fitted from this run; its TTFT was "
                         f"{ms(med('disaggregated', 'long_ttft_s'))} disaggregated against "
                         f"{ms(med('colocated, 1 thread', 'long_ttft_s'))} colocated on 1 thread")
    target = itl_target(runs)
    good = {mode: {n: statistics.median(goodput(r[f"mix_{n}"], target) for r in runs[mode]) for n in s["mixes"]}
            for mode in MODES}
    ratios = {n: statistics.median(goodput_ratios(runs, n, target)) for n in s["mixes"]}
    pays = [n for n in s["mixes"] if ratios[n] > GOODPUT_LINE]
    verdict.notes.append(
        f"where it pays, on this machine: under a {ms(target)} ITL target, disaggregated goodput ÷ best colocated "
        f"is {', '.join(f'{ratios[n]:.2f} at {n}' for n in s['mixes'])} long prompts per stream life (medians of "
        f"rounds); " + (f"it first passes 1 at {pays[0]}" if pays else "it never passes 1 in the mixes measured"))
    print_verdict(verdict)
    return verdict, {"long_prompt_bytes": long_bytes, "long_transfer_s": transfer_s,
                     "fitted_bandwidth_Bps": bandwidth,
                     "itl_target_s": target, "goodput_tokens_per_s": good, "goodput_ratio_median": ratios,
                     "goodput_first_mix_where_disaggregated_wins": pays[0] if pays else None}


def plot(lesson, s: dict, runs: dict, read: dict, verdict) -> None:
    good, target = read["goodput_tokens_per_s"], read["itl_target_s"]
    fig, grid = plt.subplots(2, 2, figsize=(14, 10))
    axes = [grid[0][0], grid[0][1], grid[1][1]]
    for m in MODES:
        grid[1][0].plot(s["mixes"], [good[m][n] for n in s["mixes"]], "o-", label=m)
    grid[1][0].set(xlabel="long prompts per stream lifetime (the load mix)", xticks=s["mixes"],
                   ylabel=f"stream tokens/s within {ms(target)} of the one before (median of rounds)",
                   title=f"goodput under a tight ITL target ({TARGET:g}× the fastest ITL with none)")
    grid[1][0].legend(fontsize=8)
    x = range(len(MODES))
    for key, offset, label in (("itl_before_median_s", -0.2, "median ITL before"),
                               ("window_p99_itl_s", 0.2, "p99 ITL in the long prompt's window")):
        vals = [[1e3 * r[key] for r in runs[m]] for m in TRACED]
        meds = [statistics.median(v) for v in vals]
        axes[0].bar([i + offset for i in range(len(TRACED))], meds, 0.4, label=label,
                    yerr=[[m - min(v) for m, v in zip(meds, vals)], [max(v) - m for m, v in zip(meds, vals)]])
    axes[0].set_xticks(list(range(len(TRACED))), TRACED, fontsize=8)
    axes[0].set(ylabel="ms (median of the rounds; bars: their range)", title="the streams' inter-token latency")
    axes[0].legend(fontsize=8)
    vals = [[r["throughput"] for r in runs[m]] for m in MODES]
    axes[1].bar(list(x), [statistics.median(v) for v in vals], 0.6, color="C2")
    for i, v in enumerate(vals):
        axes[1].plot([i] * len(v), v, "k.")
    axes[1].set_xticks(list(x), MODES, fontsize=8)
    axes[1].set(ylabel="generated tokens/s (bar: median; dots: rounds)", title="a saturating burst")
    plot_checks(axes[2], verdict)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    s = sizes(lesson.config.n_ctx, args.quick)
    cost = predict_transfer(lesson, s)
    m = measure(lesson, s, cost["moved"])
    verdict, read = judge_claim(lesson, s, m, cost)
    plot(lesson, s, m["runs"], read, verdict)
    figures = {"setup": s, "kv_bytes_per_token": cost["per_token"], "bytes_moved_per_round": cost["moved"],
               "runs": m["runs"], **read, "workers_after": m["stats"], "startup_s": m["startup_s"]}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
