"""What prefix caching buys a workload: the same conversations served caching off and on, and the most it can buy.

Each run gets a fresh engine whose pool holds its whole workload at once
(`conversation_blocks`), so nothing is preempted and caching is the only
difference between the two runs. Rounds of `interleave` name each run
"<workload> off" and "<workload> on"; the ratios are taken within a round:

    gain               throughput on ÷ off
    same-forward gain  off's makespan ÷ (off's makespan + on's host time − off's host time)
                       (both runs given off's forward time: what caching's host work costs, without
                       the noise of the forward passes)
    bound              1 / (1 − prefill share · tokens saved)        (Amdahl's law: the saved prefill
                       tokens' time falls to zero, the rest stays)

What it should buy, before measuring (`predicted_ttft`, `predicted_gain`, `predictions`): a pass costs a
fixed part t₁ plus its FLOPs at a rate R (`pass_cost.py`), so

    TTFT(P tokens computed, C cached)  = t₁ + FLOPs(P | C) / R
    a hit's gain (S shared, U own)     = (t₁ + FLOPs(S + U | 0) / R) / (t₁ + FLOPs(U | S) / R)
                                         → (S + U) / U when t₁ → 0, → 1 when the pass is all fixed cost
    a run of requests                  = (prefill steps + decode steps) · t₁ + every step's FLOPs / R

Invariant (tests/test_lesson_13_prompt_caching.py): the bound is Amdahl's law on
the prefill saved, the same-forward gain is 1 when caching adds no host time, and a hit's
predicted gain lies between 1 and (S + U) / U.
"""
from __future__ import annotations

import math

from ..engine import LLMEngine
from ..kv_pool import CacheConfig
from ..scheduler import SchedulerConfig
from .cost import step_cost
from .pass_cost import FIXED_SLACK, RATE_FLOOR, band, pass_time
from .replay import serve
from .workloads import Conversation, conversation_blocks

BLOCK_SIZE = 16


def make_engine(model, conversations: list[Conversation], caching: bool, block_size: int = BLOCK_SIZE) -> LLMEngine:
    """An engine whose pool holds every conversation at its longest at once, prefix caching on or off."""
    pool = CacheConfig(block_size=block_size, num_gpu_blocks_override=conversation_blocks(conversations, block_size),
                       enable_prefix_caching=caching)
    return LLMEngine(model, SchedulerConfig(max_num_seqs=len(conversations)), pool)


def runner(model, conversations: list[Conversation], caching: bool, concurrency: int | None = None):
    """A function that serves the conversations once, on a fresh engine (`replay.serve`'s closed-loop clients)."""
    return lambda: serve(make_engine(model, conversations, caching), conversations, concurrency)


def gains(r, w: str) -> list[float]:
    """Throughput on ÷ off of workload `w`, one per round."""
    return [b["throughput"] / a["throughput"] for a, b in zip(r.results(f"{w} off"), r.results(f"{w} on"))]


def same_forward_gains(r, w: str) -> list[float]:
    """Throughput on ÷ off of workload `w` with both runs given off's forward time, one per round: off's makespan ÷
    (off's makespan + on's host time − off's). What caching's host work costs, without the noise of the passes."""
    return [a["makespan_s"] / (a["makespan_s"] + b["host_s"] - a["host_s"])
            for a, b in zip(r.results(f"{w} off"), r.results(f"{w} on"))]


def caching_bound(prefill_s: float, decode_s: float, tokens_saved: float) -> dict:
    """The most caching can gain in throughput when prefill takes `prefill_s` and decode `decode_s`, and caching
    saves a share `tokens_saved` of the prefill tokens (Amdahl's law)."""
    share = prefill_s / (prefill_s + decode_s)
    return {"prefill_share": share, "tokens_saved": tokens_saved, "bound": 1 / (1 - share * tokens_saved)}


def throughput_bound(off: dict, on: dict) -> dict:
    """The most caching can gain in throughput: the uncached run's prefill-step share × the prefill tokens saved,
    as if the saved tokens' time fell to zero and the rest stayed."""
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    return caching_bound(off["prefill_steps_s"], off["decode_steps_s"], saved)


def predicted_ttft(cfg, computed: int, cached: int, fixed_s: float, flop_rate: float, dtype) -> float:
    """One prefill pass of `computed` tokens after `cached` ones: t₁ + its FLOPs at `flop_rate` (pass_cost.py)."""
    return pass_time(cfg, [computed], [cached], fixed_s, flop_rate, dtype)


def predicted_gain(cfg, n: int, prefix: int, suffix: int, answer: int, fixed_s: float, flop_rate: float, dtype,
                   budget: int, block_size: int = BLOCK_SIZE) -> float:
    """Throughput on ÷ off of n requests sharing a `prefix`-token system prompt, each with `suffix` own tokens and
    `answer` tokens out, all sent at once: caching on, all but the first skip the prefix's full blocks. Each run
    takes ⌈prefill tokens ÷ budget⌉ prefill steps and answer − 1 decode steps of t₁, plus all their FLOPs."""
    P, cached = prefix + suffix, prefix // block_size * block_size

    def run_s(computed: list[int], cached_lens: list[int]) -> float:
        decode = step_cost(cfg, [1] * n, [P] * n, dtype).flops * (answer - 1)
        steps = math.ceil(sum(computed) / budget) + answer - 1
        return steps * fixed_s + (step_cost(cfg, computed, cached_lens, dtype).flops + decode) / flop_rate
    return run_s([P] * n, [0] * n) / run_s([P] + [P - cached] * (n - 1), [0] + [cached] * (n - 1))


def predictions(cfg, s: dict, fixed_s: float, peak: float, dtype) -> dict:
    """What the pass model predicts before measuring, for lesson 13's sizes `s` (the sweep's shared lengths and own
    tokens; the shared workload's requests, prefix, suffix and answer): the sweep's TTFTs, the checked hit's gain and
    the shared workload's, each at the peak and at RATE_FLOOR of it, and the band each is judged in."""
    S, U, budget = s["sweep"], s["sweep_suffix"], SchedulerConfig().max_num_batched_tokens
    hit = lambda rate: (predicted_ttft(cfg, S[-1] + U, 0, fixed_s, rate, dtype)  # noqa: E731
                        / predicted_ttft(cfg, U, S[-1], fixed_s, rate, dtype))
    shared = lambda rate: predicted_gain(cfg, s["requests"], s["prefix"], s["suffix"], s["answer"], fixed_s,  # noqa
                                         rate, dtype, budget)
    p = {"fixed_s": fixed_s, "flop_rate": peak, "rate_floor": RATE_FLOOR, "fixed_slack": FIXED_SLACK,
         "ttft_gain": hit(peak), "shared_gain": shared(peak),
         "ttft_off_s": [predicted_ttft(cfg, x + U, 0, fixed_s, peak, dtype) for x in S],
         "ttft_on_s": [predicted_ttft(cfg, U, x, fixed_s, peak, dtype) for x in S]}
    p |= {"ttft_band": band(p["ttft_gain"], hit(RATE_FLOOR * peak)),
          "shared_band": band(p["shared_gain"], shared(RATE_FLOOR * peak))}
    return p
