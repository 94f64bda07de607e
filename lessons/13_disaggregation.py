"""Lesson 13: disaggregation. Prefill and decode on separate workers: what it buys, and what it does not.

The claim
---------
Prefill is compute-bound and decode memory-bound (lesson 01), and one engine
serving both makes them interfere: a long prompt's prefill shares a step with
the running decodes, and every stream stalls (lesson 07). DistServe, Splitwise
and Mooncake, and vLLM's disaggregated prefill, run the phases on separate
workers and move each prompt's KV cache between them (`minillm/kv_connector.py`:
a prefill worker and a decode worker, each an `LLMEngine` in its own process on
its own core, joined by torch.distributed). Three predictions:

    interference    colocated, a long prompt raises the running streams' p99 ITL
                    (≥ 2× their ITL before it arrived); disaggregated, the decode
                    worker's ITL stays flat (≤ 1.5×) under the same load
    the transfer    every prompt moves prompt_len · 2 · n_layer · n_embd · dtype bytes,
                    exactly, and TTFT grows by those bytes over the link's bandwidth
    no free lunch   on the same cores and a saturating load, total tokens/s is not
                    higher disaggregated than colocated at its best thread setting
                    (1 or 2 threads, both measured): vLLM's documentation says
                    disaggregation "does not improve throughput"

What this lesson measures
-------------------------
Three servers, each in worker processes started once: colocated on both cores
with 1 thread, colocated with 2 threads, and disaggregated (prefill on one
core, decode on the other, one thread each). In every round each serves, in
turns, (1) lesson 07's trace (the two servers with one thread per engine): K streams decode, and once each has `warm`
tokens a long prompt of P tokens arrives (P = 512 on gpt2; 128 with --quick),
and (2) a burst of requests arriving together (all three). From the workers' own token
times: the streams' p99 ITL in the window from the long prompt's arrival to its
first token, their median ITL before it, the long request's TTFT (and,
disaggregated, its split into prefill and transfer), and the burst's tokens/s.
The bytes moved are counted by the connector. The verdict is taken round by
round: each ratio is computed within a round.

Predict before you run: how long does the transfer of a 128-token gpt2 prompt
take over loopback TCP (gloo), and how does that compare with its prefill?
"""
from __future__ import annotations

import functools
import statistics

from common import make_parser, ms, plot_checks, plt, predict, print_table, run, save_plot, start, write_results
from minillm.bench.disagg import build_model, burst, stall_trace
from minillm.bench.verdict import Check, interleave, judge, print_verdict, settled
from minillm.kv_connector import kv_bytes_per_token
from minillm.scheduler import SchedulerConfig
from minillm.serving.disaggregated import WorkerConfig, Workers, split_cores

NAME = "13_disaggregation"
STALL_LINE = 2.0   # colocated: window p99 ITL ÷ ITL before ≥ 2
FLAT_LINE = 1.5    # disaggregated: ≤ 1.5
THROUGHPUT_LINE = 1.0  # disaggregated tokens/s ÷ best colocated ≤ 1
MODES = ["colocated, 1 thread", "colocated, 2 threads", "disaggregated"]
TRACED = [MODES[0], MODES[2]]  # the stall trace: one thread per engine on both sides; the burst runs on all three


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"streams": 4, "stream_prompt": 8, "warm": 3, "stream_tokens": 12, "long_prompt": min(128, n_ctx - 8),
                "long_tokens": 2, "burst": 4, "burst_prompt": min(32, n_ctx - 16), "burst_tokens": 8, "repeats": 3}
    return {"streams": 4, "stream_prompt": 32, "warm": 6, "stream_tokens": 32, "long_prompt": min(512, n_ctx - 8),
            "long_tokens": 4, "burst": 8, "burst_prompt": min(128, n_ctx - 32), "burst_tokens": 32, "repeats": 5}


