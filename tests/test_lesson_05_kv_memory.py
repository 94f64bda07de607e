"""Lesson 05 (the KV cache's memory): its quick run, a filled cache measured by the OS, its arithmetic (GQA
included), and checks that can fail."""
import copy

import torch

from minillm import PRESETS
from minillm.bench.memory import resident_bytes
from minillm.bench.verdict import HOLDS, NOT_SUPPORTED

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

L03 = load_lesson("05_kv_memory")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L03, tmp_path, capsys)
    assert {"sizes", "budget", "decode_bytes_split", "crossover_tokens"} <= doc["figures"].keys()
    checks = doc["verdict"]["checks"]
    assert all(c["predicted"] is not None for c in checks) and doc["verdict"]["facts"]
    usable = L03.GPU_MEMORY_UTILIZATION * doc["figures"]["budget"]["bytes"]
    for row in doc["figures"]["sizes"]:  # on a CPU in fp32 the loader's layout copies take memory beside the weights
        assert row["layout_copy_bytes"] > row["weight_bytes"] > 0
        assert row["tokens_that_fit"] == int((usable - row["weight_bytes"] - row["layout_copy_bytes"])
                                             // row["kv_bytes_per_token"])


def test_05_measures_a_filled_cache_by_the_os_and_finds_the_formula():
    assert resident_bytes() is not None, "this test reads /proc/self/statm, which only Linux has"
    row = L03.measure_cache(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    assert row["formula_bytes"] == row["accounted_bytes"] >= 2 * L03.MIN_TENSOR_BYTES
    assert abs(row["measured_bytes"] - row["formula_bytes"]) <= L03.slack_bytes(torch.device("cpu"))


def test_05_measured_means_asked_of_the_os_not_counted_from_the_tensor(monkeypatch):
    monkeypatch.setattr(L03, "resident_bytes", lambda: 123 << 20)  # an OS that saw nothing change
    row = L03.measure_cache(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    assert row["measured_bytes"] == 0 and row["accounted_bytes"] == row["formula_bytes"]


def test_05_capacity_and_crossover_arithmetic():
    assert L03.tokens_that_fit(1000, 400, 10) == 60
    assert L03.tokens_that_fit(300, 400, 10) == 0  # the weights alone do not fit
    assert L03.crossover_tokens(500, 10) == 50


def test_05_the_formula_with_grouped_query_attention():
    cfg = PRESETS["gpt2"]
    assert L03.kv_bytes(cfg.n_layer, cfg.n_head, cfg.head_dim, 4) == cfg.kv_bytes_per_token(torch.float32)
    assert L03.kv_bytes(32, 32, 128, 2) == 512 << 10 and L03.kv_bytes(32, 8, 128, 2) == 128 << 10  # GQA: 4× less
    assert L03.kv_bytes(32, 1, 128, 2) == 16 << 10  # MQA: one K and V for all 32 query heads


def figures(measured: dict) -> dict:
    rows = [{"model": m, "tokens": 2048, "formula_bytes": 150_000_000, "accounted_bytes": 150_000_000,
             "measured_bytes": b, "measured_by": "resident set delta"} for m, b in measured.items()]
    return {"rounding_allowed_bytes": 4 << 20, "sizes": rows}


def test_each_check_can_fail():
    good = figures({"gpt2": 150_100_000, "gpt2-xl": 150_000_000})
    assert [c.outcome() for c in L03.checks(good)] == [HOLDS] * 3
    over = L03.checks(figures({"gpt2": 150_100_000, "gpt2-xl": 180_000_000}))  # 20% more than the formula
    assert [c.outcome() for c in over] == [HOLDS, NOT_SUPPORTED, HOLDS]
    under = L03.checks(figures({"gpt2": 150_100_000, "gpt2-xl": 100_000_000}))  # the count missed a third
    assert [c.outcome() for c in under] == [HOLDS, HOLDS, NOT_SUPPORTED] and "gpt2-xl" in under[-1].why
    assert L03.facts(copy.deepcopy(good))[0].value == 2
