"""Lessons 01–04: each runs with --quick on the CPU, writes its documented JSON and one verdict; the pieces
each verdict stands on are tested with numbers on both sides of their lines."""
import json
import sys
from pathlib import Path

import pytest
import torch

from minillm import PRESETS
from minillm.bench.cost import decode_cost, prefill_cost, step_cost
from minillm.bench.memory import resident_bytes
from models import random_prompts

from lesson_checks import assert_lesson_results
from lessons_support import LESSONS, load_lesson  # also puts lessons/ on sys.path



L01, L02, L03, L04 = (load_lesson(s) for s in ("01_phase_split", "02_kv_cache", "03_kv_memory",
                                                "04_memory_bound_decode"))
FIGURES = {
    "01_phase_split": {"ttft_s", "itl_s", "prefill", "decode", "ridge_per_round", "lm_head_share"},
    "02_kv_cache": {"naive_latency_s", "cached_latency_s", "speedup_per_round", "step_growth_per_round",
                    "wasted_flops", "identical_tokens"},
    "03_kv_memory": {"sizes", "budget", "decode_bytes_split", "crossover_tokens"},
    "04_memory_bound_decode": {"points", "capacity", "context_len", "predicted_free_batch"},
}


# ---- every lesson runs quick and writes its results --------------------------------


@pytest.mark.parametrize("module", [L01, L02, L03, L04], ids=lambda m: m.NAME)
def test_lesson_runs_quick_and_writes_json_and_plot(module, tmp_path, capsys):
    module.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{module.NAME}.json").read_text())
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 1000
    assert doc["lesson"] == module.NAME and doc["model"] == "tiny" and doc["quick"] is True
    assert doc["weights_source"].startswith("random-init") and doc["wall_s"] > 0
    assert doc["environment"]["torch"] and doc["environment"]["dtype"] == "float32"
    assert FIGURES[module.NAME] <= doc["figures"].keys()
    v = doc["verdict"]
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE") and v["claim"] and v["checks"]
    assert v["holds"] == (v["outcome"] == "HOLDS") and "share" in v["load"]
    out = capsys.readouterr().out
    assert out.count("Verdict:") == 1  # exactly one verdict per lesson
    assert_lesson_results(doc)
    assert doc["predictions"] and out.index("prediction:") < out.index("Verdict:")


def test_a_lessons_help_shows_its_whole_docstring(capsys):
    with pytest.raises(SystemExit):
        L02.main(["--help"])
    out = capsys.readouterr().out
    assert "The claim" in out and "Predict before you run" in out and "--quick" in out


# ---- 01: the stand-in cache and the phases' costs ----------------------------------------------


def test_01_stand_in_cache_gives_the_logits_of_recomputing(context_model):
    """Lesson 01 decodes without lesson 02's KV cache; its stand-in must still be exact."""
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


# ---- 02: FLOPs per generated token --------------------------------------------------------------


def test_02_flops_count_what_each_step_really_holds():
    cfg, P, N = PRESETS["tiny"], 8, 5
    naive, cached = L02.flops(cfg, P, N, torch.float32)
    assert naive == [step_cost(cfg, [P + i], [0]).flops for i in range(N)]
    # token i ≥ 1 comes from feeding token i − 1 after P + i − 1 cached ones
    assert cached == [step_cost(cfg, [P], [0]).flops] + [step_cost(cfg, [1], [P + i - 1]).flops for i in range(1, N)]


# ---- 03: the cache's memory, measured -------------------------------------------------------------


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


# ---- 04: the batch the roofline calls nearly free ----------------------------------------------


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


# ---- the course runner and the GPU check ------------------------------------------------


def test_run_all_discovers_numbered_lessons_in_order(tmp_path):
    import run_all
    stems = [p.stem for p in run_all.discover()]
    assert stems == ["01_phase_split", "02_kv_cache", "03_kv_memory", "04_memory_bound_decode", "05_fragmentation",
                     "06_paging_cost", "07_stutter", "08_budget_sweep", "09_launch_overhead", "10_prompt_caching",
                     "11_speculative_decoding", "12_goodput"]
    for name in ("07_later.py", "05_new.py", "common.py", "run_all.py", "measure.py", "5_bad.py"):
        (tmp_path / name).write_text("")
    assert [p.name for p in run_all.discover(tmp_path)] == ["05_new.py", "07_later.py"]


def test_run_all_dry_run_passes_flags(capsys):
    import run_all
    assert run_all.main(["--quick", "--model", "tiny", "--dry-run", "--only", "2"]) == 0
    out = capsys.readouterr().out
    assert "02_kv_cache.py" in out and "--quick" in out and "--model tiny" in out and "01_" not in out
    assert "--threads" not in out  # each lesson counts its free cores unless told
    assert run_all.main(["--threads", "1", "--dry-run", "--only", "2"]) == 0
    assert "--threads 1" in capsys.readouterr().out


def test_run_all_reports_each_lessons_verdict_or_why_there_is_none(tmp_path):
    import run_all
    lesson = Path("01_x.py")
    (tmp_path / "01_x.json").write_text(json.dumps({"verdict": {"outcome": "INCONCLUSIVE"}}))
    assert run_all.verdict_of(tmp_path, lesson, 0) == "INCONCLUSIVE"
    assert "exercise" in run_all.verdict_of(tmp_path, lesson, run_all.STUB_EXIT)
    assert "failed" in run_all.verdict_of(tmp_path, lesson, 1)
    assert run_all.verdict_of(tmp_path, Path("02_y.py"), 0) == "no results file"
    import common
    assert run_all.STUB_EXIT == common.STUB_EXIT


def test_run_all_runs_lessons_and_writes_their_times(tmp_path, capsys):
    import run_all
    assert run_all.main(["--quick", "--model", "tiny", "--device", "cpu", "--only", "03", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "run_all.json").read_text())
    assert [r["lesson"] for r in doc["lessons"]] == ["03_kv_memory"]
    assert doc["lessons"][0]["wall_s"] > 0 and doc["lessons"][0]["verdict"] in ("HOLDS", "NOT SUPPORTED")
    assert "03_kv_memory" in capsys.readouterr().out


def test_gpu_check_plans_every_lesson_and_fails_fast_without_cuda(capsys):
    sys.path.insert(0, str(LESSONS.parent))
    import gpu_check
    assert gpu_check.main(["--plan"]) == 0
    out = capsys.readouterr().out
    import run_all
    for path in run_all.discover():
        for model in ("gpt2", "gpt2-xl"):
            assert f"{path.stem} {model}:" in out
    assert "bench gpt2-xl bf16" in out
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err
