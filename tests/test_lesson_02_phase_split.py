"""Lesson 02 (the phase split): its quick run, its stand-in cache, and the phases' costs it predicts from."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench.cost import decode_cost, prefill_cost
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
