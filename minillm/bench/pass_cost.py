"""What a forward pass should cost, before measuring it: a fixed part, and its FLOPs at the measured peak.

    t(pass of P new tokens after C cached) = t₁ + FLOPs(P | C) / R

t₁ is the pass's fixed cost, timed on the model (`fixed_cost`): the TTFT of a
one-token request through an engine, so one engine step (scheduling, the step's
metadata, per-operation launches: lesson 03; sampling) and one read of the
weights (lesson 04). FLOPs come from `cost.step_cost`; R is the measured peak
(`roofline.py`). The model's own uncertainty sets the band a measurement is judged
in (`band`): prefill kernels reach between RATE_FLOOR of the peak and all of it
(lesson 02's share), and t₁, timed once on a shared machine, may be off by
FIXED_SLACK either way. Lessons 13, 14 and 15 predict with it.

Invariant (tests/test_lesson_13_prompt_caching.py): a ratio of two passes lies
between 1 and the ratio of their FLOPs, and the band holds both ends' predictions.
"""
from __future__ import annotations

from .cost import step_cost

RATE_FLOOR = 0.5   # prefill runs between this share of the measured peak and all of it (lesson 02)
FIXED_SLACK = 1.5  # t₁, timed once before measuring, may be off by this factor either way


def pass_time(cfg, new: list[int], cached: list[int], fixed_s: float, flop_rate: float, dtype) -> float:
    """One pass pushing new[i] tokens through sequence i after cached[i] cached ones: t₁ + its FLOPs at flop_rate."""
    return fixed_s + step_cost(cfg, new, cached, dtype).flops / flop_rate


def verify_ratio(cfg, k: int, cached: int, fixed_s: float, flop_rate: float, dtype) -> float:
    """A pass over k new tokens after `cached` ones, logits at all k (as verifying k − 1 guesses needs), ÷ a
    one-token step: (t₁ + FLOPs(k) / R) ÷ (t₁ + FLOPs(1) / R), between 1 and their FLOPs' ratio."""
    t = lambda n: fixed_s + step_cost(cfg, [n], [cached], dtype, lm_head_rows=n).flops / flop_rate  # noqa: E731
    return t(k) / t(1)


def band(at_peak: float, at_floor: float) -> list[float]:
    """[low, high]: what the model allows of a predicted quantity, from its value with prefill at the peak and at
    RATE_FLOOR of it, widened by FIXED_SLACK for t₁."""
    return [min(at_peak, at_floor) / FIXED_SLACK, max(at_peak, at_floor) * FIXED_SLACK]


def fixed_cost(model, repeats: int = 5) -> float:
    """t₁: the least TTFT of `repeats` one-token requests, each through a fresh engine (a cost: load only adds)."""
    from ..engine import LLMEngine
    from ..kv_pool import CacheConfig
    from ..sampling_params import SamplingParams
    ttft = lambda: LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=4)).generate(  # noqa: E731
        [[0]], SamplingParams(temperature=0.0, max_tokens=1))[0].metrics.ttft
    ttft()  # the first pass allocates: not counted
    return min(ttft() for _ in range(repeats))
