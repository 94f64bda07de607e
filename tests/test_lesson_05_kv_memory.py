"""Lesson 05 (the KV cache's memory): its quick run, a filled cache measured by the OS, and its arithmetic."""
import torch

from minillm import PRESETS
from minillm.bench.memory import resident_bytes

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

L03 = load_lesson("05_kv_memory")


def test_quick_run_writes_its_documented_figures_and_one_verdict(tmp_path, capsys):
    doc = run_quick(L03, tmp_path, capsys)
    assert {"sizes", "budget", "decode_bytes_split", "crossover_tokens"} <= doc["figures"].keys()
    usable = L03.GPU_MEMORY_UTILIZATION * doc["figures"]["budget"]["bytes"]
    for row in doc["figures"]["sizes"]:  # on a CPU in fp32 the loader's layout copies take memory beside the weights
        assert row["layout_copy_bytes"] > row["weight_bytes"] > 0
        assert row["tokens_that_fit"] == int((usable - row["weight_bytes"] - row["layout_copy_bytes"])
                                             // row["kv_bytes_per_token"])


def test_03_measures_a_filled_cache_by_the_os_and_finds_the_formula():
    assert resident_bytes() is not None, "this test reads /proc/self/statm, which only Linux has"
    row = L03.measure_cache(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    assert row["formula_bytes"] == row["accounted_bytes"] >= 2 * L03.MIN_TENSOR_BYTES
    assert abs(row["measured_bytes"] - row["formula_bytes"]) <= L03.slack_bytes(torch.device("cpu"))


def test_03_measured_means_asked_of_the_os_not_counted_from_the_tensor(monkeypatch):
    monkeypatch.setattr(L03, "resident_bytes", lambda: 123 << 20)  # an OS that saw nothing change
    row = L03.measure_cache(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    assert row["measured_bytes"] == 0 and row["accounted_bytes"] == row["formula_bytes"]


def test_03_capacity_and_crossover_arithmetic():
    assert L03.tokens_that_fit(1000, 400, 10) == 60
    assert L03.tokens_that_fit(300, 400, 10) == 0  # the weights alone do not fit
    assert L03.crossover_tokens(500, 10) == 50
