"""Lesson 12: goodput. Chunked prefill raises the request rate a server sustains under latency targets.

The claim
---------
A user is served well when the first token comes soon (TTFT) and the text then never stalls (every inter-token gap,
ITL, short). Goodput counts only those requests: the rate of requests that met *both* targets (DistServe; the
course's one definition, `minillm/bench/goodput.py`, which lesson 15 uses too). Under a mix of long prompts and
running streams, a server that prefills each prompt whole stalls every stream for that prefill (lesson 10), so as
the request rate grows more and more streams miss the ITL target, while throughput hardly changes. Chunked prefill
bounds the stall by one step of `max_num_batched_tokens` tokens, so the same server meets the targets up to a higher
rate (Sarathi-Serve: 2.6× the capacity of vLLM for Mistral-7B under a P99 target), here on this device, over HTTP.

What this lesson measures
-------------------------
1. Two servers (`python -m minillm serve`, one with chunked prefill at a budget of a quarter of the long prompt,
   one without), each in its own process on 127.0.0.1, each logging the engine's own record of every request.
2. Step costs, as the served engine records them, before the sweep: a decode step of STREAMS sequences (the median
   gap between their tokens), the long prompt's prefill served alone (each the least of 3 rounds), and the capacity
   (requests/s, the whole trace sent at once). The targets follow, k and m fixed here, printed before the sweep:

       ITL target  = k · t(decode step of STREAMS sequences)     k = 3
       TTFT target = m · t(prefill of the long prompt)            m = 3

   and the rates follow from the prediction below: equal ratios from just under unchunked's predicted knee to 3/4
   of the capacity. A request meets the ITL target when every one of its gaps does: a stall is what its user sees.
3. At each rate a seeded trace (Poisson arrivals; short prompts, and a share LONG_SHARE of long ones) is replayed
   against each server in turn by `bench-serve`'s client code, which times every token as it arrives. The sweep is
   repeated, the order reversed every other time. For each mode and sweep: the highest rate with goodput ≥ 90%.

On a CPU the lesson serves the `mini` shape, whatever --model says: the claim is about scheduling, not weights,
and on one core gpt2's chunk of a long prompt outlasts the ITL target (the model predicts no gain), while its knee,
∝ 1/(output · decode step), sits where a rate's arrivals take minutes. The lesson prints its expected time first.

Before sweeping, the lesson predicts each mode's highest sustained rate from the step costs: a stream misses the ITL
target when a step that carries a prefill is longer than the target (unchunked: the whole long prefill + a decode
step; chunked: a chunk of the budget + a decode step, the prefill's time in proportion to its tokens), and at a
rate λ a request decoding for D = output · decode step sees no long prompt arrive with probability
exp(−λ · LONG_SHARE · D) (Poisson arrivals), ≥ 90% up to the knee λ* = ln(1/0.9) / (LONG_SHARE · D). The goodput
share predicted at each rate is that probability when the mode's stall misses the target, else 1 (queueing
ignored: the rates stay under the capacity); each mode's predicted highest sustained rate is the grid's highest
with a share ≥ 90%, the prediction chunked's ÷ unchunked's.

The verdict, one value per sweep: chunked's highest rate ÷ unchunked's lies within one step of the rate grid of the
prediction (the band: a rate read off a grid is known to one step either way), and chunked output throughput at the
top rate is at least 90% of unchunked's (predicted 1: under the capacity, each serves what arrives). Sarathi-Serve's
2.6× is the paper's figure, printed as context. Sweeps are rounds (at least five): while a check straddles its line,
more are run, up to a printed cap. The client and the server it times each need a core: when other programs leave
fewer free, both checks are INCONCLUSIVE whatever their intervals (the OS's time slices last as long as the target).

Also measured: what HTTP adds. Each server logs the engine's own record of every request (`--request-log`); the
client's TTFT minus the engine's (the request's way in, through the JSON parser, and the first token's way out),
and the delay of every token from the moment the engine sampled it to the moment the client read its event (the
thread hop, the decode, the JSON, the event stream and the loopback), on the one clock both processes share.

Predict before you run: at a rate where half the unchunked requests miss, how much lower is unchunked throughput?
"""
from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import tempfile
import time
from pathlib import Path

