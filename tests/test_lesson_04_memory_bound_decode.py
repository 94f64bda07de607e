"""Lesson 04 (memory-bound decode): its quick run, and the batch the roofline calls nearly free."""
from minillm import PRESETS
from minillm.bench.cost import decode_cost

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path
from test_roofline import assert_under_ceilings

L04 = load_lesson("04_memory_bound_decode")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L04, tmp_path, capsys)
    assert {"points", "capacity", "context_len", "predicted_free_batch"} <= doc["figures"].keys()
    assert_under_ceilings({"figures": doc["figures"], "ceilings": doc["ceilings"]})  # every batch's share ≤ 100%


def test_04_predicted_free_batch_stops_where_bytes_or_intensity_grow():
    cfg = PRESETS["gpt2"]
    costs = lambda ctx, bs: [decode_cost(cfg, ctx, b) for b in bs]  # noqa: E731
    batches = [1, 2, 4, 8, 16, 32]
    assert L04.predicted_free_batch(batches, costs(16, batches), ridge=6.0) == 4    # intensity 1.98 ≤ 3 < 3.9
    assert L04.predicted_free_batch(batches, costs(16, batches), ridge=20.0) == 16  # intensity 7.7 ≤ 10 < 15
    assert L04.predicted_free_batch(batches, costs(1000, batches), ridge=1e6) == 2  # 4 sequences: KV passes 4/3
    assert L04.predicted_free_batch(batches, costs(16, batches), ridge=0.1) == 2    # never below the second batch


def test_04_max_batch():
    assert L04.max_batch(1000, 200, 2, 100) == 4
    assert L04.max_batch(100, 200, 2, 100) == 0
