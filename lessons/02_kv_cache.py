"""Lesson 02: naive decode against the KV cache. Remembering K and V removes O(n²) work.

The claim
---------
A token's keys and values never change once computed. Naive decode throws them
away and recomputes every earlier token to emit the next one, so step n costs
about as much as a prefill of n tokens: per-token latency grows with position,
and N tokens cost O(N²) matmul work. With a KV cache, step n pushes one token
through the weights and only *reads* the n cached keys and values: per-token
latency stays almost flat. For P parameters and a prompt of p tokens,

    naive,  N tokens:  Σ_{n=p}^{p+N-1} 2·P·n   ≈ 2·P·(p·N + N²/2)  FLOPs
    cached, N tokens:  2·P·p + 2·P·(N-1)                            FLOPs (+ attention)

and the cache changes nothing about *which* tokens come out: greedy decoding
must give identical tokens both ways.

What this lesson measures
-------------------------
- the latency of every generated token against its position, both ways;
- total time for N tokens, the speedup, and the FLOPs naive decode wastes;
- the greedy tokens of both, for the timed prompt and for a batch of prompts
  of different lengths, compared one by one.

The verdict is computed from those numbers: identical tokens, a speedup above
1, and naive latency rising with position faster than cached latency does.

Predict before you run: for N new tokens after a short prompt, how does the
speedup scale with N? What would 4× more tokens do to it?
"""
from __future__ import annotations

from common import make_parser, ms, plt, print_table, print_verdict, save_plot, si, start, write_results

import torch

from minillm import kv_cache, naive_decode
from minillm.metrics import Stopwatch, decode_cost, prefill_cost
from minillm.sampling import SamplingParams

NAME = "02_kv_cache"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def cache_verdict(positions: list[int], naive_s: list[float], cached_s: list[float], identical: bool) -> dict:
    """Does this run show the KV cache's claim? Pure: numbers in, verdict out.

    positions[i] is the context length when token i was emitted; naive_s[i] and
    cached_s[i] its latency each way (cached_s[0] is the prefill, TTFT).
    Holds when the tokens are identical, the cache is faster overall, and naive
    latency grows with position faster than the cached decode steps' does.
    """
    total_naive, total_cached = sum(naive_s), sum(cached_s)
    speedup = total_naive / total_cached
    naive_slope = slope(positions[1:], naive_s[1:])
    cached_slope = slope(positions[1:], cached_s[1:])
    checks = {
        "identical_tokens": identical,
        "cache_is_faster": speedup > 1.0,
        "naive_grows_faster": naive_slope > max(cached_slope, 0.0),
    }
    reasons = [
        f"greedy tokens {'identical' if identical else 'DIFFER'} between naive decode and the KV cache",
        f"total time: naive {ms(total_naive)}, cached {ms(total_cached)} → speedup {speedup:.2f}×",
        f"latency growth per token of position: naive {naive_slope * 1e6:.3g} µs, cached {cached_slope * 1e6:.3g} µs",
    ]
    if not checks["naive_grows_faster"]:
        reasons.append("the data contradicts the claim: naive latency does not grow faster with position here "
                       "(too few tokens, or per-step overhead hides the recomputation: try more tokens or a larger model)")
    if not checks["cache_is_faster"]:
        reasons.append("the data contradicts the claim: the cached run was not faster")
    return {"holds": all(checks.values()), "checks": checks, "speedup": speedup,
            "naive_slope_s_per_token": naive_slope, "cached_slope_s_per_token": cached_slope, "reasons": reasons}


def sizes(n_ctx: int, quick: bool) -> dict:
    if quick:
        return {"prompt": 8, "new_tokens": min(24, n_ctx - 8), "batch_lens": [3, 7, 12], "batch_tokens": 6}
    return {"prompt": 16, "new_tokens": min(112, n_ctx - 16), "batch_lens": [5, 11, 17, 29], "batch_tokens": 12}


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed_naive(model, prompt, params):
    watch = Stopwatch(model.device)
    watch.start()
    tokens = naive_decode.generate(model, prompt, params, on_token=lambda i, t: watch.lap())
    return tokens, watch.laps_s()


