"""Lessons 01–04: each runs with --quick on the CPU and writes its documented JSON;
each verdict follows from the numbers, tested on both sides of its line."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
sys.path.insert(0, str(LESSONS))  # lessons import their shared `common` module by name


def load(stem: str):
    spec = importlib.util.spec_from_file_location(f"lesson_{stem}", LESSONS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


L01, L02, L03, L04 = (load(s) for s in ("01_phase_split", "02_kv_cache", "03_kv_memory", "04_memory_bound_decode"))
FIGURES = {
    "01_phase_split": {"ttft_s", "itl_s", "prefill", "decode", "request_prefill", "request_decode"},
    "02_kv_cache": {"naive_latency_s", "cached_latency_s", "speedup", "wasted_flops", "identical_tokens"},
    "03_kv_memory": {"sizes", "budget", "decode_bytes_split", "crossover_tokens"},
    "04_memory_bound_decode": {"points", "capacity", "context_len"},
}


# ---- every lesson runs quick and writes its results --------------------------------


@pytest.mark.parametrize("module", [L01, L02, L03, L04], ids=lambda m: m.NAME)
def test_lesson_runs_quick_and_writes_json_and_plot(module, tmp_path, capsys):
    module.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{module.NAME}.json").read_text())
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 1000
    assert doc["lesson"] == module.NAME and doc["model"] == "tiny" and doc["quick"] is True
    assert doc["weights_source"].startswith("random-init")
    env = doc["environment"]
    assert env["device_name"] and env["torch"] and env["dtype"] == "float32"
    assert {"matmul_flops", "bandwidth", "ridge"} <= doc["ceilings"].keys()
    assert FIGURES[module.NAME] <= doc["figures"].keys()
    assert isinstance(doc["verdict"]["holds"], bool) and doc["verdict"]["reasons"]
    assert "Verdict:" in capsys.readouterr().out


def test_lesson_02_tokens_identical_in_quick_run(tmp_path):
    result = L02.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    assert result["figures"]["identical_tokens"] is True
    assert result["figures"]["wasted_flops"] > 0


def test_lesson_03_measures_every_gpt2_size_against_formula(tmp_path):
    result = L03.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    sizes = {r["model"]: r for r in result["figures"]["sizes"]}
    assert {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"} <= sizes.keys()
    xl = sizes["gpt2-xl"]
    assert xl["kv_bytes_per_token"] == 2 * 48 * 1600 * 4
    assert xl["measured_bytes"] == xl["formula_bytes"] == 64 * xl["kv_bytes_per_token"]
    assert result["verdict"]["holds"]


# ---- 01: which phase is bound by what -----------------------------------------------


def point(intensity, frac_roofline, ridge=5.0, peak=100e9, bw=20e9):
    flops_per_s = frac_roofline * min(peak, intensity * bw)
    return {"intensity": intensity, "frac_roofline": frac_roofline,
            "frac_matmul_flops": flops_per_s / peak, "frac_bandwidth": flops_per_s / intensity / bw}


def test_01_verdict_holds_when_phases_straddle_the_ridge():
    v = L01.phase_verdict(point(200.0, 0.7), point(0.5, 0.8), ridge=5.0)
    assert v["holds"] and v["prefill_bound"] == "compute" and v["decode_bound"] == "memory"
    assert v["prefill_margin"] == pytest.approx(40) and v["decode_margin"] == pytest.approx(10)


def test_01_verdict_fails_when_decode_is_right_of_the_ridge():
    v = L01.phase_verdict(point(200.0, 0.7), point(8.0, 0.8), ridge=5.0)
    assert not v["holds"] and v["decode_bound"] == "compute"
    assert any("contradicts" in r for r in v["reasons"])


def test_01_verdict_calls_a_step_far_below_its_roof_overhead_bound():
    v = L01.phase_verdict(point(200.0, 0.7), point(0.5, 0.05), ridge=5.0)
    assert not v["holds"] and v["decode_bound"] == "overhead"
    assert L01.classify(point(0.5, 0.25), 5.0) == ("memory", pytest.approx(10))
    assert L01.classify(point(0.5, 0.15), 5.0)[0] == "overhead"


# ---- 02: the cache's speedup, from the latencies --------------------------------------


POSITIONS = list(range(8, 40))


def test_02_verdict_holds_for_growing_naive_and_flat_cached():
    naive = [1e-3 * p for p in POSITIONS]
    cached = [5e-3] + [1e-3] * (len(POSITIONS) - 1)
    v = L02.cache_verdict(POSITIONS, naive, cached, identical=True)
    assert v["holds"] and v["speedup"] == pytest.approx(sum(naive) / sum(cached))
    assert v["naive_slope_s_per_token"] == pytest.approx(1e-3)


def test_02_verdict_fails_on_differing_tokens_or_no_growth():
    naive = [1e-3 * p for p in POSITIONS]
    cached = [1e-3] * len(POSITIONS)
    assert not L02.cache_verdict(POSITIONS, naive, cached, identical=False)["holds"]
    flat = [2e-3] * len(POSITIONS)
    v = L02.cache_verdict(POSITIONS, flat, cached, identical=True)
    assert not v["holds"] and not v["checks"]["naive_grows_faster"] and v["checks"]["cache_is_faster"]
    slower = L02.cache_verdict(POSITIONS, cached, [x * 3 for x in naive], identical=True)
    assert not slower["checks"]["cache_is_faster"]


def test_02_slope():
    assert L02.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2)
    assert L02.slope([4, 4], [1, 2]) == 0.0


# ---- 03: cache bytes and the crossover ------------------------------------------------


def test_03_capacity_and_crossover_arithmetic():
    assert L03.tokens_that_fit(1000, 400, 10) == 60
    assert L03.tokens_that_fit(300, 400, 10) == 0  # the weights alone do not fit
    assert L03.crossover_tokens(500, 10) == 50


def test_03_verdict_on_both_sides_of_the_tolerance():
    rows = [{"model": "a", "formula_bytes": 1000, "measured_bytes": 1000},
            {"model": "b", "formula_bytes": 10_000, "measured_bytes": 10_050}]
    v = L03.memory_verdict(rows, crossover=6700, n_ctx=1024, rel_tol=0.01, abs_tol=0)
    assert v["holds"] and v["crossover_min_batch_at_full_context"] == 7
    rows[1]["measured_bytes"] = 11_000
    v = L03.memory_verdict(rows, crossover=500, n_ctx=1024, rel_tol=0.01, abs_tol=0)
    assert not v["holds"] and v["mismatches"] == ["b"]
    assert any("within one sequence" in r for r in v["reasons"])
    unmeasured = [{"model": "c", "formula_bytes": 5, "measured_bytes": None}]
    assert not L03.memory_verdict(unmeasured, 1, 1, 0, 0)["holds"]


# ---- 04: where batching bends ------------------------------------------------------------


BATCHES = [1, 2, 4, 8, 16]


def test_04_find_bend_from_the_data():
    bend = L04.find_bend(BATCHES, [100, 198, 390, 500, 520])
    assert bend["linear_until"] == 4 and bend["bend_at"] == 8
    assert bend["efficiency"][0] == pytest.approx(0.99)
    straight = L04.find_bend(BATCHES, [100 * b for b in BATCHES])
    assert straight["linear_until"] == 16 and straight["bend_at"] is None
    none = L04.find_bend(BATCHES, [100, 120, 130, 140, 150])
    assert none["linear_from"] == none["linear_until"] == 1 and none["bend_at"] == 2
    late = L04.find_bend(BATCHES, [100, 110, 215, 420, 450])  # a slow first doubling, then linear
    assert (late["linear_from"], late["linear_until"], late["bend_at"]) == (2, 8, 16)


def test_04_verdict_on_both_sides():
    tps = [100, 198, 390, 500, 520]
    intensity = [0.5, 1, 2, 4, 8]
    kv = [0.1] * 5
    v = L04.concurrency_verdict(BATCHES, tps, intensity, [0.8] * 5, kv, ridge=5.0)
    assert v["holds"] and v["bend_at"] == 8 and v["predicted_compute_bound_from"] == 16
    assert not L04.concurrency_verdict(BATCHES, [100, 110, 120, 130, 140], intensity, [0.8] * 5, kv, 5.0)["holds"]
    overhead = L04.concurrency_verdict(BATCHES, tps, intensity, [0.05] * 5, kv, ridge=5.0)
    assert not overhead["holds"] and any("overhead" in r for r in overhead["reasons"])
    late = L04.concurrency_verdict(BATCHES, [100, 110, 215, 420, 450], intensity, [0.8] * 5, kv, ridge=5.0)
    assert late["holds"] and late["linear_from"] == 2 and any("worse than linear" in r for r in late["reasons"])
    compute = L04.concurrency_verdict(BATCHES, tps, [6, 12, 24, 48, 96], [0.8] * 5, kv, ridge=5.0)
    assert not compute["holds"]


def test_04_max_batch():
    assert L04.max_batch(1000, 200, 2, 100) == 4
    assert L04.max_batch(100, 200, 2, 100) == 0


# ---- the course runner and the GPU check ------------------------------------------------


def test_run_all_discovers_numbered_lessons_in_order(tmp_path):
    import run_all
    stems = [p.stem for p in run_all.discover()]
    assert stems[:4] == ["01_phase_split", "02_kv_cache", "03_kv_memory", "04_memory_bound_decode"]
    for name in ("07_later.py", "05_new.py", "common.py", "run_all.py", "5_bad.py"):
        (tmp_path / name).write_text("")
    assert [p.name for p in run_all.discover(tmp_path)] == ["05_new.py", "07_later.py"]


def test_run_all_dry_run_passes_flags(capsys):
    import run_all
    assert run_all.main(["--quick", "--model", "tiny", "--dry-run", "--only", "2"]) == 0
    out = capsys.readouterr().out
    assert "02_kv_cache.py" in out and "--quick" in out and "--model tiny" in out and "01_" not in out


def test_gpu_check_plans_every_lesson_and_fails_fast_without_cuda(capsys):
    import torch
    sys.path.insert(0, str(LESSONS.parent))
    import gpu_check
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    import run_all
    for path in run_all.discover():
        for model in ("gpt2", "gpt2-xl"):
            assert f"{path.stem} {model}:" in out
    assert "bench gpt2-xl bf16" in out
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err
