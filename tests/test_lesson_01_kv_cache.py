"""Lesson 01 (the KV cache): its quick run, its help, and the FLOPs it counts per generated token."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench.cost import step_cost

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

L02 = load_lesson("01_kv_cache")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L02, tmp_path, capsys)
    assert {"naive_latency_s", "cached_latency_s", "speedup_per_round", "step_growth_per_round",
            "wasted_flops", "identical_tokens"} <= doc["figures"].keys()


def test_a_lessons_help_shows_its_whole_docstring(capsys):
    with pytest.raises(SystemExit):
        L02.main(["--help"])
    out = capsys.readouterr().out
    assert "The claim" in out and "Predict before you run" in out and "--quick" in out


def test_02_flops_count_what_each_step_really_holds():
    cfg, P, N = PRESETS["tiny"], 8, 5
    naive, cached = L02.flops(cfg, P, N, torch.float32)
    assert naive == [step_cost(cfg, [P + i], [0]).flops for i in range(N)]
    # token i ≥ 1 comes from feeding token i − 1 after P + i − 1 cached ones
    assert cached == [step_cost(cfg, [P], [0]).flops] + [step_cost(cfg, [1], [P + i - 1]).flops for i in range(1, N)]