def timed_cached(model, prompt, params):
    watch = Stopwatch(model.device)
    watch.start()
    tokens = kv_cache.generate(model, [prompt], params, on_step=lambda step, n: watch.lap())[0]
    return tokens, watch.laps_s()


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    model, cfg, dtype = lesson.model, lesson.config, lesson.dtype
    s = sizes(cfg.n_ctx, args.quick)
    P, N = s["prompt"], s["new_tokens"]

    prompt = random_prompt(cfg.vocab_size, P, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    naive_decode.generate(model, prompt, warm)
    kv_cache.generate(model, [prompt], warm)
    naive_tokens, naive_s = timed_naive(model, prompt, params)
    cached_tokens, cached_s = timed_cached(model, prompt, params)
    positions = [P + i for i in range(N)]  # context length when token i is emitted

    # The same comparison for a batch of prompts of different lengths (untimed).
    batch_prompts = [random_prompt(cfg.vocab_size, n, seed=1 + i) for i, n in enumerate(s["batch_lens"])]
    bparams = SamplingParams(temperature=0.0, max_tokens=s["batch_tokens"], ignore_eos=True)
    batch_cached = kv_cache.generate(model, batch_prompts, bparams)
    batch_naive = [naive_decode.generate(model, p, bparams) for p in batch_prompts]
    identical = naive_tokens == cached_tokens and batch_cached == batch_naive

    naive_flops = [prefill_cost(cfg, n, 1, dtype).flops for n in positions]
    cached_flops = [prefill_cost(cfg, P, 1, dtype).flops] + [decode_cost(cfg, n, 1, dtype).flops for n in positions[1:]]

    step = max(1, N // 8)
    shown = sorted({*range(0, N, step), N - 1})  # every step-th token, and the last one once
    rows = [[i, positions[i], ms(naive_s[i]), ms(cached_s[i]), f"{naive_s[i] / cached_s[i]:.1f}×",
             si(naive_flops[i]), si(cached_flops[i])] for i in shown]
    print_table(["token", "context", "naive", "cached", "ratio", "naive FLOPs", "cached FLOPs"], rows,
                f"Latency of each generated token (every {step}th shown), prompt {P} tokens:")
    print_table(["", "naive", "KV cache"],
                [["total time", ms(sum(naive_s)), ms(sum(cached_s))],
                 ["tokens/s", si(N / sum(naive_s)), si(N / sum(cached_s))],
                 ["FLOPs", si(sum(naive_flops)), si(sum(cached_flops))]],
                f"{N} tokens:")
    wasted = sum(naive_flops) - sum(cached_flops)
    print(f"FLOPs wasted by recomputation: {si(wasted)} ({wasted / sum(naive_flops):.0%} of naive's work); "
          f"analytic FLOP ratio {sum(naive_flops) / sum(cached_flops):.1f}×")
    naive_rate, cached_rate = sum(naive_flops) / sum(naive_s), sum(cached_flops) / sum(cached_s)
    time_ratio, flop_ratio = sum(naive_s) / sum(cached_s), sum(naive_flops) / sum(cached_flops)
    print(f"achieved: naive {si(naive_rate, 'FLOP/s')}, cached {si(cached_rate, 'FLOP/s')} "
          f"(matmul ceiling {si(lesson.ceilings.matmul_flops, 'FLOP/s')}).")
    if time_ratio < flop_ratio:
        print(f"The time ratio ({time_ratio:.1f}×) is below the FLOP ratio ({flop_ratio:.1f}×): naive decode's "
              "recomputation runs as many-token passes at a higher FLOP/s than the single-token "
              "cached steps. Wasted FLOPs are cheaper than they look, yet they grow as N² and win in the end.\n")
    else:
        print(f"The time ratio ({time_ratio:.1f}×) is at or above the FLOP ratio ({flop_ratio:.1f}×): naive steps ran "
              "at no higher FLOP/s than cached ones, so per-step costs other than FLOPs dominate this run.\n")

    verdict = cache_verdict(positions, naive_s, cached_s, identical)
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    axes[0].plot(positions, [t * 1e3 for t in naive_s], ".-", label="naive (recompute all)")
    axes[0].plot(positions, [t * 1e3 for t in cached_s], ".-", label="KV cache (token 0 = prefill)")
    axes[0].set(xlabel="context length when the token is emitted", ylabel="latency (ms)",
                title="per-token latency", ylim=(0, None))
    axes[0].legend()
    cum = lambda xs: [sum(xs[:i + 1]) * 1e3 for i in range(len(xs))]  # noqa: E731
    axes[1].plot(range(1, N + 1), cum(naive_s), label="naive")
    axes[1].plot(range(1, N + 1), cum(cached_s), label="KV cache")
    axes[1].set(xlabel="tokens generated", ylabel="total time (ms)", title=f"speedup {verdict['speedup']:.1f}×")
    axes[1].legend()
    save_plot(lesson, fig)

    figures = {"prompt_len": P, "new_tokens": N, "positions": positions, "naive_latency_s": naive_s,
               "cached_latency_s": cached_s, "naive_total_s": sum(naive_s), "cached_total_s": sum(cached_s),
               "speedup": verdict["speedup"], "naive_flops": sum(naive_flops), "cached_flops": sum(cached_flops),
               "wasted_flops": wasted, "naive_flops_per_s": naive_rate, "cached_flops_per_s": cached_rate,
               "identical_tokens": identical, "tokens": cached_tokens,
               "batch_prompt_lens": s["batch_lens"], "batch_tokens": batch_cached}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    main()
