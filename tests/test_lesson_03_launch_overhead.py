"""Lesson 03 (launch overhead): it runs quick on the tiny model, its twin dispatches the same ops as the model
it stands for, and the pieces of its verdict are fed numbers on both sides of their lines."""
import json

import pytest
import torch

from minillm import PRESETS
from minillm.bench.cost import weight_read_floor
from minillm.bench.steps import count_ops, decode_step
from minillm.checkpoints.load import random_model

from lesson_checks import assert_lesson_results
from lessons_support import load_lesson  # also puts lessons/ on sys.path



lesson = load_lesson("03_launch_overhead")



def test_quick_run_writes_one_verdict_over_a_ladder_of_two_shapes(tmp_path, one_thread):
    lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{lesson.NAME}.json").read_text())
    assert doc["lesson"] == lesson.NAME and doc["quick"] is True
    assert (tmp_path / f"{lesson.NAME}.png").stat().st_size > 1000
    v, points = doc["verdict"], doc["figures"]["points"]
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE")
    assert [p["name"] for p in points] == ["tiny", "mini"]
    assert [c["holds_if"] for c in v["checks"]] == [">=", "<=", "<=", ">="] and all(c["timed"] for c in v["checks"])
    assert [c["key"] for c in v["checks"]] == ["small_share", "large_share", "large_step_over_model",
                                               "large_step_over_model_low"]
    assert [f["value"] for f in v["facts"][:2]] == [p["ops"]["eager"] for p in points]  # the twins' ops, a fact
    for p in points:
        assert set(p["step_s"]) == {"eager", "static", "twin"}  # no graph off CUDA
        assert p["ops"]["twin"] == p["ops"]["eager"] > 0 and p["ops"]["static"] > 0
        assert len(p["share"]) == p["rounds"] >= doc["figures"]["rounds"] and all(s > 0 for s in p["share"])
        assert p["overhead_s"] == pytest.approx(p["host_per_op_s"] * p["ops"]["eager"])
    assert points[1]["ops"]["eager"] > points[0]["ops"]["eager"]  # mini is deeper: more ops per step
    assert points[1]["weight_bytes"] > points[0]["weight_bytes"]
    rate = doc["ceilings"]["kernels"]["one-row product"]["rate"]  # the formula reads at the batch-1 kernel's rate,
    for p in points:
        assert p["floor_s"] == pytest.approx(weight_read_floor(PRESETS[p["name"]], torch.float32, rate))
    assert_lesson_results(doc)


def test_on_a_cpu_its_ceilings_are_measured_on_one_thread_as_its_steps_run(tmp_path, monkeypatch):
    import common

    class Measured(Exception):
        pass

    def measure_ceilings(*args, **kwargs):  # the lesson stops here: only the threads it measures on matter
        raise Measured(torch.get_num_threads())
    monkeypatch.setattr(common, "measure_ceilings", measure_ceilings)
    before = torch.get_num_threads()
    try:
        with pytest.raises(Measured) as measured:
            lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--threads", "2", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(before)
    assert measured.value.args == (1,)


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_the_twin_dispatches_the_same_ops_on_almost_no_bytes(name, one_thread):
    """The twin's time stands for the host cost of the model's ops: that holds only if its ops are the same ones."""
    cfg = PRESETS[name]
    twin_cfg = lesson.twin_of(cfg)
    model, twin = random_model(cfg, "cpu", torch.float32), random_model(twin_cfg, "cpu", torch.float32)
    ops, twin_ops = count_ops(decode_step(model, 16)), count_ops(decode_step(twin, 16))
    assert twin_ops.by_op == ops.by_op
    assert twin_cfg.weight_bytes(torch.float32) < cfg.weight_bytes(torch.float32) / 10


def test_ladder_runs_from_tiny_up_to_the_model_with_at_least_two_shapes():
    p = lambda n: PRESETS[n].num_params()  # noqa: E731
    assert lesson.ladder("gpt2", p("gpt2")) == ["tiny", "mini", "gpt2"]
    assert lesson.ladder("gpt2-medium", p("gpt2-medium")) == ["tiny", "mini", "gpt2", "gpt2-medium"]
    assert lesson.ladder("tiny", p("tiny")) == ["tiny", "mini"]
    assert lesson.ladder("weights/my-model", p("gpt2") + 1) == ["tiny", "mini", "gpt2", "weights/my-model"]


def point(name, share, weight_bytes=1e6):
    return {"name": name, "share_median": share, "weight_bytes": weight_bytes}


