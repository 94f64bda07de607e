"""Lesson 01: naive decode against the KV cache. Remembering K and V removes O(n²) work.

The claim
---------
A token's keys and values never change once computed. Naive decode throws them
away and recomputes every earlier token to emit the next one, so step n costs
about as much as a prefill of n tokens: per-token latency grows with position,
and N tokens cost O(N²) matmul work. With a KV cache, step n pushes one token
through the weights and only *reads* the n cached keys and values: per-token
latency stays almost flat. For P parameters and a prompt of p tokens,

    naive,  token i (i = 0 .. N−1):  a prefill of p + i tokens     ≈ 2·P·(p + i) FLOPs
    cached, token 0: a prefill of p tokens; token i ≥ 1: one token after p + i − 1 cached ones ≈ 2·P FLOPs

so naive decode's N tokens cost ≈ 2·P·(p·N + N²/2) FLOPs against ≈ 2·P·(p + N)
cached, and the cache changes nothing about *which* tokens come out: greedy
decoding must give identical tokens both ways.

What this lesson measures
-------------------------
- the latency of every generated token against its position, both ways, in
  rounds that alternate naive and cached runs;
- total time for N tokens and the speedup; the FLOPs naive decode wastes;
- the greedy tokens of both, for the timed prompt and for a batch of prompts of
  different lengths, compared one by one.

- one step of each kind at two context lengths, n and 8n (n_ctx/2 at most), in turns: a
  naive step (a prefill of the whole context) and a cached one (one token).

The cost model, evaluated before anything is timed: a step takes
t_fixed + max(FLOPs / peak, bytes / bandwidth), the roofline time on this
machine's measured ceilings plus a fixed cost per step (Python, the sampler,
launching each kernel; lesson 03 takes it apart), t_fixed being a one-token
step's measured time less its roofline time. It predicts the speedup over N
tokens and how much more a naive step grows than a cached one.

The verdict: no token differs (a count; predicted 0); the cache is faster over
N tokens; a naive step's cost grows with the context faster than a cached
step's, which is what makes N tokens O(N²) one way and O(N) the other; and the
mechanism: measured ÷ predicted speedup ≥ 0.5. The band is the cost model's
own uncertainty: it assumes every step runs at its ceiling, and a step's
kernels at these small shapes reach between half of it and all of it, so each
step takes 1–2× its predicted time and a ratio of two such sums lies within
0.5–2× of its prediction. A speedup above the model's is no fault of the
cache, so only the low side is judged. Each ratio is taken round by round.

Predict before you run: for N new tokens after a short prompt, how does the
speedup scale with N? What would 4× more tokens do to it?
"""
from __future__ import annotations

import statistics

from common import make_parser, ms, plot_checks, plt, predict, print_table, run, save_plot, si, start, write_results
from minillm.bench.verdict import Check, Fact, interleave, judge, print_verdict, settled

import torch

from minillm import kv_cache, naive_decode
from minillm.bench.cost import decode_cost, prefill_cost
from minillm.bench.steps import decode_step, prefill_step
from minillm.bench.timing import Stopwatch, time_fn
from minillm.sampling_params import SamplingParams

NAME = "01_kv_cache"
MODEL_BAND = 0.5  # measured ÷ predicted speedup at least this: each step runs at ½–1 of its ceiling (docstring)


