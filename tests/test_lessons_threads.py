"""Threads that fit the machine (minillm/bench/threads.py): the free cores, `--threads`, and the choice saved by lessons."""
import json
import subprocess
import sys

import pytest

from minillm.bench import threads
from lessons_support import load_lesson


def stat(*busy_per_cpu):
    """A /proc/stat with the given busy ticks per CPU (user column) and 1000 idle ticks each."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"] + [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(busy_per_cpu)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("cpus,busy,free", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1),
                                            (8, 2.9, 5), (1, 1.0, 1)])
def test_free_cores_are_the_cpus_less_the_busy_ones_and_at_least_one(cpus, busy, free):
    assert threads.free_cores(cpus, busy) == free


def test_busy_cores_counts_what_others_used_on_our_cpus_only(tmp_path, monkeypatch):
    path = tmp_path / "stat"
    path.write_text(stat(0, 0, 0))
    tick = threads.os.sysconf("SC_CLK_TCK")

    def sleep(seconds):  # meanwhile another process keeps cpu1 busy, and cpu2 (not ours) too
        path.write_text(stat(0, int(seconds * tick), int(seconds * tick)))
    monkeypatch.setattr(threads.time, "sleep", sleep)
    busy = threads.busy_cores([0, 1], window_s=0.5, path=str(path))
    assert busy == pytest.approx(1.0, rel=0.2)
    assert threads.busy_cores([0, 1], path=str(tmp_path / "missing")) is None


def test_choose_threads_says_why_and_respects_a_request(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "busy_cores", lambda cpus, window_s: 1.1)
    c = threads.choose_threads()
    assert c.threads == 1 and c.method == "/proc/stat" and c.busy == 1.1 and c.cpus == 2
    assert "2 CPUs in this process's affinity" in c.reason and "kept 1.1 of them busy" in c.reason
    asked = threads.choose_threads(3)
    assert asked.threads == 3 and asked.method == "asked for" and "--threads" in asked.reason
    with pytest.raises(ValueError, match="--threads 0 must be at least 1"):
        threads.choose_threads(0)
    monkeypatch.setattr(threads, "busy_cores", lambda cpus, window_s: None)  # no /proc/stat: the load average
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert threads.choose_threads().method == "load average" and threads.choose_threads().threads == 2


def test_a_busy_process_is_seen_on_this_machine():
    """A busy loop on one of our CPUs: the window sees at least half a core of it (more if others are busy too)."""
    assert sys.platform.startswith("linux"), "this test reads /proc/stat, which only Linux has"
    cpu = threads.affinity_cpus()[0]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        import time
        time.sleep(0.3)
        seen = threads.busy_cores([cpu], window_s=0.3)
    finally:
        busy.kill()
        busy.wait()
    assert seen is not None and seen >= 0.5


def test_a_lesson_prints_and_saves_its_thread_choice(tmp_path, capsys):
    lesson = load_lesson("05_kv_memory")
    lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--threads", "1", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "05_kv_memory.json").read_text())
    assert doc["threads"]["threads"] == 1 and doc["threads"]["method"] == "asked for"
    assert "threads: 1 thread, as asked (--threads)" in capsys.readouterr().out
    assert "--threads 1" in doc["command"]


@pytest.mark.parametrize("first, env, policy", [("minillm", None, "PASSIVE"), ("torch, minillm", None, None),
                                                ("minillm", "ACTIVE", "ACTIVE")])
def test_importing_minillm_sets_the_openmp_wait_policy_only_before_torch_loads(first, env, policy):
    """OpenMP reads OMP_WAIT_POLICY once, as torch loads it: minillm sets PASSIVE only while that is still ahead,
    never over a policy the user chose, and every thread choice names the policy it runs under."""
    code = (f"import os, {first}\nfrom minillm.bench import threads\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), '|', threads.choose_threads(1).reason)")
    environ = {k: v for k, v in threads.os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env:
        environ["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True).stdout
    value, reason = out.strip().split(" | ")
    assert value == str(policy)
    assert reason.endswith({"PASSIVE": "sleep at barriers (OMP_WAIT_POLICY=PASSIVE), not pinned",
                            "ACTIVE": "spin at barriers (OMP_WAIT_POLICY=ACTIVE), not pinned",
                            None: "(OMP_WAIT_POLICY unset: the runtime's default), not pinned"}[policy])