def start_workers(args, config, device: str) -> dict[str, Workers]:
    """The three servers, each in processes of its own, built from the same seeded model."""
    factory = functools.partial(build_model, args.model, device, args.dtype)
    first, second = split_cores()
    both = sorted(first + second)
    sched = SchedulerConfig(2048, 16)  # the engine's default budget: a long prompt shares one step with the decodes
    blocks = 256  # 4,096 tokens of KV per worker: room for every request of a round at once
    gpu = device.startswith("cuda")
    coloc = functools.partial(WorkerConfig, sched, num_blocks=blocks, device=device, cores=both)
    return {"colocated, 1 thread": Workers.colocated(factory, config, coloc()),
            "colocated, 2 threads": Workers.colocated(factory, config, coloc(threads=2)),
            "disaggregated": Workers.disaggregated(
                factory, config, WorkerConfig(sched, num_blocks=blocks, device="cuda:0" if gpu else device,
                                              cores=first),
                WorkerConfig(sched, num_blocks=blocks, device="cuda:1" if gpu else device, cores=second))}


def one_round(workers: Workers, s: dict, vocab: int, trace: bool = True) -> dict:
    """The stall trace (unless `trace` is False), then the burst; and the bytes the connector moved meanwhile."""
    before = workers.stats().get("prefill", {}).get("bytes_sent")
    out = (stall_trace(workers, s, vocab) if trace else {}) | burst(workers, s, vocab)
    out["bytes_sent"] = None if before is None else workers.stats()["prefill"]["bytes_sent"] - before
    return out


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    c = lesson.config
    s = sizes(c.n_ctx, args.quick)
    per_token = kv_bytes_per_token(c, lesson.dtype)
    moved = (s["streams"] * s["stream_prompt"] + s["long_prompt"] + s["burst"] * s["burst_prompt"]) * per_token
    predict(lesson, f"colocated, the {s['long_prompt']}-token prompt shares a step with {s['streams']} decodes: their "
            f"p99 ITL in its window ≥ {STALL_LINE:g}× their ITL before it; disaggregated ≤ {FLAT_LINE:g}×",
            f"each round moves exactly {moved:,} bytes ({per_token:,} per token: 2 · {c.n_layer} · {c.n_embd} · "
            f"{per_token // (2 * c.n_layer * c.n_embd)} bytes)",
            f"a saturating burst: disaggregated tokens/s ≤ {THROUGHPUT_LINE:g}× the best colocated")

    servers = start_workers(args, c, str(lesson.device))
    try:
        for w in servers.values():  # warm-up, untimed: the first forward passes of each worker
            burst(w, s | {"burst": 2, "burst_tokens": 2}, c.vocab_size)

        def make_checks(rounds) -> list[Check]:
            c1, c2, d = (rounds.results(m) for m in MODES)
            med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
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
                Check("bytes moved per round − Σ prompt_len · 2 · n_layer · n_embd · dtype bytes",
                      [abs(r["bytes_sent"] - moved) for r in d], 0, "<=", timed=False, fmt="{:.0f}",
                      why=f"the connector counted {d[0]['bytes_sent']:,} bytes against {moved:,}")]

        rounds = interleave({m: functools.partial(one_round, servers[m], s, c.vocab_size, m != MODES[1])
                             for m in MODES},
                            s["repeats"], warmup=0, device=lesson.device, desc="three servers, in turns",
                            until=settled(make_checks))
        stats = {m: w.stats() for m, w in servers.items()}
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
    checks = make_checks(rounds)
    verdict = judge(f"colocated, a long prompt raises the streams' p99 ITL ≥ {STALL_LINE:g}×; disaggregated, it "
                    f"stays ≤ {FLAT_LINE:g}×; the bytes moved are exactly 2·n_layer·n_embd·dtype bytes per prompt "
                    f"token; and disaggregation does not raise throughput", checks, lesson.load(), [rounds])
    transfer_s, long_bytes = med("disaggregated", "long_transfer_s"), s["long_prompt"] * per_token
    bandwidth = long_bytes / transfer_s
    verdict.notes.append(f"the transfer's price: the long prompt's {long_bytes:,} bytes landed "
                         f"{ms(transfer_s)} after its prefill worker sampled its first token, a link of "
                         f"{bandwidth / 1e6:.0f} MB/s fitted from this run; its TTFT was "
                         f"{ms(med('disaggregated', 'long_ttft_s'))} disaggregated against "
                         f"{ms(med('colocated, 1 thread', 'long_ttft_s'))} colocated on 1 thread")
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
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

    figures = {"setup": s, "kv_bytes_per_token": per_token, "bytes_moved_per_round": moved, "runs": runs,
               "long_prompt_bytes": long_bytes, "long_transfer_s": transfer_s, "fitted_bandwidth_Bps": bandwidth,
               "workers_after": stats}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
