"""Grading, end to end: splice the submission's regions into the instructor's package, run each exercise in a
child of its own, judge what came back. Returns the scores and the seed the held-out inputs were drawn from."""
from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from .answers import read_answers
from .callers import caller_source
from .exposure import check_out_of_reach
from .judge import EXERCISE_TESTS, Score, cases_of, failed_all, judge, load_checks
from .off_limits import forbidden_calls, off_limits_of
from .manifest import MANIFEST, is_student_copy, read_manifest
from .regions import Exercise, ExerciseError, parse_regions
from . import users
from .access import check_user_can_run, user_ids
from .runner import run_children
from .splice import spliced_folder
from .wire import to_wire

DEFAULT_TIMEOUT_S = 60   # per exercise (MINILLM_GRADE_TIMEOUT); a correct one needs a few seconds


def grade_exercises(exercises: list[Exercise], root: Path, submission: Path | None = None, seed: int | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S, jobs: int | None = None,
                    user: str | None = None, visible_only: bool = False) -> tuple[list[Score], int | None]:
    """Grade the regions of `exercises` as `submission` (default: `root` itself) wrote them, against the checks and
    the package of the instructor's tree at `root`. With `visible_only` (`check` in a student copy, which holds no
    answer key), run the visible cases alone and judge them against the copy's literal answers; the seed is None."""
    root = Path(root).resolve()
    submission = Path(submission or root).resolve()
    if not visible_only and is_student_copy(root):
        raise ExerciseError(f"{root} is a student copy: it holds the visible cases' answers but no answer key, so the "
                            f"held-out checks run at grading, in your instructor's copy; here `python -m "
                            f"minillm.classroom check ID` runs an exercise's visible cases")
    answers = (read_answers(root) or {}) if visible_only else None
    seed = None if visible_only else grade_seed() if seed is None else seed
    checks = load_checks(root)
    if not checks:
        raise ExerciseError(f"{root / EXERCISE_TESTS} holds no checks, so this tree cannot grade: the held-out checks "
                            f"run at grading, in your instructor's copy")
    missing = [ex.id for ex in exercises if ex.id not in checks]
    if missing:
        raise ExerciseError(f"no check in {EXERCISE_TESTS}/ for exercise{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)}; every exercise needs one (see exercise_checks.py)")
    listed = read_manifest(root)["files"] if (root / MANIFEST).exists() else None
    ids = user_ids(user) if user else None
    if ids:
        check_out_of_reach(user, root, exercises)
        users.refuse_if_busy(user, ids[0])
        users.remove_leftovers(ids[0])       # each grade starts clean, whatever an older grader left
    folder, broken = spliced_folder(root, submission, exercises, listed, ids[1] if ids else None)
    homes = users.private_folder(*ids, "minillm-homes-") if ids else Path(tempfile.mkdtemp(prefix="minillm-homes-"))
    try:
        if user:
            check_user_can_run(user, folder)
        scores: dict[str, Score] = {}
        work = []
        for ex in exercises:
            check, cases = checks[ex.id], cases_of(checks[ex.id], seed, answers)
            if ex.id in broken:
                scores[ex.id] = failed_all(ex, cases, f"not graded, as its region cannot be taken: {broken[ex.id]}")
                continue
            body = _region_body(folder, ex)
            banned = forbidden_calls(ex, body, off_limits_of(ex, check, exercises, root))
            if banned:
                scores[ex.id] = failed_all(ex, cases, f"the code uses {', '.join(banned)}, which this exercise puts "
                                                      f"off limits (see its hint): write it yourself")
                continue
            home = homes / ex.id             # HOME and TMPDIR of this run alone
            home.mkdir(mode=0o700)
            home.chmod(0o700)
            if ids:
                os.chown(home, *ids)
            job = {"exercise": ex.id, "caller": caller_source(check), "home": str(home),
                   "cases": [[i, c.name, to_wire(c.inputs)] for i, c in enumerate(cases)]}
            work.append((ex, check, cases, job))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        runs = run_children([(ex.id, job) for ex, _, _, job in work], folder, timeout, jobs or cores, user, homes)
        for ex, check, cases, _ in work:
            scores[ex.id] = judge(ex, check, cases, runs[ex.id])
        return [scores[ex.id] for ex in exercises], seed
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(homes, ignore_errors=True)
        if ids:                              # every process of the uid is gone: what it left, it left for good
            users.remove_leftovers(ids[0])


def _region_body(folder: Path, ex: Exercise) -> list[str]:
    text = (folder / ex.file).read_text(encoding="utf-8")
    return list(next(r for r in parse_regions(text, ex.file) if r.id == ex.id).body)


def grade_timeout(given: float | None) -> float:
    text = os.environ.get("MINILLM_GRADE_TIMEOUT", "").strip() if given is None else str(given)
    try:
        timeout = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise ExerciseError(f"time limit {text!r} (--timeout or MINILLM_GRADE_TIMEOUT) must be a number of seconds "
                            f"above 0; the default is {DEFAULT_TIMEOUT_S}")
    return timeout


def grade_seed() -> int:
    """MINILLM_GRADE_SEED, with a warning, or a fresh seed: a fixed seed lets a table of answers built offline
    pass, so it is for reproducing one grade only."""
    text = os.environ.get("MINILLM_GRADE_SEED", "").strip()
    if not text:
        return secrets.randbelow(2**31)
    try:
        seed = int(text)
    except ValueError:
        raise ExerciseError(f"MINILLM_GRADE_SEED={text!r} is not an integer; unset it for a fresh seed") from None
    warn_fixed_seed(seed)
    return seed


def warn_fixed_seed(seed: int) -> None:
    print(f"warning: the held-out inputs are fixed (seed {seed}): a table of answers built for this seed passes "
          f"them. Use a fixed seed only to reproduce one grade; unset MINILLM_GRADE_SEED and drop --seed to grade.",
          file=sys.stderr)
