"""The command lines under faults: Ctrl-C is one line and exit 130; doomed work is refused before it starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minillm import PRESETS
from minillm import cli
from minillm.bench import offline as bench
from minillm.bench import bench_checks

REPO_ROOT = Path(__file__).resolve().parent.parent

# A child that runs `python -m minillm <argv>` with its first long call (`target`) replaced by one that says so
# and waits: the parent then delivers a real SIGINT in the middle of the command.
CHILD = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a parent run in the background left it ignored
    import minillm.cli as cli
    from minillm.bench import offline as bench
    module, name = sys.argv[1].split(":")
    def waits(*args, **kwargs):
        print("working", flush=True)
        time.sleep(60)
    setattr({"cli": cli, "bench": bench}[module], name, waits)
    sys.exit(cli.main(sys.argv[2:]))
""")


@pytest.mark.parametrize("target, argv", [
    ("cli:cached_generate", ["generate", "--model", "tiny", "--prompt", "Hello"]),
    ("bench:emulation_slowdown", ["bench", "--model", "tiny", "--prompt-len", "8"]),
])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, target, argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, target, *argv, "--weights-dir", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline() == "working\n", child.stderr.read()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130 and err.splitlines() == [
        f"interrupted: python -m minillm {argv[0]} stopped by Ctrl-C"], err


@pytest.fixture
def nothing_measured(monkeypatch):
    """Make every measurement of bench an error: a test passes only if bench refuses before measuring."""
    def measured(*args, **kwargs):
        raise AssertionError("bench started measuring")
    for name in ("emulation_slowdown", "measure_ceilings", "time_prefill", "time_decode"):
        monkeypatch.setattr(bench, name, measured)


def test_bench_refuses_a_batch_that_cannot_fit_before_measuring(capsys, tmp_path, monkeypatch, nothing_measured):
    monkeypatch.setattr(bench_checks, "available_memory", lambda device: 2**30)
    code = cli.main(["bench", "--model", "tiny", "--batch", "400000", "--prompt-len", "64",
                     "--weights-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --batch 400000 needs at least 73.2 GiB (the prefill of 400000 × 64 tokens") and \
        "but cpu has 1.0 GiB available; lower --batch (at most about 5,461 fits)" in err, err
    assert len(err.splitlines()) == 1


def test_the_memory_check_counts_the_larger_phase(monkeypatch):
    """Prefill: the KV and about 8 activations of n_embd per token; decode: the KV of context + 1 tokens."""
    cfg = PRESETS["tiny"]  # KV 2 · 2 layers · 64 · 4 B = 1 KiB a token; activations 8 · 64 · 4 B = 2 KiB

    def check(**kw):
        bench.check_memory(cfg, torch.float32, torch.device("cpu"), **kw)
    monkeypatch.setattr(bench_checks, "available_memory", lambda device: 3 * 1024 * 1000)
    check(prompt_len=1000, context=0, batch=1)  # the prefill: 3 KiB × 1,000 tokens, all the memory there is
    with pytest.raises(ValueError, match=r"--batch 2 needs at least .* \(the prefill of 2 × 1000 tokens"):
        check(prompt_len=1000, context=0, batch=2)
    check(prompt_len=1, context=2999, batch=1)  # the decode: 1 KiB × 3,000 tokens
    with pytest.raises(ValueError, match=r"--batch 1 needs at least .* \(the decode step's KV of 1 × 3001 tokens"):
        check(prompt_len=1, context=3000, batch=1)


@pytest.mark.parametrize("where, why", [("/proc/nope/r.json", "No such file or directory"),
                                        (".", "it is a folder")])
def test_bench_checks_its_json_path_before_any_work(capsys, monkeypatch, nothing_measured, where, why):
    def loaded(*args, **kwargs):
        raise AssertionError("bench loaded a model")
    monkeypatch.setattr(bench, "load_model", loaded)
    code = cli.main(["bench", "--model", "tiny", "--json", where])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --json {where}: cannot write there") and why in err, err
