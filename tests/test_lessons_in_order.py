"""A student copy runs the lessons in order: lesson N needs only the exercises of lessons 01..N.

Each test makes a copy (`python -m minillm.classroom make`) in which every exercise of a lesson after N is
still a stub, runs there (tiny model, --quick) every lesson before the first one that teaches a stubbed
exercise, and checks that this one stops with one line that names the exercise, says where it is and how
to check it.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.classroom.manifest import MANIFEST
from minillm.classroom.regions import find_exercises

ROOT = Path(__file__).resolve().parents[1]
# `make` copies what git tracks, so the copies these tests make come from the reference project, not a student copy.
pytestmark = pytest.mark.skipif((ROOT / MANIFEST).exists(),
                                reason="a student copy: the course's lesson order is checked in the reference project")
# The course's exercise → lesson map; an exercise not listed here is placed by its marker's lesson number.
LESSON_OF = {"model-heads": 1, "model-causal-attention": 1, "sampling-top-k": 1, "sampling-top-p": 1,
             "kv-cache-write": 1, "kv-cache-read": 1, "quantize-per-channel": 6, "paged-allocate": 7, "paged-free": 7,
             "paged-slot-mapping": 7, "paged-gather": 7, "scheduler-preempt": 7, "scheduler-admit": 7,
             "scheduler-finish": 7, "scheduler-budget-fill": 10, "prefix-match": 13, "speculative-accept": 14}


def lesson_of(ex) -> int:
    return LESSON_OF.get(ex.id, int(ex.lesson))


def copy_up_to(n: int, target: Path) -> tuple[Path, list]:
    """A student copy with every exercise of a lesson after `n` stubbed (the project itself when there is
    none); returns where it is and the stubbed exercises."""
    later = [ex for ex in find_exercises(ROOT) if lesson_of(ex) > n]
    if not later:
        return ROOT, []
    subprocess.run([sys.executable, "-m", "minillm.classroom", "make", str(target), "--only",
                    ",".join(ex.id for ex in later)], cwd=ROOT, check=True, capture_output=True, text=True)
    return target, later


def run_lesson(copy: Path, number: int, out: Path) -> subprocess.CompletedProcess:
    lesson = next((copy / "lessons").glob(f"{number:02d}_*.py"))
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}  # the copy's minillm, not this one
    return subprocess.run([sys.executable, str(lesson), "--model", "tiny", "--device", "cpu", "--quick",
                           "--out", str(out)], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


def assert_stops_at_a_stub(result, stubbed: list) -> None:
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    names = [ex for ex in stubbed if f"exercise {ex.id}," in lines[0]]
    assert names, lines[0]
    ex = names[0]
    assert f"{ex.file}:" in lines[0] and f"python -m minillm.classroom check {ex.id}" in lines[0]


def check_course_up_to(n: int, tmp_path: Path) -> None:
    """Every lesson before the first one that teaches a stubbed exercise runs; that one stops at a stub."""
    copy, stubbed = copy_up_to(n, tmp_path / "student")
    lessons = sorted(int(p.name[:2]) for p in (copy / "lessons").glob("[0-9][0-9]_*.py"))
    first_needing = min((lesson_of(ex) for ex in stubbed), default=None)
    for number in [x for x in lessons if first_needing is None or x < first_needing]:
        result = run_lesson(copy, number, tmp_path / "out")
        assert result.returncode == 0, f"lesson {number:02d}:\n" + result.stdout[-2000:] + result.stderr[-3000:]
    if first_needing in lessons:
        assert_stops_at_a_stub(run_lesson(copy, first_needing, tmp_path / "out"), stubbed)


def test_lesson_01_runs_with_only_lesson_01s_exercises_written(tmp_path):
    check_course_up_to(1, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 5, 7])
def test_the_lessons_up_to_n_run_with_only_their_exercises_written(n, tmp_path):
    check_course_up_to(n, tmp_path)


@pytest.mark.slow
def test_a_fully_stubbed_copy_stops_lesson_01_with_one_line(tmp_path):
    copy, stubbed = copy_up_to(0, tmp_path / "student")
    assert_stops_at_a_stub(run_lesson(copy, 1, tmp_path / "out"), [ex for ex in stubbed if lesson_of(ex) == 1])
