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


def figures(**changes) -> dict:
    """A run's figures where every check holds: 0 tokens differ, a speedup of 2 against a prediction of 1.5, a
    naive step growing 1.8× more than a cached one."""
    f = {"new_tokens": 16, "steps_at": [32, 64], "tokens_differing": 0, "tokens_compared": 40, "first_differing": None,
         "speedup_per_round": [2.0, 2.1, 1.9, 2.0, 2.05], "predicted_speedup": 1.5, "naive_total_s": 0.02,
         "cached_total_s": 0.01, "naive_flops": 132e6, "cached_flops": 11e6,
         "step_growth_per_round": [1.8, 1.7, 1.9, 1.8, 1.75], "predicted_growth": 1.3,
         "step_medians_s": {"naive a": 1e-3, "naive b": 1.5e-3, "cached a": 5e-4, "cached b": 5e-4}}
    return {**f, **changes}


def test_each_check_can_fail():
    """For each check in turn, a measurement on its wrong side: that check, and only it, is NOT SUPPORTED."""
    assert {c.key: c.outcome() for c in L02.checks(figures())} == {
        "tokens_differing": "HOLDS", "speedup": "HOLDS", "speedup_over_model": "HOLDS", "step_growth": "HOLDS"}
    wrong = {"tokens_differing": figures(tokens_differing=3, first_differing=7),
             "speedup": figures(speedup_per_round=[0.9, 0.8, 0.85, 0.9, 0.95], predicted_speedup=1.2),
             "speedup_over_model": figures(predicted_speedup=5.0),  # 2.0 measured where the model said 5: ratio 0.4
             "step_growth": figures(step_growth_per_round=[0.9, 0.8, 0.95, 0.9, 0.85])}
    for key, figs in wrong.items():
        outcomes = {c.key: c.outcome() for c in L02.checks(figs)}
        assert outcomes.pop(key) == "NOT SUPPORTED", key
        if key != "speedup":  # a speedup under 1 is also under half of any prediction above 2: one cause, two lines
            assert set(outcomes.values()) == {"HOLDS"}, (key, outcomes)


def test_every_check_carries_the_cost_models_prediction():
    for c in L02.checks(figures()):
        assert c.predicted is not None and c.key
    band = next(c for c in L02.checks(figures()) if c.key == "speedup_over_model")
    assert band.line == L02.MODEL_BAND and band.median == pytest.approx(2.0 / 1.5)


def test_a_student_prediction_of_no_check_stops_the_lesson_before_it_measures(tmp_path):
    with pytest.raises(SystemExit, match="no check of this lesson has that key; its checks' keys are speedup, "):
        L02.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path), "--predict", "nope=2"])
    assert not (tmp_path / f"{L02.NAME}.json").exists()
