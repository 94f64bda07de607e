"""gpu_check.py without a GPU: its plan, its in-process runner, and its targets measured on the CPU with `tiny`.

The check itself needs CUDA; what it is made of does not, and is checked here so
that the one run on a GPU does not fail on a typo.
"""
import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lessons")]
import gpu_check  # noqa: E402


def test_lessons_are_found_by_file_name_whatever_their_number(tmp_path):
    for name in ("01_phase_split.py", "09_launch_overhead.py", "10_prompt_caching.py", "notes.py"):
        (tmp_path / name).write_text("")
    gpu_check.LESSON_ARGS["launch_overhead"] = ["--flag"]
    try:
        from run_all import discover
        steps = gpu_check.plan(discover(tmp_path), ["gpt2"], quick=True)
    finally:
        del gpu_check.LESSON_ARGS["launch_overhead"]
    labels = [label for label, _, _ in steps]
    assert labels == ["pytest -m gpu", "bench gpt2 bf16", "01_phase_split gpt2", "09_launch_overhead gpt2",
                      "10_prompt_caching gpt2"]
    assert steps[3][2] == ["--device", "cuda", "--model", "gpt2", "--flag", "--quick"]


def test_dry_run_lists_the_checks_targets_and_runs(capsys):
    assert gpu_check.main(["--dry-run", "--models", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "targets gpt2:" in out and "pytest -m gpu:" in out and "python lessons/01_phase_split.py" in out


def test_no_cuda_is_a_clear_exit(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_run_in_process_reports_its_outcome():
    assert gpu_check.run_in_process(lambda: print("hello"), 5) == (0, "hello\n")
    rc, out = gpu_check.run_in_process(lambda: 1 / 0, 5)
    assert rc == 1 and "ZeroDivisionError" in out
    rc, _ = gpu_check.run_in_process(lambda: sys.exit(3), 5)
    assert rc == 3
    t0 = time.perf_counter()
    rc, out = gpu_check.run_in_process(lambda: time.sleep(5), 0.2)
    assert rc == 124 and "stopped after" in out and time.perf_counter() - t0 < 4  # well before the sleep ends, on a busy machine too


def test_a_lesson_runs_in_process_on_a_model_built_once(tmp_path, monkeypatch):
    """A lesson run twice on the same shape, in this process: it writes its results, and the model is built once."""
    import common
    from minillm import weights
    builds = []

    def counting_load(*args, **kwargs):
        builds.append(args)
        return weights.load_model(*args, **kwargs)
    monkeypatch.setattr(common, "load_model", gpu_check.ModelCache(counting_load))
    from run_all import discover
    for path in discover()[:1] * 2:
        argv = ["--device", "cpu", "--model", "tiny", "--quick", "--out", str(tmp_path)]
        rc, out = gpu_check.run_in_process(lambda: gpu_check.load_lesson(path).main(argv), 120)
        if rc != 0:  # run it again unguarded, so that its own exception (a stub's, in a student copy) surfaces
            gpu_check.load_lesson(path).main(argv)
        assert rc == 0, out[-2000:]
        assert json.loads((tmp_path / f"{path.stem}.json").read_text())
    assert len(builds) == 1


def test_the_targets_are_measured_and_judged(monkeypatch):
    """The targets check, on the CPU with `tiny` in fp32: the floor, both engines, the op counts and the
    reference's generate on the same weights (its logits match ours), then the verdicts."""
    pytest.importorskip("transformers")
    from minillm import metrics
    from minillm.weights import load_model
    result = gpu_check.check_targets(torch, metrics, gpu_check.ModelCache(load_model), "tiny", device="cpu",
                                     dtype=torch.float32, short=2, long=10)
    assert result["graph_tokens_equal_eager"] and result["weight_read_floor_s"] > 0
    assert result["graph"]["s_per_token"] > 0 and result["graph_times_floor"] > 0
    assert result["ops_per_step"]["static"]["kernels"] > 0 and result["ops_per_step"]["eager"]["kernels"] > 0
    assert result["max_abs_logit_diff_vs_minillm"] < 1e-4, result
    assert result["speedup_vs_reference_eager"] > 0 and "s_per_token" in result["reference_static"], result
    judged = gpu_check.judge({"gpt2": result, "gpt2-xl": {}})
    assert judged["gpt2 graph_times_floor"]["value"] == result["graph_times_floor"]
    assert judged["gpt2-xl graph_times_floor"]["met"] is None  # not measured is not met, and says so