from common import make_parser, ms, plt, predict, print_table, run, save_plot, start, write_results
from servers import NEEDED_CORES, free_cores, http_cost, read_records, servers, starved, step_costs
from minillm.bench.verdict import ADDED_TIME, MIN_ROUNDS, Check, interleave, judge, print_verdict, settled
from minillm.bench.goodput import goodput

import numpy as np

from minillm.bench.serve import benchmark, summarize
from minillm.bench.workloads import Workload
from minillm.device import resolve_device

NAME = "12_goodput"
K_ITL, M_TTFT = 3.0, 3.0     # ITL target = k · decode step; TTFT target = m · prefill of the long prompt
STREAMS = 4                  # the decode step the ITL target is scaled from: this many sequences
LONG_SHARE = 0.25            # share of requests with a long prompt
GOOD_SHARE = 0.90            # a rate is sustained when at least this share of its requests meet both targets
THROUGHPUT_LINE = 0.90       # chunked output throughput ÷ unchunked's at the top rate (predicted 1)
SARATHI = "Sarathi-Serve: 2.6× the capacity of vLLM for Mistral-7B under a P99 target"
UNCHUNKED_BUDGET = 2048      # vLLM without chunking: max(max_model_len, 2048)
CPU_MODEL = "mini"           # on a CPU the lesson serves this shape, whatever --model says (the docstring says why)
BELOW_KNEE = 0.7             # the lowest rate: this share of unchunked's predicted knee, at most half the top rate
TOP_SHARE = 0.75             # the top rate: this share of the capacity (the model ignores queueing)
MODES = ("chunked", "unchunked")


