"""The course on a busy machine: one core kept busy by a Python loop that this test
starts and stops may make `run_all.py --quick` slower, or a lesson INCONCLUSIVE, but never flip a verdict.

    python -m pytest -m slow tests/test_lessons_busy.py -q -s      # on a quiet 2-core machine: about 13 minutes

It runs the course twice, quiet and then beside the busy loop, and holds both halves of the promise: quiet, at most
QUIET_LIMIT_S and all but three lessons decisive (HOLDS or NOT SUPPORTED); busy, within twice the quiet time, all but
four decisive, and no decisive verdict that differs from the quiet run's. Its figures are printed (-s).

The bounds are this machine's, measured (docs/lessons.md): on the quiet 2-core AVX2 EPYC the 13 lessons took 364 s
with 10 decisive, and 419 s with 11 beside the busy core, none flipped. Lessons 12 and 15 judge served traffic on two
cores and come out INCONCLUSIVE as often as not; lesson 04's batch-4 line sits inside this CPU's noise.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DECISIVE = ("HOLDS", "NOT SUPPORTED")
QUIET_LIMIT_S = 450  # 271–364 s measured quiet on the 2-core AVX2 EPYC (2026-12-03), and a quarter over the slower


def run_course(out: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "lessons" / "run_all.py"), "--quick", "--out", str(out)],
                   check=False, stdout=subprocess.DEVNULL)
    doc = json.loads((out / "run_all.json").read_text())
    doc["outer_s"] = time.perf_counter() - t0
    return doc


def verdicts(doc: dict) -> dict:
    return {row["lesson"]: row["verdict"] for row in doc["lessons"]}


@pytest.mark.slow
def test_one_busy_core_slows_the_course_but_flips_no_verdict(tmp_path):
    quiet = run_course(tmp_path / "quiet")
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)  # let the loop be running before the first lesson counts the free cores
        busy = run_course(tmp_path / "busy")
    finally:
        busy_loop.kill()
        busy_loop.wait()
    q, b = verdicts(quiet), verdicts(busy)
    print(f"\nquiet: {quiet['total_s']:.1f} s, {quiet['decisive']} decisive: {q}")
    print(f"busy:  {busy['total_s']:.1f} s, {busy['decisive']} decisive: {b}")
    assert all(row["rc"] == 0 for row in quiet["lessons"] + busy["lessons"]), (quiet["lessons"], busy["lessons"])
    assert quiet["total_s"] <= QUIET_LIMIT_S, (f"quiet run_all --quick took {quiet['total_s']:.0f} s, over "
                                               f"{QUIET_LIMIT_S} s (docs/lessons.md has 271 s; 364 s before the "
                                               "grouped gather)")
    assert quiet["decisive"] >= len(q) - 3, q
    assert busy["total_s"] <= 2 * quiet["total_s"], (busy["total_s"], quiet["total_s"])
    assert busy["decisive"] >= len(b) - 4, b
    flipped = {k: (q[k], b[k]) for k in q if q[k] in DECISIVE and b[k] in DECISIVE and q[k] != b[k]}
    assert not flipped, f"a busy core flipped these verdicts (quiet, busy): {flipped}"
