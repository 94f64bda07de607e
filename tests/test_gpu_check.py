"""gpu_check.py without a GPU: the plan, the budget, the alarm, the results kept, the model cache, the targets.

The check itself needs CUDA; what it is made of does not, and is checked here
so that the one run on a lent GPU does not fail on a typo, an unbounded stage
or a result written too late.
"""
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lessons")]
import gpu_check  # noqa: E402
from minillm.bench import gpu_targets  # noqa: E402

from minillm.bench import alarm  # noqa: E402


def test_the_plan_runs_the_most_valuable_stages_first_and_fits_the_budget(capsys):
    assert gpu_check.main(["--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(":")[0] for line in lines[:-1]]
    first_lesson_xl = next(i for i, n in enumerate(names) if n.endswith(" gpt2-xl") and n[:2].isdigit())
    assert names[:4] == ["correctness", "targets gpt2-xl", "targets gpt2", "pytest -m gpu"]
    assert all(n.endswith(" gpt2") for n in names[6:first_lesson_xl - 1])  # every gpt2 lesson, then the compiled one
    assert names[first_lesson_xl - 1] == "compiled reference gpt2-xl"
    assert "past the budget" not in " ".join(lines[:first_lesson_xl])  # all of it fits in the budget, by the estimates
    planned = float(lines[-1].split()[1])
    assert planned <= gpu_check.BUDGET_S


def test_no_cuda_is_a_clear_exit(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same path on a machine with CUDA
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_alarm_is_not_swallowed_by_except_exception():
    def swallowing():
        try:
            time.sleep(5)
        except Exception:
            pass
        return "ran on"
    t0 = time.perf_counter()
    with pytest.raises(alarm.Alarm, match="limit"):
        with alarm.time_limit(0.1, "limit"):
            swallowing()
    assert time.perf_counter() - t0 < 2
    with pytest.raises(alarm.Alarm):  # nor by a run in process: it reaches the runner
        with alarm.time_limit(0.1, "limit"):
            gpu_check.in_process(swallowing_loop)


def swallowing_loop():
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


def test_the_alarm_waits_for_a_cuda_graph_capture_to_end(monkeypatch):
    """Rung while a capture is under way, the alarm rings again until the capture is over, and only then raises."""
    capture_ends = time.perf_counter() + 0.4
    monkeypatch.setattr(alarm, "capturing", lambda: time.perf_counter() < capture_ends)
    with pytest.raises(alarm.Alarm):
        with alarm.time_limit(0.05, "limit"):
            while True:
                time.sleep(0.005)
    assert time.perf_counter() >= capture_ends


def test_a_run_in_process_reports_its_outcome():
    assert gpu_check.in_process(lambda: print("hello")) == {"ok": True, "rc": 0, "output_tail": "hello\n"}
    result = gpu_check.in_process(lambda: 1 / 0)
    assert not result["ok"] and "ZeroDivisionError" in result["output_tail"]
    assert gpu_check.in_process(lambda: sys.exit(3))["rc"] == 3


def test_the_runner_keeps_to_its_budget_and_saves_before_and_after_every_stage(tmp_path):
    """Stages that pass, fail, run past their limit, need CUDA, or do not fit in what is left: each is recorded
    as such, the report on disk is whole at every save, and a stage running is named while it runs."""
    path = tmp_path / "gpu_check.json"
    report, seen = {"stages": {}}, []

    def save():
        gpu_check.write_atomically(path, json.dumps(report))
        seen.append(json.loads(path.read_text()))

    def running():  # what the file said while this stage ran
        return seen[-1].get("running")
    stages = [gpu_check.Stage("passes", 0.5, lambda: {"ok": True, "saw": running()}),
              gpu_check.Stage("fails", 0.5, lambda: 1 / 0),
              gpu_check.Stage("overruns", 0.1, lambda: time.sleep(60) or {"ok": True}),
              gpu_check.Stage("needs cuda", 0.1, lambda: {"ok": True}, cuda_only=True),
              gpu_check.Stage("too long", 100, lambda: {"ok": True}, required=False),
              gpu_check.Stage("needs a package", 0.1, lambda: {"ok": True}, missing=("fastapi",)),
              gpu_check.Stage("after", 0.1, lambda: {"ok": False})]
    t0 = time.perf_counter()
    gpu_check.run_stages(stages, 5, on_cuda=False, report=report, save=save)
    assert time.perf_counter() - t0 < 20  # the overrun was stopped (at twice its estimate), not slept out: a busy
    # machine may stretch the stages around it, never by the 60 s it asked for
    got = {name: s["status"] for name, s in report["stages"].items()}
    assert got == {"passes": "ok", "fails": "failed", "overruns": "stopped", "needs cuda": "skipped",
                   "too long": "skipped", "needs a package": "skipped", "after": "failed"}
    assert report["stages"]["passes"]["saw"] == "passes"
    assert "ZeroDivisionError" in report["stages"]["fails"]["error"]
    assert "time budget" in report["stages"]["too long"]["why"]
    assert report["stages"]["needs a package"]["why"] == "needs fastapi, not installed here"
    assert [list(s["stages"]) for s in seen if "running" not in s] == [list(got)[:i + 1] for i in range(len(got))]
    assert not gpu_check.passed(report)
    report["stages"] = {k: v for k, v in report["stages"].items() if v["status"] != "failed" and k != "overruns"}
    assert gpu_check.passed(report)  # skipped for CUDA on a dry run, or an optional stage out of time: not failures
    report["stages"]["too long"]["required"] = True
    assert not gpu_check.passed(report)


def test_killed_mid_stage_the_dry_run_leaves_every_earlier_result_readable(tmp_path):
    """gpu_check.py --dry-run in a process of its own, killed (SIGKILL, no clean-up) while a later stage runs:
    the results file and the packed file in $OUT hold every stage that had finished, each result readable."""
    out, packed = tmp_path / "results", tmp_path / "OUT"
    env = {**os.environ, "OUT": str(packed), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "gpu_check.py"), "--dry-run", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "cpu" / "gpu_check.json"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            doc = json.loads(results.read_text()) if results.exists() else {}  # whole at every moment
            if doc.get("running") == "targets tiny":
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the dry run never reached the stage to kill it in (exit {proc.poll()})")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    doc = json.loads(results.read_text())
    assert doc["running"] == "targets tiny" and list(doc["stages"]) == ["correctness"]
    assert doc["stages"]["correctness"]["status"] == "ok" and doc["stages"]["correctness"]["tests"] >= 6
    with tarfile.open(packed / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
        assert json.load(tar.extractfile("cpu/gpu_check.json"))["stages"] == doc["stages"]
    assert "cpu/pytest_correctness.xml" in names


def test_lessons_share_one_model_cache_and_their_json_is_kept_when_each_ends(tmp_path):
    """Lesson 02 twice on tiny in this process, then lesson 03 (which builds its ladder of shapes and their twins
    itself): no random model is built twice, and each lesson's JSON lies in the results folder as soon as it ends."""
    from run_all import discover
    lessons = {p.stem[:2]: p for p in discover()}
    argv = ["--device", "cpu", "--model", "tiny", "--quick"]
    with gpu_check.model_cache() as cache:
        for _ in range(2):
            first = gpu_check.lesson_stage(lessons["02"], argv, tmp_path / "scratch", tmp_path / "kept")
            assert first["ok"], first["output_tail"]
            assert json.loads((tmp_path / "kept" / f"{lessons['02'].stem}.json").read_text())
        assert cache.builds == 1
        result = gpu_check.lesson_stage(lessons["03"], argv, tmp_path / "scratch", tmp_path / "kept")
        assert result["ok"], result["output_tail"]
        assert cache.builds == 4  # tiny was there; mini, and the twins of tiny and mini, are new
    from minillm.checkpoints import load as weights
    assert weights.random_model is not cache  # put back


def test_the_targets_are_measured_and_judged():
    """The targets on the CPU with `tiny` in fp32: the floor, both engines, the op counts and the reference's
    generate on the same weights (its logits match ours, nothing compiled), then the provisional verdicts."""
    result = gpu_targets.check_targets("tiny", device="cpu", dtype=torch.float32,
                                       short=2, long=40)  # enough tokens that load cannot flip the sign
    assert result["ok"] and result["graph_tokens_equal_eager"] and result["weight_read_floor_s"] > 0
    assert result["graph"]["s_per_token"] > 0 and result["graph_times_floor"] > 0
    assert result["ops_per_step"]["static"]["kernels"] > 0 and result["ops_per_step"]["eager"]["kernels"] > 0
    assert result["max_abs_logit_diff_vs_minillm"] < 1e-4, result
    assert result["speedup_vs_reference_eager"] > 0 and result["reference_static"]["dynamo_graphs"] == 0, result
    judged = gpu_targets.judge({"gpt2": result, "gpt2-xl": {}})
    assert judged["gpt2 graph_times_floor"]["value"] == result["graph_times_floor"]
    assert judged["gpt2 graph_times_floor"]["provisional"] and judged["gpt2 graph_times_floor"]["estimate"]
    assert judged["gpt2-xl graph_times_floor"]["met"] is None  # not measured is not met, and says so


@pytest.mark.slow
def test_the_compiled_reference_compiles_before_it_is_timed():
    """The compiled reference on the CPU (transformers told to compile on any device): graphs are compiled
    during its warm-up, none while it is timed, and its logits still match ours."""
    from minillm.checkpoints.load import load_model
    result = gpu_targets.compiled_reference(load_model("tiny", "cpu", torch.float32), short=2, long=10)
    assert result["ok"] and result["graphs_compiled_before_timing"] > 0, result
    assert result["reference_compiled"]["dynamo_graphs"] == 0 and result["reference_compiled"]["s_per_token"] > 0
    assert result["max_abs_logit_diff_vs_minillm"] < 1e-4
