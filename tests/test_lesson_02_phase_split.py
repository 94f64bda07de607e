"""Lesson 02 (the phase split): its quick run, its stand-in cache, the phases' costs it predicts from, and each of its
checks coming out NOT SUPPORTED on a counterfactual measurement."""
import copy

import pytest
import torch

from minillm import PRESETS
from minillm.bench.cost import decode_cost, prefill_cost
from minillm.bench.verdict import HOLDS, NOT_SUPPORTED
from models import random_prompts

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

L01 = load_lesson("02_phase_split")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L01, tmp_path, capsys)
    assert {"ttft_s", "itl_s", "prefill", "decode", "ridge", "lm_head_share"} <= doc["figures"].keys()


def test_01_stand_in_cache_gives_the_logits_of_recomputing(context_model):
    """Lesson 02 decodes without lesson 01's KV cache; its stand-in must still be exact."""
    prompt = torch.tensor(random_prompts(1, [9])[0] + [5, 7, 11])[None]
    full = context_model(prompt)[0]  # (T, V): no cache, every position recomputed
    cache = L01.ListCache(context_model.config.n_layer)
    steps = [context_model(prompt[:, :9], cache=cache)[0]]
    for p in range(9, 12):
        steps.append(context_model(prompt[:, p:p + 1], torch.tensor([[p]]), cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=1e-4)


def test_01_frozen_stand_in_does_not_grow():
    cache = L01.ListCache(1, frozen=True)
    cache.k, cache.v = [torch.zeros(1, 2, 5, 4)], [torch.zeros(1, 2, 5, 4)]
    q = torch.randn(1, 2, 1, 4)
    cache.attend(0, q, q, q)
    assert cache.k[0].shape[2] == 5


def test_01_stand_in_counts_its_extra_copy():
    cfg = PRESETS["gpt2"]
    base, stand_in = decode_cost(cfg, 512), L01.stand_in_cost(cfg, 512, torch.float32)
    assert stand_in.bytes == base.bytes + 2 * base.kv_read_bytes and stand_in.flops == base.flops


def test_01_prefill_intensity_is_two_t_over_b_without_the_lm_head():
    """The docstring's claim: 512 fp32 tokens of gpt2 sit near 2T/b · (1 − head share) = 176, not 256."""
    cfg = PRESETS["gpt2"]
    cost = prefill_cost(cfg, 512)
    head_share = cfg.vocab_size * cfg.n_embd * 4 / cost.weight_bytes
    assert 0.30 < head_share < 0.32
    assert cost.intensity == pytest.approx(2 * 512 / 4 * (1 - head_share), rel=0.05)


# ---- the checks, from figures: a gpt2-like run that holds, and one counterfactual per check ----------------------

ROUNDS = 5


def step(times, flops, nbytes, **where) -> dict:
    return {**where, "flops": flops, "bytes": nbytes, "intensity": flops / nbytes, "times_s": list(times),
            "seconds": sorted(times)[len(times) // 2]}


def holding_figures() -> dict:
    """Ridge 5 FLOP/B (200 GFLOP/s, 40 GB/s); a 128-token prefill at 40 FLOP/B in 1.4× its roof, 3.7× the time of a
    32-token one (FLOPs 4×, bytes 1.06×); a decode step at 0.47 FLOP/B in 1.3× its roof."""
    wobble = [1.0, 1.02, 0.98, 1.01, 0.99]
    return {"prompt_len": 128, "band": L01.BAND,
            "ceilings_before": {"matmul_flops": 2e11, "bandwidth": 4e10},
            "peak_rounds": [2e11] * ROUNDS, "bandwidth_rounds": [4e10] * ROUNDS, "ridge_rounds": [5.0] * ROUNDS,
            "prefill": [step([0.04 * w for w in wobble], 5.5e9, 5.2e8, tokens=32),
                        step([0.15 * w for w in wobble], 2.2e10, 5.5e8, tokens=128)],
            "decode": [step([0.017 * w for w in wobble], 2.5e8, 5.3e8, context=128)]}


def outcomes(figures) -> dict:
    return {c.key: c.outcome() for c in L01.checks(figures)}


def counterfactual(change) -> dict:
    figures = copy.deepcopy(holding_figures())
    change(figures)
    return figures


def scale(point: dict, factor: float) -> None:
    point["times_s"] = [t * factor for t in point["times_s"]]


COUNTERFACTUALS = {
    # a ridge above the prefill's intensity: a device whose arithmetic outruns 128 tokens' worth of weight reuse
    "prefill_over_ridge": lambda f: f.update(peak_rounds=[1e13] * ROUNDS),
    # a prefill whose time barely grows with its FLOPs: a fixed cost per step, not arithmetic, sets it
    "prefill_growth": lambda f: scale(f["prefill"][1], 0.04 * 1.2 / 0.15),
    # a prefill 5× its roofline time: the roof explains a fifth of it
    "prefill_over_roof": lambda f: scale(f["prefill"][1], 5 / 1.4),
    # a ridge below decode's intensity: a device whose memory outruns its arithmetic
    "decode_over_ridge": lambda f: f.update(bandwidth_rounds=[1e12] * ROUNDS),
    # a decode step 6× its roofline time: per-step overhead, not memory, sets it
    "decode_over_roof": lambda f: scale(f["decode"][0], 6 / 1.3),
}


def test_the_gpt2_like_figures_hold_every_check_with_its_prediction():
    checks = L01.checks(holding_figures())
    assert {c.key: c.outcome() for c in checks} == dict.fromkeys(COUNTERFACTUALS, HOLDS)
    assert all(c.predicted is not None and c.over_predicted() is not None for c in checks)
    growth = next(c for c in checks if c.key == "prefill_growth")
    assert growth.predicted == pytest.approx(0.11 / 0.0275) and growth.line == pytest.approx((4 * 5.5 / 5.2) ** 0.5)


@pytest.mark.parametrize("key", COUNTERFACTUALS)
def test_each_check_can_fail(key):
    assert outcomes(counterfactual(COUNTERFACTUALS[key]))[key] == NOT_SUPPORTED


def test_a_round_slowed_with_its_ceilings_changes_no_check():
    """Each round's values are over that round's own ceilings: load that slows a whole round (steps and kernels alike)
    leaves every value as it was."""
    def slow_round(f):
        for point in f["prefill"] + f["decode"]:
            point["times_s"][2] *= 3
        f["peak_rounds"][2] /= 3
        f["bandwidth_rounds"][2] /= 3
    before, after = L01.checks(holding_figures()), L01.checks(counterfactual(slow_round))
    assert [v for c in before for v in c.values] == pytest.approx([v for c in after for v in c.values])
