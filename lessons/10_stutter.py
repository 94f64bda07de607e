"""Lesson 10: stutter. A long prompt freezes every running stream, unless its prefill is chunked.

The claim
---------
An engine that prefills every prompt whole, ahead of the decodes, stops all
running streams for as long as a long prompt's forward pass takes: a 900-token
prefill of gpt2 costs as much as many decode steps, and every user watching
text appear sees it stall. Sarathi-Serve calls this a generation stall.
Chunked prefill (`minillm/chunked_prefill.py`) fixes it: every step first gives
each running decode its token, then fills what is left of a token budget,
`max_num_batched_tokens`, with chunks of pending prompts. A stream's worst gap
then is one step of at most `max_num_batched_tokens` tokens:

    unchunked:  worst ITL ≈ t(prefill of the long prompt) + t(decode step)
    chunked:    worst ITL ≈ t(step of max_num_batched_tokens tokens)

and the total work is the same, so throughput should barely move. Here the two
metrics of lesson 02 part ways: chunking shortens the streams' inter-token
latency (ITL) and lengthens the long request's time to first token (TTFT), as
its prompt now shares steps with the decodes.

What this lesson measures
-------------------------
K = 4 streams with short prompts decode greedily; once each has emitted `warm`
tokens, a long prompt of P tokens arrives (900 on gpt2; 512 with --quick). The
trace runs without chunking (budget 2048, which holds the long request whole)
and with chunking at budget B, alternating, five rounds each. B is sized from
the target before anything is measured, as Sarathi-Serve sizes its token
budget from a latency target: where step time grows with the tokens in the
step, cutting the stall k-fold needs chunks of about P/k, and we halve that for
the decodes and the re-read earlier chunks that ride along: B = the power of
two ≤ P / (2k) (128 for P = 900, 64 for P = 512, with k = 3). The full run
also tries 2B and 4B, to show where the line is crossed. From each request's
token times: the streams' max ITL over the gaps that overlap the long prompt's
prefill, the long request's TTFT, and throughput (generated tokens / makespan).

The cost model, before anything is served: a step of n new tokens takes
t(n) = t_fixed + max(FLOPs/peak, bytes/bandwidth) on the measured ceilings
(t_fixed: the engine's decode step, the streams served alone first, less its
roofline time). The stall cut is (t(P) + t(K)) ÷ t(B + K). Chunking swaps
the P-token step and ⌈P/B⌉ decode steps for ⌈P/B⌉ steps of a chunk and the
decodes: while those are memory-bound the chunks ride on weight reads the
decodes pay anyway, so throughput need not fall at all.

The verdict, round by round: the chunked max ITL is at most 1/3 of the
unchunked one (predicted: the model's cut); and the mechanism: chunked
throughput ÷ unchunked is at least the cost model's ratio with every chunk
step at half its ceiling (twice its predicted time) and every other step at
its ceiling: the room the model's own uncertainty leaves, printed with the
line. Below it, chunking costs something the model leaves out.

Predict before you run: how long is the worst gap with chunks of 128 tokens,
as a share of the unchunked stall? What happens to the long prompt's TTFT?
"""
from __future__ import annotations

import math
import statistics

from common import make_parser, ms, plt, predict, print_table, run, save_plot, start, write_results
from minillm.bench.cost import decode_cost, prefill_cost, step_cost
from minillm.bench.verdict import Check, interleave, judge, print_verdict, settled
from minillm.bench.replay import greedy, percentile, replay
from minillm.bench.workloads import Request, pool_blocks
import numpy as np
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig

NAME = "10_stutter"
STUTTER_FACTOR = 3.0          # chunked max ITL must be ≤ unchunked max ITL / 3
CHUNK_SLOWDOWN = 2.0          # the throughput line: chunk steps at most this × their predicted time (½ the ceiling)
UNCHUNKED_BUDGET = 2048       # vLLM without chunking: max(max_model_len, 2048)


def sized_budget(long_prompt: int, factor: float = STUTTER_FACTOR, floor: int = 8) -> int:
    """The chunk budget for a k-fold shorter stall: the power of two ≤ P / (2k), at least `floor`."""
    return max(floor, 2 ** int(math.log2(max(1.0, long_prompt / (2 * factor)))))