def sizes(n_ctx: int, quick: bool) -> dict:
    prompt = min(32, n_ctx // 4)
    if quick:
        return {"prompt": prompt, "new_tokens": 16, "batch_lens": [3, 7, 12], "batch_tokens": 6, "repeats": 5,
                "steps_at": (prompt, min(8 * prompt, n_ctx // 2)), "step_repeats": 5}
    return {"prompt": prompt, "new_tokens": min(64, n_ctx - prompt), "batch_lens": [5, 11, 17, 29],
            "batch_tokens": 12, "repeats": 5, "steps_at": (prompt, min(8 * prompt, n_ctx // 2)), "step_repeats": 5}


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed(model, prompt: list[int], params: SamplingParams, cached: bool):
    """A function that generates once and returns (tokens, latency of every token)."""
    def generate():
        watch = Stopwatch(model.device)
        watch.start()
        if cached:
            tokens = kv_cache.generate(model, [prompt], params, on_step=lambda step, n: watch.lap())[0]
        else:
            tokens = naive_decode.generate(model, prompt, params, on_token=lambda i, t: watch.lap())
        return tokens, watch.laps_s()
    return generate


def flops(cfg, P: int, N: int, dtype) -> tuple[list[int], list[int]]:
    """Per token: naive recomputes p + i tokens; cached decodes one token after p + i − 1 cached ones."""
    naive = [prefill_cost(cfg, P + i, 1, dtype).flops for i in range(N)]
    cached = [prefill_cost(cfg, P, 1, dtype).flops] + [decode_cost(cfg, P + i - 1, 1, dtype).flops for i in range(1, N)]
    return naive, cached


def roof_s(cost, ceilings) -> float:
    """A step's roofline time: its FLOPs at the peak or its bytes at the bandwidth, whichever is longer."""
    return max(cost.flops / ceilings.matmul_flops, cost.bytes / ceilings.bandwidth)


def predict_work(lesson, s: dict) -> dict:
    """The cost model before measuring: FLOPs per generated token both ways, each step's predicted time
    (t_fixed + roofline time), and from them the speedup over N tokens and the step growth."""
    cfg, dtype, ceil, (P, N), (a, b) = lesson.config, lesson.dtype, lesson.ceilings, (s["prompt"], s["new_tokens"]), \
        s["steps_at"]
    naive_f, cached_f = flops(cfg, P, N, dtype)
    one = decode_cost(cfg, P, 1, dtype)
    fixed = max(0.0, time_fn(decode_step(lesson.model, P), lesson.device, warmup=2, repeats=7).median_s
                - roof_s(one, ceil))
    t = lambda cost: fixed + roof_s(cost, ceil)  # noqa: E731
    naive_t = [t(prefill_cost(cfg, P + i, 1, dtype)) for i in range(N)]
    cached_t = [t(prefill_cost(cfg, P, 1, dtype))] + [t(decode_cost(cfg, P + i - 1, 1, dtype)) for i in range(1, N)]
    growth = (t(prefill_cost(cfg, b + 1, 1, dtype)) / t(prefill_cost(cfg, a + 1, 1, dtype))
              / (t(decode_cost(cfg, b, 1, dtype)) / t(decode_cost(cfg, a, 1, dtype))))
    f = {"naive": naive_f, "cached": cached_f, "fixed_s": fixed, "speedup": sum(naive_t) / sum(cached_t),
         "growth": growth}
    predict(lesson, f"over {N} tokens after a {P}-token prompt naive decode does {sum(naive_f) / sum(cached_f):.1f}× "
            f"the FLOPs of cached decode; but a step also costs a fixed {ms(fixed)} (a one-token step's time less "
            "its roofline time), which the cache does not remove, so the speedup is smaller than the FLOP ratio",
            expect={"tokens_differing": 0, "speedup": f["speedup"], "step_growth": growth,
                    "speedup_over_model": 1.0})
    return f


def checks(figures: dict) -> list[Check]:
    """The lesson's checks from its figures: no token differs, the cache is faster, a naive step grows more with
    the context than a cached one, and measured ÷ predicted speedup within the cost model's band."""
    g, (a, b) = figures, figures["steps_at"]
    return [Check("tokens that differ between naive and cached decoding", [g["tokens_differing"]], 0, "<=",
                  timed=False, fmt="{:.0f}", predicted=0, key="tokens_differing",
                  why=f"{g['tokens_differing']} of {g['tokens_compared']} tokens differ, the first at position "
                      f"{g['first_differing']}: the cache returned keys or "
                      "values other than recomputing them gives"),
            *speedup_checks(g),
            Check(f"a step's growth from {a} to {b} tokens of context, naive's over cached's",
                  g["step_growth_per_round"], 1.0, ">=", fmt="{:.2f}", predicted=g["predicted_growth"],
                  key="step_growth",
                  why=f"naive's step took {ms(g['step_medians_s']['naive b'])} after {b} tokens against "
                      f"{ms(g['step_medians_s']['naive a'])} after {a}: at these sizes both steps are set by fixed "
                      f"per-step costs, not by the context")]


def facts(figures: dict) -> list[Fact]:
    """What the run reports but cannot refute the claim with: the FLOP ratio, counted from the formula."""
    return [Fact("FLOPs naive ÷ cached", figures["naive_flops"] / figures["cached_flops"], fmt="{:.1f}",
                 why="counted from the cost model's formula, not measured: it cannot refute the claim")]


def speedup_checks(g: dict) -> list[Check]:
    """The speedup over N tokens against 1 (the claim) and against the cost model's prediction (the mechanism)."""
    N, sp, pred = g["new_tokens"], g["speedup_per_round"], g["predicted_speedup"]
    why = (f"cached decode took {ms(g['cached_total_s'])} against naive's {ms(g['naive_total_s'])} for "
           f"{g['cached_flops'] / g['naive_flops']:.0%} of its FLOPs")
    return [Check(f"speedup over {N} tokens (naive time / cached time)", sp, 1.0, ">=", fmt="{:.2f}", predicted=pred,
                  key="speedup", why=why + ": per-step costs other than FLOPs outweigh the work saved at this N"),
            Check(f"speedup over {N} tokens ÷ the cost model's {pred:.2f}", [x / pred for x in sp], MODEL_BAND, ">=",
                  fmt="{:.2f}", predicted=1.0, key="speedup_over_model",
                  why=why + f", a speedup of {statistics.median(sp):.2f} where the model gave {pred:.2f}: a step "
                            "costs something the model leaves out")]


def measure(lesson, s: dict, f: dict) -> dict:
    """Naive and cached generation in turns; their greedy tokens compared, also for a batch of prompts; one step
    of each kind at two contexts, in turns."""
    model, cfg, (P, N), (a, b) = lesson.model, lesson.config, (s["prompt"], s["new_tokens"]), s["steps_at"]
    prompt = random_prompt(cfg.vocab_size, P, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    rounds = interleave({"naive": timed(model, prompt, params, cached=False),
                         "cached": timed(model, prompt, params, cached=True)},
                        s["repeats"], device=lesson.device, desc="naive and cached, in turns",
                        until=settled(lambda r: speedup_checks(totals(r, s, f))))
    naive_runs, cached_runs = rounds.results("naive"), rounds.results("cached")
    # The same comparison for a batch of prompts of different lengths (untimed).
    batch = [random_prompt(cfg.vocab_size, n, seed=1 + i) for i, n in enumerate(s["batch_lens"])]
    bparams = SamplingParams(temperature=0.0, max_tokens=s["batch_tokens"], ignore_eos=True)
    pairs = list(zip(naive_runs[0][0], cached_runs[0][0]))
    pairs += [t for p, c in zip((naive_decode.generate(model, p, bparams) for p in batch),
                                kv_cache.generate(model, batch, bparams)) for t in zip(p, c)]
    growth = lambda r: [n / c for n, c in zip(r.ratio("naive b", "naive a"), r.ratio("cached b", "cached a"))]  # noqa
    steps = interleave({"naive a": prefill_step(model, a + 1), "naive b": prefill_step(model, b + 1),
                        "cached a": decode_step(model, a), "cached b": decode_step(model, b)},
                       s["step_repeats"], device=lesson.device, desc="single steps, in turns",
                       until=lambda r: Check("growth", growth(r), 1.0, ">=").outcome() != "INCONCLUSIVE")
    return {"rounds": rounds, "steps": steps, "pairs": pairs, "step_growth": growth(steps),
            "naive_s": [statistics.median(r[1][i] for r in naive_runs) for i in range(N)],  # per token, median
            "cached_s": [statistics.median(r[1][i] for r in cached_runs) for i in range(N)],
            "positions": [P + i for i in range(N)],  # tokens in context when token i is emitted
            **totals(rounds, s, f)}


def totals(r, s: dict, f: dict) -> dict:
    """The figures of the speedup checks, from the rounds so far."""
    return {"new_tokens": s["new_tokens"], "predicted_speedup": f["speedup"],
            "speedup_per_round": [sum(n[1]) / sum(c[1]) for n, c in zip(r.results("naive"), r.results("cached"))],
            "naive_total_s": statistics.median(sum(x[1]) for x in r.results("naive")),
            "cached_total_s": statistics.median(sum(x[1]) for x in r.results("cached")),
            "naive_flops": sum(f["naive"]), "cached_flops": sum(f["cached"])}


def figures_of(s: dict, f: dict, m: dict) -> dict:
    """Every figure the lesson prints, plots and judges: the results file's "figures"."""
    pairs, differ = m["pairs"], sum(x != y for x, y in m["pairs"])
    keep = ("new_tokens", "predicted_speedup", "speedup_per_round", "naive_total_s", "cached_total_s", "naive_flops",
            "cached_flops")
    return {"prompt_len": s["prompt"], "positions": m["positions"], **{k: m[k] for k in keep},
            "naive_latency_s": m["naive_s"], "cached_latency_s": m["cached_s"],
            "steps_at": list(s["steps_at"]), "step_growth_per_round": m["step_growth"],
            "step_medians_s": {k: m["steps"].median(k) for k in m["steps"].names}, "predicted_growth": f["growth"],
            "fixed_step_s": f["fixed_s"], "wasted_flops": sum(f["naive"]) - sum(f["cached"]),
            "tokens_compared": len(pairs), "tokens_differing": differ, "identical_tokens": differ == 0,
            "first_differing": next((i for i, (x, y) in enumerate(pairs) if x != y), None),
            "tokens": m["rounds"].results("cached")[0][0]}


def judge_claim(lesson, s: dict, f: dict, m: dict, g: dict):
    """The tables of single steps and of every token, the totals, then the checks and the facts."""
    (P, N), (a, b), steps, rounds = (s["prompt"], s["new_tokens"]), s["steps_at"], m["steps"], m["rounds"]
    naive_f, cached_f, naive_s, cached_s = f["naive"], f["cached"], m["naive_s"], m["cached_s"]
    print_table(["one step after", "naive (recompute all)", "cached (one token)"],
                [[n, ms(steps.median(f"naive {k}")), ms(steps.median(f"cached {k}"))] for n, k in ((a, "a"), (b, "b"))],
                f"Single steps (medians of {steps.count} rounds): naive grows "
                f"{statistics.median(steps.ratio('naive b', 'naive a')):.2f}×, cached "
                f"{statistics.median(steps.ratio('cached b', 'cached a')):.2f}× from {a} to {b} tokens:")
    step = max(1, N // 8)
    print_table(["token", "in context", "naive", "cached", "ratio", "naive FLOPs", "cached FLOPs"],
                [[i, m["positions"][i], ms(naive_s[i]), ms(cached_s[i]), f"{naive_s[i] / cached_s[i]:.1f}×",
                  si(naive_f[i]), si(cached_f[i])] for i in sorted({*range(0, N, step), N - 1})],
                f"Latency of each generated token (one row in {step}; medians of {rounds.count} rounds), "
                f"prompt {P} tokens:")
    print_table(["", "naive", "KV cache"],
                [["total time", ms(g["naive_total_s"]), ms(g["cached_total_s"])],
                 ["tokens/s", si(N / g["naive_total_s"]), si(N / g["cached_total_s"])],
                 ["FLOPs", si(sum(naive_f)), si(sum(cached_f))]], f"{N} tokens (medians of {rounds.count} rounds):")
    wasted = g["wasted_flops"]
    time_ratio, flop_ratio = statistics.median(g["speedup_per_round"]), g["naive_flops"] / g["cached_flops"]
    print(f"FLOPs wasted by recomputation: {si(wasted)} ({wasted / sum(naive_f):.0%} of naive's work). Speedup "
          f"{time_ratio:.2f}× (median of the rounds' ratios) against a FLOP ratio of {flop_ratio:.1f}× and the cost "
          f"model's {g['predicted_speedup']:.2f}×: every step pays a fixed {ms(g['fixed_step_s'])} that the cache does "
          "not remove; the wasted FLOPs still grow as N² and win in the end.\n")
    verdict = judge("the KV cache gives the same tokens, faster, because its step does not grow with the context",
                    checks(g), lesson.load(), [rounds, steps], facts=facts(g))
    print_verdict(verdict)
    return verdict


def plot(lesson, s: dict, m: dict, verdict) -> int:
    N, rounds, speedup = s["new_tokens"], m["rounds"], verdict.checks[1].values
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    axes[0].plot(m["positions"], [t * 1e3 for t in m["naive_s"]], ".-", label="naive (recompute all)")
    axes[0].plot(m["positions"], [t * 1e3 for t in m["cached_s"]], ".-", label="KV cache (first token: the prefill)")
    axes[0].set(xlabel="tokens in context when the token is emitted", ylabel="latency (ms)",
                title=f"per-token latency (medians of {rounds.count} rounds)", ylim=(0, None))
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    cum = lambda xs: [sum(xs[:i + 1]) * 1e3 for i in range(len(xs))]  # noqa: E731
    mid = sorted(range(len(speedup)), key=speedup.__getitem__)[(len(speedup) - 1) // 2]  # the round of the median
    axes[1].plot(range(1, N + 1), cum(rounds.results("naive")[mid][1]), label="naive")
    axes[1].plot(range(1, N + 1), cum(rounds.results("cached")[mid][1]), label="KV cache")
    axes[1].set(xlabel="tokens generated", ylabel="total time (ms)", ylim=(0, None),
                title=f"total time, round {mid + 1} of {len(speedup)}\n(the median round: speedup {speedup[mid]:.2f}×)")
    axes[1].legend(fontsize=8, loc="upper left")
    plot_checks(axes[2], verdict)
    save_plot(lesson, fig, verdict)
    return mid + 1  # the round the middle panel draws, counted from 1: a figure of the JSON too


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    f = predict_work(lesson, s)
    m = measure(lesson, s, f)
    figures = figures_of(s, f, m)
    verdict = judge_claim(lesson, s, f, m, figures)
    figures["median_round"] = plot(lesson, s, m, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
