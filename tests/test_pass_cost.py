"""The pass model (minillm/bench/pass_cost.py): a pass costs t₁ + its FLOPs at the peak, so a verification pass over
k tokens ÷ a one-token step lies between 1 (t₁ dominates: a memory- or host-bound step) and their FLOPs' ratio
(FLOPs dominate), and the band holds the predictions at both ends of its uncertainty."""
import pytest
import torch

from minillm.bench.cost import step_cost
from minillm.bench.pass_cost import FIXED_SLACK, RATE_FLOOR, band, pass_time, verify_ratio
from minillm.config import PRESETS

GPT2 = PRESETS["gpt2"]


def flops(k: int, cached: int = 256) -> float:
    return step_cost(GPT2, [k], [cached], torch.float32, lm_head_rows=k).flops


@pytest.mark.parametrize("fixed_s", [1e-4, 1e-3, 1e-2, 1e-1])
def test_a_verification_pass_costs_between_one_step_and_its_flops_ratio(fixed_s):
    v = verify_ratio(GPT2, 5, 256, fixed_s, 1e11, torch.float32)
    assert 1 < v < flops(5) / flops(1)
    assert v == pytest.approx((fixed_s + flops(5) / 1e11) / (fixed_s + flops(1) / 1e11))


def test_t1_alone_makes_it_one_step_and_flops_alone_their_ratio():
    assert verify_ratio(GPT2, 5, 256, 1e3, 1e11, torch.float32) == pytest.approx(1.0, abs=1e-4)
    assert verify_ratio(GPT2, 5, 256, 0.0, 1e11, torch.float32) == pytest.approx(flops(5) / flops(1))
    assert verify_ratio(GPT2, 1, 256, 1e-3, 1e11, torch.float32) == 1.0
    # logits at all k rows: the LM head counted k times, unlike a prefill pass (pass_time: one row per sequence)
    assert flops(5) > step_cost(GPT2, [5], [256], torch.float32).flops
    assert pass_time(GPT2, [1], [256], 1e-3, 1e11, torch.float32) == pytest.approx(1e-3 + flops(1) / 1e11)


def test_the_band_holds_both_predictions_widened_by_the_slack_for_t1():
    at_peak = verify_ratio(GPT2, 5, 256, 1e-3, 1e11, torch.float32)
    at_floor = verify_ratio(GPT2, 5, 256, 1e-3, 1e11 * RATE_FLOOR, torch.float32)
    lo, hi = band(at_peak, at_floor)
    assert at_peak < at_floor   # a slower kernel makes the FLOPs weigh more
    assert (lo, hi) == pytest.approx((at_peak / FIXED_SLACK, at_floor * FIXED_SLACK))
    assert band(at_floor, at_peak) == [lo, hi]