def test_bound_and_crossover_on_both_sides_of_the_line():
    assert lesson.bound(0.5) == lesson.bound(0.51) == "overhead" and lesson.bound(0.49) == "memory"
    text = lesson.crossover([point("a", 0.9), point("b", 0.7), point("c", 0.04), point("d", 0.02)])
    assert text.startswith("the crossover lies between b") and "and c" in text
    assert "between a" in lesson.crossover([point("a", 0.5), point("b", 0.49)])
    assert "between b" in lesson.crossover([point("a", 0.49), point("b", 0.56), point("c", 0.04)])  # a noisy first
    assert "do not turn" in lesson.crossover([point("a", 0.3), point("b", 0.6)])
    assert "lies above it" in lesson.crossover([point("a", 0.9), point("b", 0.51)])
    assert "lies below it" in lesson.crossover([point("a", 0.49), point("b", 0.1)])


def test_even_bytes_is_the_weight_size_read_in_the_ops_host_time():
    # 1 ms of ops in a 3 ms step of 100 MB: the weights took 2 ms, so 1 ms reads 50 MB
    assert lesson.even_bytes(1e-3, 3e-3, 100e6) == pytest.approx(50e6)
    assert lesson.even_bytes(1e-3, 1.5e-3, 100e6) == pytest.approx(200e6)
    assert lesson.even_bytes(1e-3, 1e-3, 100e6) is None and lesson.even_bytes(2e-3, 1e-3, 100e6) is None


def shape(name, share, eager_s, twin_s, floor_s=1e-4, weight_bytes=1e6):
    return {"name": name, "share": share, "weight_bytes": weight_bytes, "floor_s": floor_s, "ops": {"eager": 300},
            "times_s": {"eager": eager_s, "twin": twin_s},
            "step_s": {"eager": eager_s[2], "twin": twin_s[2], "static": eager_s[2]}}


def figures(small_share=(0.9, 0.95, 0.92, 0.9, 0.93), large_share=(0.1, 0.12, 0.09, 0.1, 0.11),
            large_eager=(1.2e-3, 1.3e-3, 1.25e-3, 1.2e-3, 1.22e-3), predicted_large=0.2) -> dict:
    """Every check holds: tiny overhead-bound, gpt2 memory-bound, its step 1.2× twin + floor (0.1 + 1 ms)."""
    twin = [1e-4] * 5
    return {"on_cuda": False,
            "points": [shape("tiny", list(small_share), [1e-3] * 5, [9e-4] * 5),
                       shape("gpt2", list(large_share), list(large_eager), twin, floor_s=1e-3)],
            "predicted": {"share": {"tiny": 0.9, "gpt2": predicted_large}, "step_s": {"tiny": 1e-3, "gpt2": 1.1e-3}}}


def test_each_check_can_fail():
    """For each check in turn, a measurement on its wrong side: that check, and only it, is NOT SUPPORTED."""
    assert {c.key: c.outcome() for c in lesson.checks(figures())} == {
        "small_share": "HOLDS", "large_share": "HOLDS", "large_step_over_model": "HOLDS",
        "large_step_over_model_low": "HOLDS"}
    wrong = {"small_share": figures(small_share=(0.3, 0.35, 0.32, 0.3, 0.33)),
             "large_share": figures(large_share=(0.7, 0.75, 0.72, 0.7, 0.71)),
             "large_step_over_model": figures(large_eager=(3e-3, 3.2e-3, 3.1e-3, 3e-3, 3.3e-3)),  # 3× twin + floor
             "large_step_over_model_low": figures(large_eager=(3e-4, 3.2e-4, 3.1e-4, 3e-4, 3.3e-4))}  # 0.3×
    for key, figs in wrong.items():
        outcomes = {c.key: c.outcome() for c in lesson.checks(figs)}
        assert outcomes.pop(key) == "NOT SUPPORTED", key
        assert set(outcomes.values()) == {"HOLDS"}, (key, outcomes)


def test_a_ladder_the_formula_calls_overhead_bound_throughout_cannot_judge_the_large_shape():
    c = next(c for c in lesson.checks(figures(predicted_large=0.8)) if c.key == "large_share")
    assert c.outcome() == "INCONCLUSIVE" and "no memory-bound shape" in c.undecided and "--model" in c.undecided
    assert all(c.predicted is not None for c in lesson.checks(figures()))


def test_the_twins_op_counts_and_a_graphs_saving_off_cuda_are_facts():
    figs = figures()
    for p in figs["points"]:
        p["ops"]["twin"], p["graph_removes_s"], p["step_s"]["static"] = 300, 1e-3, 2e-3
    names = [f.name for f in lesson.facts(figs)]
    assert names == ["ops per step of tiny and of its twin", "ops per step of gpt2 and of its twin",
                     "what a CUDA graph would save tiny's step (static ops × µs/op)",
                     "what a CUDA graph would save gpt2's step (static ops × µs/op)"]
    assert len(lesson.facts({**figs, "on_cuda": True})) == 2  # on CUDA the graph is measured, not a fact
