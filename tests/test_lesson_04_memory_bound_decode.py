"""Lesson 04 (memory-bound decode): its quick run, the batch the roofline calls nearly free, and a check that can
fail."""
import copy

from minillm import PRESETS
from minillm.bench.cost import decode_cost
from minillm.bench.roofline import Ceilings
from minillm.bench.verdict import HOLDS, NOT_SUPPORTED

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path
from test_roofline import assert_under_ceilings

L04 = load_lesson("04_memory_bound_decode")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L04, tmp_path, capsys)
    f = doc["figures"]
    assert {"points", "capacity", "context_len", "predicted_free_batch", "predicted_step_ratio"} <= f.keys()
    assert_under_ceilings({"figures": f, "ceilings": doc["ceilings"]})  # every batch's share ≤ 100%
    check = doc["verdict"]["checks"][0]
    assert check["predicted"] == f["predicted_step_ratio"] and check["line"] == L04.BAND * check["predicted"]
    assert [x["name"] for x in doc["verdict"]["facts"]] == ["step at batch 2 ÷ step at batch 1 (the kernel switch)"]


def ceilings(peak: float, bandwidth: float) -> Ceilings:
    return Ceilings("cpu", "float32", peak, bandwidth, 1024, 1 << 27)


def test_04_predicted_free_batch_stops_where_the_roofline_step_grows():
    cfg, batches = PRESETS["gpt2"], [1, 2, 4, 8, 16, 32]
    times = lambda ctx, ceil: [L04.roofline_time(decode_cost(cfg, ctx, b), ceil) for b in batches]  # noqa: E731
    assert L04.predicted_free_batch(batches, times(16, ceilings(1e12, 1e10))) == 32   # memory-bound throughout
    assert L04.predicted_free_batch(batches, times(16, ceilings(3e10, 1e10))) == 8    # 1.33×: past the ridge (3) at 16
    assert L04.predicted_free_batch(batches, times(1000, ceilings(1e15, 1e10))) == 4  # KV bytes pass 4/3 by batch 8
    assert L04.predicted_free_batch(batches, times(16, ceilings(1e9, 1e10))) == 4     # never below the batch after 2


def test_04_max_batch():
    assert L04.max_batch(1000, 200, 2, 100) == 4
    assert L04.max_batch(100, 200, 2, 100) == 0


def figures(over_base: list[float], switch: float = 1.7) -> dict:
    """A run's figures: batch 1, 2 and 8, batch 8's step `over_base` × batch 2's in each round."""
    n = len(over_base)
    return {"predicted_free_batch": 8, "predicted_step_ratio": 1.2, "predicted_switch": 1.04,
            "kernels": "numpy for one row, a packed copy for several", "probe_weight_shape": [64, 256],
            "matmul_probe_s": {"1": 1e-5, "2": 1.2e-5, "8": 1.5e-5},
            "points": [{"batch": 1, "times_s": [1e-3 / switch] * n, "over_base": [1 / switch] * n},
                       {"batch": 2, "times_s": [1e-3] * n, "over_base": [1.0] * n},
                       {"batch": 8, "times_s": [1e-3 * r for r in over_base], "over_base": over_base}]}


def test_each_check_can_fail():
    good = figures([1.25, 1.3, 1.2, 1.35, 1.28])
    assert [c.outcome() for c in L04.checks(good)] == [HOLDS]
    bad = copy.deepcopy(good)  # batch 8 costs as much as four batch-2 steps: no batching at all
    bad["points"][2]["over_base"] = [3.9, 4.1, 4.0, 3.8, 4.2]
    check, = L04.checks(bad)
    assert check.outcome() == NOT_SUPPORTED and "8 rows cost 1.25× 2 rows" in check.why


def test_04_the_kernel_switch_is_a_fact_and_never_judged():
    fact, = L04.facts(figures([1.25] * 5, switch=1.7))
    assert abs(fact.value - 1.7) < 1e-9 and fact.predicted == 1.04
    assert [c.outcome() for c in L04.checks(figures([1.25] * 5, switch=9.0))] == [HOLDS]  # a slow switch judges nothing