def trace(model, s: dict) -> tuple[list, list, int]:
    """The K streams, the long prompt, and the KV blocks that hold them all."""
    rng = np.random.default_rng(0)
    streams = [Request(rng.integers(0, model.config.vocab_size, s["stream_prompt"]).tolist(), s["stream_tokens"])
               for _ in range(s["streams"])]
    long_prompt = rng.integers(0, model.config.vocab_size, s["long_prompt"]).tolist()
    return streams, long_prompt, pool_blocks(streams + [Request(long_prompt, s["long_tokens"])])


def engine_for(model, s: dict, chunked: bool, budget: int, blocks: int) -> LLMEngine:
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=s["streams"] + 1,
                                            enable_chunked_prefill=chunked), CacheConfig(num_gpu_blocks_override=blocks))


def engine_step_s(model, s: dict) -> float:
    """The engine's own decode step, calibrated before the lesson measures: the streams served alone (no long
    prompt), twice, the median gap between their tokens in the second run."""
    streams, _, blocks = trace(model, s)
    for _ in range(2):
        served = replay(engine_for(model, s, False, UNCHUNKED_BUDGET, blocks), streams)
    times = [served.outputs[str(i)].metrics.token_times for i in range(s["streams"])]
    return statistics.median(b - a for t in times for a, b in zip(t, t[1:]))


def stutter_run(model, s: dict, chunked: bool, budget: int):
    """A function that serves the stutter trace once: K streams, then the long prompt once each has `warm` tokens."""
    streams, long_prompt, blocks = trace(model, s)

    def serve() -> dict:
        engine = engine_for(model, s, chunked, budget, blocks)
        emitted = {}

        def arrive(engine, outputs):
            emitted.update((o.request_id, len(o.output_token_ids)) for o in outputs)
            if "long" not in emitted and all(emitted.get(str(i), 0) >= s["warm"] for i in range(s["streams"])):
                engine.add_request(long_prompt, greedy(s["long_tokens"]), request_id="long")
                emitted["long"] = 0

        served = replay(engine, streams, on_step=arrive)
        return analyse_stutter([served.outputs[str(i)].metrics for i in range(s["streams"])],
                               served.outputs["long"].metrics, served.generated)
    return serve


def analyse_stutter(stream_metrics: list, long_metrics, generated: int) -> dict:
    """ITLs of the streams around the long prompt's arrival; times are relative to that arrival."""
    arrival, first = long_metrics.arrival_time, long_metrics.first_token_time
    gaps = [(a, b) for m in stream_metrics for a, b in zip(m.token_times, m.token_times[1:])]
    window = [b - a for a, b in gaps if b > arrival and a < first]  # gaps that overlap the long prefill
    before = [b - a for a, b in gaps if b <= arrival]
    t_start = min(m.arrival_time for m in stream_metrics)
    t_end = max(m.token_times[-1] for m in [*stream_metrics, long_metrics])
    return {"window_max_itl_s": max(window), "window_p99_itl_s": percentile(window, 99),
            "window_itls": len(window), "itl_before_median_s": statistics.median(before) if before else float("nan"),
            "long_ttft_s": long_metrics.ttft, "makespan_s": t_end - t_start, "generated_tokens": generated,
            "throughput": generated / (t_end - t_start),
            "requests": [{"arrival": m.arrival_time - arrival, "tokens": [t - arrival for t in m.token_times]}
                         for m in [*stream_metrics, long_metrics]]}


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"streams": 4, "stream_prompt": 8, "warm": 4, "stream_tokens": 20, "long_prompt": min(512, n_ctx - 28),
                "long_tokens": 4, "repeats": 5, "multiples": [1]}
    return {"streams": 4, "stream_prompt": 32, "warm": 8, "stream_tokens": 32, "long_prompt": min(900, n_ctx - 24),
            "long_tokens": 8, "repeats": 5, "multiples": [1, 2, 4]}


