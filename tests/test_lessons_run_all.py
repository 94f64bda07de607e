"""The course runner (`lessons/run_all.py`) and the GPU check's plan: every numbered lesson, in order."""
import json
import sys
from pathlib import Path

import torch

from lessons_support import LESSONS  # also puts lessons/ on sys.path


def test_run_all_discovers_numbered_lessons_in_order(tmp_path):
    import run_all
    stems = [p.stem for p in run_all.discover()]
    assert stems == ["01_kv_cache", "02_phase_split", "03_launch_overhead", "04_memory_bound_decode", "05_kv_memory",
                     "06_fewer_bytes", "07_fragmentation", "08_paging_cost", "09_continuous_batching", "10_stutter",
                     "11_budget_sweep", "12_goodput", "13_prompt_caching", "14_speculative_decoding",
                     "15_disaggregation"]
    for name in ("07_later.py", "05_new.py", "common.py", "run_all.py", "notes.py", "5_bad.py"):
        (tmp_path / name).write_text("")
    assert [p.name for p in run_all.discover(tmp_path)] == ["05_new.py", "07_later.py"]


def test_run_all_dry_run_passes_flags(capsys):
    import run_all
    assert run_all.main(["--quick", "--model", "tiny", "--dry-run", "--only", "2"]) == 0
    out = capsys.readouterr().out
    assert "02_phase_split.py" in out and "--quick" in out and "--model tiny" in out and "01_" not in out
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
    assert run_all.main(["--quick", "--model", "tiny", "--device", "cpu", "--only", "05", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "run_all.json").read_text())
    assert [r["lesson"] for r in doc["lessons"]] == ["05_kv_memory"]
    assert doc["lessons"][0]["wall_s"] > 0 and doc["lessons"][0]["verdict"] in ("HOLDS", "NOT SUPPORTED")
    assert "05_kv_memory" in capsys.readouterr().out


def test_gpu_check_plans_every_lesson_and_fails_fast_without_cuda(capsys):
    sys.path.insert(0, str(LESSONS.parent))
    import gpu_check
    assert gpu_check.main(["--plan"]) == 0
    out = capsys.readouterr().out
    import run_all
    for path in run_all.discover():
        for model in ("gpt2", "gpt2-xl"):  # every lesson, but those whose workers need a GPU each
            assert (f"{path.stem} {model}:" in out) != (path.stem in gpu_check.NEEDS_TWO_GPUS), path.stem
    assert "bench gpt2-xl bf16" in out
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_run_all_counts_decisive_verdicts_and_checks_that_flip_between_runs(tmp_path):
    import pytest
    import run_all
    row = lambda lesson, run, verdict, **checks: {"lesson": lesson, "run": run, "verdict": verdict,  # noqa: E731
                                                   "checks": checks}
    summary = [row("01_a", 1, "HOLDS", speedup="HOLDS", growth="HOLDS"),
               row("01_a", 2, "NOT SUPPORTED", speedup="HOLDS", growth="NOT SUPPORTED"),
               row("02_b", 1, "HOLDS", x="HOLDS"), row("02_b", 2, "INCONCLUSIVE", x="INCONCLUSIVE"),
               row("03_c", 1, "failed (see its output above)"), row("03_c", 2, "HOLDS", y="HOLDS")]
    flips = run_all.count_flips(summary)
    assert flips["01_a"] == {"verdicts": ["HOLDS", "NOT SUPPORTED"], "verdict_flipped": True,
                             "checks_flipped": ["growth"]}
    assert not flips["02_b"]["verdict_flipped"] and flips["02_b"]["checks_flipped"] == []  # INCONCLUSIVE: no flip
    assert not flips["03_c"]["verdict_flipped"]
    lesson = Path("04_d.py")
    (tmp_path / "04_d.json").write_text(json.dumps({"verdict": {"checks": [
        {"name": "a ratio", "key": "ratio", "outcome": "HOLDS"}, {"name": "old", "outcome": "INCONCLUSIVE"}]}}))
    assert run_all.check_outcomes(tmp_path, lesson, 0) == {"ratio": "HOLDS", "old": "INCONCLUSIVE"}
    assert run_all.check_outcomes(tmp_path, lesson, 1) == {} == run_all.check_outcomes(tmp_path, Path("05_e.py"), 0)
    with pytest.raises(SystemExit):
        run_all.main(["--runs", "0", "--dry-run"])