def sizes(n_ctx: int, quick: bool) -> dict:
    long = min(3 * n_ctx // 4, 512)
    if quick:
        return {"requests": 12, "short": 16, "long": long, "output": 16, "rates": 3, "sweeps": 3}
    return {"requests": 28, "short": 32, "long": long, "output": 32, "rates": 5, "sweeps": 5}


def rate_grid(knee: float, capacity: float, n: int) -> list[float]:
    """`n` rates in equal ratios from BELOW_KNEE × the knee (at most half the top) to TOP_SHARE × the capacity."""
    low, top = min(BELOW_KNEE * knee, TOP_SHARE * capacity / 2), TOP_SHARE * capacity
    return [float(f"{low * (top / low) ** (i / (n - 1)):.3g}") for i in range(n)]


def highest_sustained(points: list[dict], rates: list[float]) -> float:
    """The highest rate whose goodput share is ≥ GOOD_SHARE; half the lowest rate when none is."""
    good = [r for r, p in zip(rates, points) if p["goodput_share"] >= GOOD_SHARE]
    return max(good) if good else rates[0] / 2


def plan(lesson, urls: dict, logs: Path, work: Workload, s: dict) -> dict:
    """Warm both servers; the step costs the unchunked one's engine records, and from them the targets and the rates
    to sweep, printed before anything is swept."""
    for url in urls.values():  # untimed: the first requests pay one-off costs
        asyncio.run(benchmark(url, work.requests(float("inf"))[:4], show_progress=False))
    cost, budget = step_costs(urls["unchunked"], logs / "unchunked.jsonl", work, s, STREAMS), chunked_budget(s)
    targets = {"ttft": M_TTFT * cost["prefill_long"], "itl": K_ITL * cost["decode"]}
    stall, life = cost["prefill_long"] + cost["decode"], s["output"] * cost["decode"]
    knee = unchunked_knee(stall, life, targets["itl"])
    rates = rate_grid(knee, cost["capacity"], s["rates"])
    arrivals = [len(MODES) * work.requests(r)[-1].arrival_s for r in rates]  # the trace's last arrival, both servers
    sweep_s, sweeps = sum(arrivals) + len(MODES) * len(rates) * (life + stall), max(s["sweeps"], MIN_ROUNDS)
    print(f"as the served engine records them: a decode step of {STREAMS} sequences {ms(cost['decode'])}, the prefill "
          f"of {s['long']} tokens {ms(cost['prefill_long'])}; the whole trace at once: {cost['capacity']:.1f} requests/s")
    print(f"targets: ITL ≤ k · decode = {K_ITL:g} · {ms(cost['decode'])} = {ms(targets['itl'])} (every gap); "
          f"TTFT ≤ m · long prefill = {M_TTFT:g} · {ms(cost['prefill_long'])} = {ms(targets['ttft'])}")
    print(f"rates: {', '.join(f'{r:g}' for r in rates)} requests/s, in equal ratios from {BELOW_KNEE:g} × "
          f"unchunked's predicted knee λ* = {knee:.3g}/s (at most half the top) to {TOP_SHARE:g} × the "
          f"capacity; chunked budget {budget} tokens; {s['requests']} requests per point, {LONG_SHARE:.0%} with "
          f"{s['long']}-token prompts, the rest {s['short']}; {s['output']} tokens out\nexpected: a sweep of both "
          f"servers {sweep_s:.0f} s (arrivals {' + '.join(f'{a:.0f}' for a in arrivals)} s by rate, each point's drain "
          f"a request's life and a prefill), {sweeps} sweeps {sweeps * sweep_s / 60:.1f} min; while a check straddles "
          f"its line more run, for at most {ADDED_TIME:g}× that again\n")
    p = {"s": s, "budget": budget, "cost": cost, "targets": targets, "rates": rates, "stall": stall,
         "expected_sweep_s": sweep_s, "expected_s": sweeps * sweep_s}
    p["predicted"] = predict_rates(p)
    pr = p["predicted"]
    predict(lesson, f"a step carrying a prefill lasts {ms(pr['stall_s']['unchunked'])} unchunked and "
          f"{ms(pr['stall_s']['chunked'])} chunked, against the ITL target {ms(targets['itl'])}; a request decoding "
          f"for {ms(pr['life_s'])} sees no long prompt arrive with probability exp(−λ · {LONG_SHARE:g} · "
          f"{pr['life_s']:.3g} s): goodput share by rate " + "; ".join(
              f"{m} " + ", ".join(f"{x:.0%}" for x in pr["share"][m]) for m in MODES)
          + f"; highest sustained {pr['highest']['chunked']:g} and {pr['highest']['unchunked']:g}/s, chunked ÷ "
          f"unchunked {pr['ratio']:.2f} (band {pr['band'][0]:.2f}–{pr['band'][1]:.2f}: one step of the rate grid); "
          "output throughput at the top rate, chunked ÷ unchunked, 1 (under the capacity each serves what arrives)",
          expect={"rate_gain_low": pr["ratio"], "rate_gain_high": pr["ratio"], "throughput_ratio": 1.0})
    return p


def unchunked_knee(stall: float, life: float, itl: float) -> float:
    """λ* = ln(1/GOOD_SHARE) / (LONG_SHARE · life): unchunked's share is ≥ GOOD_SHARE below it (inf: no stall)."""
    return math.log(1 / GOOD_SHARE) / (LONG_SHARE * life) if stall > itl else math.inf


def predict_rates(p: dict) -> dict:
    """Each mode's goodput share by rate and highest sustained rate, from the step costs (the docstring's model)."""
    s, cost, rates, itl = p["s"], p["cost"], p["rates"], p["targets"]["itl"]
    stall = {"unchunked": p["stall"], "chunked": cost["prefill_long"] * min(1, p["budget"] / s["long"]) + cost["decode"]}
    life = s["output"] * cost["decode"]
    share = {m: [1.0 if stall[m] <= itl else math.exp(-r * LONG_SHARE * life) for r in rates] for m in MODES}
    best = {m: highest_sustained([{"goodput_share": x} for x in share[m]], rates) for m in MODES}
    step = max(b / a for a, b in zip([rates[0] / 2] + rates, rates))  # the grid's widest step, "none" included
    ratio, knee = best["chunked"] / best["unchunked"], unchunked_knee(p["stall"], life, itl)
    return {"stall_s": stall, "life_s": life, "share": share, "highest": best, "ratio": ratio,
            "band": [ratio / step, ratio * step], "unchunked_knee_per_s": knee if math.isfinite(knee) else None}


def chunked_budget(s: dict) -> int:
    """The power of two ≤ a quarter of the long prompt."""
    return max(16, 1 << (s["long"] // 4).bit_length() - 1)


def sweep_figures(sweeps: list[dict], p: dict, undecided: str) -> dict:
    """What the checks read, from the sweeps so far: each sweep's highest sustained rate per mode, and chunked ÷
    unchunked output throughput at the top rate."""
    best = {m: [highest_sustained(w[m], p["rates"]) for w in sweeps] for m in MODES}
    return {"rates": p["rates"], "predicted": p["predicted"], "highest_sustained": best, "undecided": undecided,
            "top_rate_throughput_ratio": [w["chunked"][-1]["output_throughput"] / w["unchunked"][-1]["output_throughput"]
                                          for w in sweeps],
            "sweeps_same_sustained_rate": sum(c == u for c, u in zip(best["chunked"], best["unchunked"])),
            "step_costs_s": p["cost"], "targets_s": p["targets"], "chunked_budget": p["budget"], "sizes": p["s"]}


def checks(figures: dict) -> list[Check]:
    """Per sweep: chunked's highest sustained rate ÷ unchunked's, inside the predicted band (a check for each end),
    and their output throughput at the top rate."""
    f = figures
    pr, best, s, itl = f["predicted"], f["highest_sustained"], f["sizes"], f["targets_s"]["itl"]
    gains, stall = [c / u for c, u in zip(best["chunked"], best["unchunked"])], pr["stall_s"]
    why = (f"a step carrying a prefill lasts {ms(stall['unchunked'])} unchunked ({stall['unchunked'] / itl:.2f}× the "
           f"ITL target {ms(itl)}) and {ms(stall['chunked'])} chunked ({stall['chunked'] / itl:.2f}×), so the model "
           f"predicted {pr['ratio']:.2f}; both modes sustained the same rate of the {len(f['rates'])}-rate grid in "
           f"{f['sweeps_same_sustained_rate']} of {len(gains)} sweeps. {SARATHI}")
    name = f"highest rate with goodput ≥ {GOOD_SHARE:.0%}, chunked ÷ unchunked"
    return [Check(f"{name}, {end} end of the predicted band", gains, pr["band"][i], op, fmt="{:.2f}", why=why,
                  undecided=f["undecided"], predicted=pr["ratio"], key=f"rate_gain_{end}")
            for i, (end, op) in enumerate((("low", ">="), ("high", "<=")))] + [
        Check(f"output tokens/s at {f['rates'][-1]:g}/s, chunked ÷ unchunked", f["top_rate_throughput_ratio"],
              THROUGHPUT_LINE, ">=", fmt="{:.2f}", undecided=f["undecided"], predicted=1.0, key="throughput_ratio",
              why=f"chunks of {f['chunked_budget']} tokens split each {s['long']}-token prefill into "
                  f"{-(-s['long'] // f['chunked_budget'])} steps, and each step reads every weight once more")]


def measure(lesson, urls: dict, work: Workload, p: dict):
    """Sweeps of both servers at every rate, in turns; while a check straddles its line, more sweeps run, up to a
    cap the verdict prints. Returns the rounds and the client's results at the middle rate, last sweep."""
    kept, sweep_number, t0 = {}, itertools.count(), time.perf_counter()

    def sweep() -> dict:
        """Both servers at every rate, in turns (the order reversed at every other point): {mode: summaries}."""
        w, swept = next(sweep_number), {m: [] for m in MODES}
        for i, rate in enumerate(p["rates"]):
            trace = work.requests(rate)
            for mode in (MODES if (w + i) % 2 == 0 else MODES[::-1]):
                results, duration = asyncio.run(benchmark(urls[mode], trace, show_progress=False))
                swept[mode].append(point(results, duration, p["targets"]))
                if i == len(p["rates"]) // 2:
                    kept[mode] = results
            print(f"  sweep {w + 1}, {rate:g}/s ({time.perf_counter() - t0:.0f} s of {p['expected_s']:.0f} expected): "
                  + ", ".join(f"{m} goodput {swept[m][i]['goodput_share']:.0%}" for m in MODES), flush=True)
        return swept

    rounds = interleave({"sweep": sweep}, p["s"]["sweeps"], warmup=0, until=settled(lambda r: checks(
        sweep_figures(r.results("sweep"), p, starved(lesson.load(), p["targets"]["itl"])))))
    return rounds, kept


def judge_claim(lesson, rounds, kept: dict, p: dict, logs: Path):
    """The sweeps' medians, the checks, the notes (each sweep's sustained rate, what HTTP adds): verdict, figures."""
    rates, points = p["rates"], {m: [w[m] for w in rounds.results("sweep")] for m in MODES}
    med = lambda m, i, key: statistics.median(q[i][key] for q in points[m])  # noqa: E731
    print_table(["rate/s", *[f"{m} {c}" for m in MODES for c in ("goodput", "tok/s", "ITL p99", "TTFT p99")]],
                [[f"{r:g}", *[x for m in MODES for x in (f"{med(m, i, 'goodput_share'):.0%}",
                                                          f"{med(m, i, 'output_throughput'):.0f}",
                                                          ms(med(m, i, 'p99_itl_ms') / 1e3),
                                                          ms(med(m, i, 'p99_ttft_ms') / 1e3))]]
                 for i, r in enumerate(rates)],
                f"\nmedians over {rounds.describe()}, a round being one sweep; goodput = share of requests meeting "
                f"both targets (the verdict judges each sweep's own highest sustained rate, not these medians):")
    f = sweep_figures(rounds.results("sweep"), p, starved(lesson.load(), p["targets"]["itl"]))
    cost_http = {m: http_cost(kept[m], read_records(logs / f"{m}.jsonl")) for m in MODES}
    verdict = judge("chunked prefill raises the request rate that meets both the TTFT and the ITL target by what the "
                    "step costs predict, while throughput barely moves", checks(f), lesson.load(), [rounds])
    verdict.notes.append("highest sustained rate per sweep: " + "; ".join(
        f"{m} {', '.join(f'{b:g}' for b in f['highest_sustained'][m])}/s" for m in MODES)
        + " (half the lowest rate: none was)")
    for m, h in cost_http.items():
        verdict.notes.append(
            f"what HTTP adds ({m}, {rates[len(rates) // 2]:g}/s, {h['requests']} requests): TTFT "
            f"+{ms(h['ttft_added_p50_s'])} (p50), each token reaches the client {ms(h['delivery_p50_s'])} after the "
            f"engine sampled it (p50; p99 {ms(h['delivery_p99_s'])}); ITL p50 {ms(h['client_itl_p50_s'])} client vs "
            f"{ms(h['engine_itl_p50_s'])} engine, p99 {ms(h['client_itl_p99_s'])} vs {ms(h['engine_itl_p99_s'])}")
    print_verdict(verdict)
    return verdict, f | {"k_itl": K_ITL, "m_ttft": M_TTFT, "capacity_estimate": p["cost"]["capacity"],
                         "unchunked_stall_s": p["stall"], "stall_over_itl_target": p["stall"] / p["targets"]["itl"],
                         "points": points, "http_cost": cost_http, "free_cores_while_measuring": free_cores(verdict.load),
                         "cores_needed": NEEDED_CORES, "expected_sweep_s": p["expected_sweep_s"],
                         "sweep_s": rounds.seconds["sweep"]}


def point(results, duration: float, targets: dict) -> dict:
    """One rate's summary: bench-serve's numbers, and goodput by the course's one definition (bench/goodput.py)."""
    good = goodput([(r.ttft, r.itls) if r.success else None for r in results], duration, targets)
    return summarize(results, duration) | {"goodput_share": good["share"], "request_goodput": good["goodput"]}


def plot(lesson, f: dict, kept: dict, verdict) -> None:
    """Goodput per sweep (each sweep's highest sustained rate is what the verdict judges), throughput, the ITL CDF."""
    rates, targets, points, best = f["rates"], f["targets_s"], f["points"], f["highest_sustained"]
    med = lambda m, i, key: statistics.median(q[i][key] for q in points[m])  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    twin = ax1.twinx()
    for m, color in zip(MODES, ("C0", "C1")):
        for w, sweep in enumerate(points[m]):  # every sweep: the verdict's ratio is taken sweep by sweep
            ax1.plot(rates, [100 * q["goodput_share"] for q in sweep], "o-", color=color, alpha=0.35, lw=1,
                     label=f"{m}: goodput share, each sweep" if w == 0 else None)
        ax1.plot(best[m], [100 * GOOD_SHARE] * len(best[m]), "v", color=color, ms=10, alpha=0.6,
                 label=f"{m}: each sweep's highest sustained rate (none: half the lowest)")
        twin.plot(rates, [med(m, i, "output_throughput") for i in range(len(rates))], "s--", color=color,
                  alpha=0.6, label=f"{m}: output tokens/s (median)")
        itls = np.sort(np.concatenate([r.itls for r in kept[m] if r.success]) * 1e3)
        ax2.plot(itls, np.arange(1, len(itls) + 1) / len(itls), color=color, label=m)
    ax1.axhline(100 * GOOD_SHARE, color="grey", ls=":", label=f"{GOOD_SHARE:.0%} line")
    gain = verdict.checks[0]
    ax1.set(xlabel="request rate (requests/s)", ylabel="requests meeting both targets (%)", ylim=(0, 105),
            xlim=(0, rates[-1] * 1.05), title=f"goodput under TTFT ≤ {ms(targets['ttft'])}, ITL ≤ "
            f"{ms(targets['itl'])}\nhighest rate, chunked ÷ unchunked: {gain.median:.2f} (median of "
            f"{len(gain.values)} sweeps' ratios; predicted {gain.predicted:.2f})")
    twin.set(ylabel="output tokens/s (median of sweeps)", ylim=(0, twin.get_ylim()[1] * 1.05))
    ax1.legend(handles=ax1.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0], fontsize=7,
               loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2)  # below the axes, off the data
    ax2.axvline(targets["itl"] * 1e3, color="grey", ls=":", label=f"ITL target {ms(targets['itl'])}")
    ax2.set(xscale="log", xlabel="inter-token gap seen by the client (ms)", ylabel="share of gaps ≤ x",
            title=f"ITL CDF at {rates[len(rates) // 2]:g} requests/s (last sweep)")
    ax2.legend(fontsize=8)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    if resolve_device(args.device).type == "cpu":
        args.model = CPU_MODEL  # on one core gpt2's chunk outlasts the ITL target and its knee's arrivals take minutes
    lesson = start(NAME, args, ceilings=False)
    cfg, s, logs = lesson.config, sizes(lesson.config.n_ctx, args.quick), Path(tempfile.mkdtemp(prefix="lesson12-"))
    work = Workload("stutter", s["requests"], cfg.vocab_size, cfg.n_ctx, input_len=s["short"],
                    output_len=s["output"], long_prompt_len=s["long"], long_fraction=LONG_SHARE)
    budgets = {"chunked": (True, chunked_budget(s)),  # mode: (chunked prefill, max_num_batched_tokens)
               "unchunked": (False, max(UNCHUNKED_BUDGET, s["long"] + s["output"]))}
    with servers(args, budgets, logs) as urls:
        p = plan(lesson, urls, logs, work, s)           # step costs → the targets and the rates, printed first
        rounds, kept = measure(lesson, urls, work, p)
    verdict, figures = judge_claim(lesson, rounds, kept, p, logs)
    plot(lesson, figures, kept, verdict)
    write_results(lesson, figures, verdict)
    return {"verdict": verdict.as_dict(), "figures": figures}


if __name__ == "__main__":
    run(main)