def timeline(ax, run: dict, title: str) -> None:
    """One row per request: its arrival, its first token (TTFT ends), and every later token (ITL between)."""
    for i, r in enumerate(run["requests"]):
        color = "C3" if i == len(run["requests"]) - 1 else "C0"
        ax.plot([r["arrival"], r["tokens"][0]], [i, i], color=color, lw=1, ls=":")
        ax.plot(r["tokens"], [i] * len(r["tokens"]), "|", color=color, ms=10)
        ax.plot(r["arrival"], i, "o", mfc="none", color=color)
        ax.plot(r["tokens"][0], i, ">", color=color)
    ax.axvline(0, color="k", lw=0.5)
    ax.set_yticks(range(len(run["requests"])), [f"stream {i}" for i in range(len(run["requests"]) - 1)] + ["long"])
    ax.set(xlabel="seconds since the long prompt arrived  (o arrival, ▶ first token, | each token)", title=title)


def predict_stall(lesson, s: dict, B: int) -> dict:
    """The cost model before serving: each step's time on the measured ceilings plus a fixed cost; from them the
    stall cut, the throughput ratio, and the throughput line (chunk steps at twice their predicted time)."""
    cfg, dtype, ceil, K, P = lesson.config, lesson.dtype, lesson.ceilings, s["streams"], s["long_prompt"]
    roof = lambda c: max(c.flops / ceil.matmul_flops, c.bytes / ceil.bandwidth)  # noqa: E731
    ctx = s["stream_prompt"] + s["warm"]  # the streams' context when the long prompt arrives
    decode = decode_cost(cfg, ctx, K, dtype)
    fixed = max(0.0, engine_step_s(lesson.model, s) - roof(decode))
    t = lambda c: fixed + roof(c)  # noqa: E731
    chunks = -(-P // B)
    t_chunk = statistics.mean(t(step_cost(cfg, [min(B, P - i * B)] + [1] * K, [i * B] + [ctx] * K, dtype))
                              for i in range(chunks))
    before = t(prefill_cost(cfg, s["stream_prompt"], K, dtype)) + max(0, s["stream_tokens"] - 1 - chunks) * t(decode)
    unchunked = before + chunks * t(decode) + t(prefill_cost(cfg, P, 1, dtype))
    f = {"fixed_s": fixed, "chunks": chunks, "chunk_step_s": t_chunk, "decode_step_s": t(decode),
         "stall_cut": (t(prefill_cost(cfg, P, 1, dtype)) + t(decode)) / t_chunk,
         "throughput_kept": unchunked / (before + chunks * t_chunk),
         "throughput_line": unchunked / (before + CHUNK_SLOWDOWN * chunks * t_chunk)}
    predict(lesson, f"unchunked, the {P}-token prompt is prefilled in one step that every stream waits for; chunked "
            f"at {B} tokens it takes {chunks} steps of about {ms(t_chunk)} each (a step of the engine costs a fixed "
            f"{ms(fixed)}, its streams' decode step less its roofline time, plus its roofline time), each a stream's gap: the worst gap shrinks {f['stall_cut']:.1f}-fold (the "
            f"line: {STUTTER_FACTOR:g})", f"and the {chunks} chunk steps replace a plain decode step "
            f"({ms(t(decode))}) each and the whole prefill: throughput × {f['throughput_kept']:.2f}; were every chunk "
            f"step {CHUNK_SLOWDOWN:g}× slower than that, × {f['throughput_line']:.2f} (the line)",
            expect={"stall_cut": f["stall_cut"], "throughput_kept": f["throughput_kept"]})
    return f


def checks(figures: dict) -> list[Check]:
    """Per round: the worst stall unchunked ÷ chunked at budget B, and chunked throughput ÷ unchunked, each against
    the cost model's prediction; the throughput against the model's line."""
    B, P, pred = figures["setup"]["chunk_budget"], figures["setup"]["long_prompt"], figures["predicted"]
    base, chosen = figures["runs"]["unchunked"], figures["runs"][f"chunked {B}"]
    m = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    return [Check(f"unchunked max ITL ÷ chunked max ITL, budget {B}",
                  [u["window_max_itl_s"] / c["window_max_itl_s"] for u, c in zip(base, chosen)], STUTTER_FACTOR,
                  ">=", fmt="{:.2f}", predicted=pred["stall_cut"], key="stall_cut",
                  why=f"the worst gap fell from {ms(m(base, 'window_max_itl_s'))} to "
                      f"{ms(m(chosen, 'window_max_itl_s'))}, while a gap without any prefill was "
                      f"{ms(m(chosen, 'itl_before_median_s'))}: a {B}-token chunk costs "
                      f"{m(chosen, 'window_max_itl_s') / m(chosen, 'itl_before_median_s'):.1f}× a plain decode "
                      f"step, and the whole {P}-token prefill "
                      f"{m(base, 'window_max_itl_s') / m(chosen, 'itl_before_median_s'):.1f}×: a step's time "
                      "grows more slowly than its tokens here (fixed per-step costs)"),
            Check(f"chunked throughput ÷ unchunked, budget {B} (line: chunk steps at {CHUNK_SLOWDOWN:g}× the model's)",
                  [c["throughput"] / u["throughput"] for u, c in zip(base, chosen)], pred["throughput_line"],
                  ">=", fmt="{:.2f}", predicted=pred["throughput_kept"], key="throughput_kept",
                  why=f"chunked served {m(chosen, 'throughput'):.1f} tokens/s against {m(base, 'throughput'):.1f}: "
                      f"the {-(-P // B)} chunks took {ms(m(chosen, 'long_ttft_s'))} to the long prompt's first "
                      f"token against {ms(m(base, 'long_ttft_s'))} in one step, more than {CHUNK_SLOWDOWN:g}× the "
                      f"model's {ms(pred['chunk_step_s'])} a chunk step: a cost per chunk the model leaves out")]


def run_figures(rounds, s: dict, B: int, predicted: dict) -> dict:
    """The figures the checks read, from the rounds so far."""
    return {"setup": {**s, "chunk_budget": B}, "predicted": predicted,
            "runs": {mode: rounds.results(mode) for mode in rounds.names}}


def measure(lesson, s: dict, B: int, modes: dict, predicted: dict):
    """Every mode's stutter run, in turns, until both checks are decided; a table of their medians."""
    stutter_run(lesson.model, s, True, B)()  # warm-up, untimed
    rounds = interleave({mode: stutter_run(lesson.model, s, *cfg) for mode, cfg in modes.items()}, s["repeats"],
                        warmup=0, device=lesson.device, desc="unchunked and chunked, in turns",
                        until=settled(lambda r: checks(run_figures(r, s, B, predicted))))
    runs = {mode: rounds.results(mode) for mode in modes}
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    print_table(["mode", "budget", "max ITL in window", "÷ unchunked", "p99 ITL in window", "ITL before",
                 "long TTFT", "tokens/s"],
                [[mode, budget, ms(med(mode, "window_max_itl_s")),
                  f"1/{med('unchunked', 'window_max_itl_s') / med(mode, 'window_max_itl_s'):.1f}",
                  ms(med(mode, "window_p99_itl_s")), ms(med(mode, "itl_before_median_s")), ms(med(mode, "long_ttft_s")),
                  f"{med(mode, 'throughput'):.1f}"] for mode, (_, budget) in modes.items()],
                f"{s['streams']} streams decoding when a {s['long_prompt']}-token prompt arrives "
                f"(medians of {rounds.count} rounds):")
    return rounds, runs


def judge_claim(lesson, s: dict, B: int, modes: dict, rounds, figures: dict):
    runs = figures["runs"]
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    verdict = judge(f"chunked prefill at max_num_batched_tokens={B} (sized before measuring: the power of two ≤ "
                    f"P/(2·{STUTTER_FACTOR:g}) for P = {s['long_prompt']}) cuts the streams' worst stall at least "
                    f"{STUTTER_FACTOR:g}-fold, and costs no more throughput than its cost model allows",
                    checks(figures), lesson.load(), [rounds])
    verdict.notes.append(f"the long request's TTFT: {ms(med('unchunked', 'long_ttft_s'))} unchunked, "
                         f"{ms(med(f'chunked {B}', 'long_ttft_s'))} chunked: what the streams gain, it pays")
    if len(modes) > 2:
        verdict.notes.append("the worst gap grows with the budget: " + ", ".join(
            f"{mode} → 1/{med('unchunked', 'window_max_itl_s') / med(mode, 'window_max_itl_s'):.1f}"
            for mode in list(modes)[1:]))
    print_verdict(verdict)
    return verdict


def plot(lesson, B: int, modes: dict, runs: dict, verdict) -> int:
    base, chosen, checks = runs["unchunked"], runs[f"chunked {B}"], verdict.checks
    stall = checks[0].values
    k = sorted(range(len(stall)), key=stall.__getitem__)[(len(stall) - 1) // 2]  # the round of the median stall ratio
    shown = f"round {k + 1} of {len(stall)}, the median"
    fig, axes = plt.subplots(2, 2, figsize=(14, 9.6))
    timeline(axes[0, 0], base[k], f"unchunked, budget {modes['unchunked'][1]} ({shown})")
    timeline(axes[0, 1], chosen[k], f"chunked at {B} ({shown})")
    right = max(max(r["tokens"][-1] for r in run["requests"]) for run in (base[k], chosen[k]))
    left = min(r["arrival"] for r in base[k]["requests"])
    for ax in axes[0]:
        ax.set_xlim(left - 0.05 * (right - left), right + 0.05 * (right - left))
    for mode, color in (("unchunked", "C3"), (f"chunked {B}", "C0")):
        run = runs[mode][k]
        itls = [(b, b - a) for r in run["requests"][:-1] for a, b in zip(r["tokens"], r["tokens"][1:])]
        axes[1, 0].plot([t for t, _ in itls], [1e3 * x for _, x in itls], ".", color=color,
                        label=f"{mode}: max {ms(run['window_max_itl_s'])} while the long prompt is prefilled")
        axes[1, 0].axvline(run["requests"][-1]["tokens"][0], color=color, ls=":", lw=1)
    axes[1, 0].axvline(0, color="k", lw=0.5)
    axes[1, 0].set(xlabel="seconds since the long prompt arrived (dotted: its first token)",
                   ylabel="gap before each stream token (ms)", title=f"inter-token latency of the streams ({shown})",
                   ylim=(0, None))
    names = list(modes)
    ratios = [[u["window_max_itl_s"] / c["window_max_itl_s"] for u, c in zip(base, runs[m])] for m in names[1:]]
    bars = [(f"stall cut\n{m}", r, STUTTER_FACTOR) for m, r in zip(names[1:], ratios)]
    bars.append((f"throughput kept\nchunked {B}", checks[1].values, checks[1].line))
    ax = axes[1, 1]
    for i, (label, values, line) in enumerate(bars):
        m = statistics.median(values)
        ax.bar(i, m, 0.6, yerr=[[m - min(values)], [max(values) - m]], capsize=4,
               color="C0" if i < len(bars) - 1 else "C2")
        ax.plot([i - 0.4, i + 0.4], [line, line], "k:", lw=2, label="the claim's line (≥)" if i == 0 else None)
        if i in (0, len(bars) - 1):  # the cost model's prediction of the judged ratios
            ax.plot([i], [checks[0 if i == 0 else 1].predicted], "x", color="navy", ms=9,
                    label="predicted before serving" if i == 0 else None)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set(ylabel="ratio (median; bars: range of the rounds)",
           title=f"the two checks ({len(stall)} rounds)")
    ax.legend(fontsize=8, loc="upper right")
    axes[1, 0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    save_plot(lesson, fig, verdict)
    return k + 1  # the round the panels draw, counted from 1: a figure of the JSON too


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    B = sized_budget(s["long_prompt"])
    modes = {"unchunked": (False, max(UNCHUNKED_BUDGET, s["long_prompt"] + s["long_tokens"]))}
    modes |= {f"chunked {m * B}": (True, m * B) for m in s["multiples"]}
    predicted = predict_stall(lesson, s, B)
    rounds, runs = measure(lesson, s, B, modes, predicted)
    figures = run_figures(rounds, s, B, predicted)
    figures["setup"]["modes"] = {m: {"chunked": c, "budget": b} for m, (c, b) in modes.items()}
    verdict = judge_claim(lesson, s, B, modes, rounds, figures)
    figures["median_round"] = plot(lesson, B, modes, runs, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
