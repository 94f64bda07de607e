"""Results: what a student reads of a score, and Gradescope's results.json, always written whole and ASCII-safe."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .judge import Score
from .regions import ExerciseError

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")   # Gradescope's


def feedback(score: Score, held_out: bool, limit: int = 6, private_run: bool = False) -> str:
    """One exercise's visible cases, or its held-out checks, as a student reads them. `private_run`: the
    held-out checks are hidden, and the visible cases share their run, so what the run printed and how it
    ended stay out of this text (they may come from a held-out case)."""
    results = score.of(held_out)
    passed = sum(r.passed for r in results)
    what = "held-out checks (fresh inputs)" if held_out else "visible cases (the tests in tests/exercises/)"
    lines = [f"{passed}/{len(results)} {what} pass."]
    if held_out and passed and not score.edges_held():
        lines.append(f"No points: an exercise earns its share only when at least {score.floor:.0%} of its edges "
                     f"(the held-out checks named 'edge: ...') pass; a non-solution passes some drawn cases by chance.")
    if score.ended and not private_run:
        lines.append(f"The run did not finish normally: {score.ended}.")
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append(f"The code to fix is at {score.exercise.where()}.")
    for r in failed[:limit]:
        lines.append(f"\nFAIL {r.name}\n{r.message}")
    if len(failed) > limit:
        lines.append(f"\n... and {len(failed) - limit} more")
    if failed and score.printed.strip() and not private_run:
        lines.append("\nWhat the code printed (the end):\n" + score.printed.strip()[-1500:])
    return "\n".join(lines)


def gradescope_results(scores: list[Score], seed: int, held_out_visibility: str = "visible") -> dict:
    """Gradescope's results.json: per exercise, its visible cases (no points, always shown) and its held-out
    checks (its points, shown as the instructor chooses)."""
    total = round(sum(s.score for s in scores), 2)
    max_total = sum(s.exercise.points for s in scores)
    tests = []
    for s in scores:
        name = f"{s.exercise.id} (lesson {s.exercise.lesson}): {s.exercise.title}"
        visible_ok = all(r.passed for r in s.of(False))
        tests.append({"name": f"{name}: visible cases", "score": 0.0, "max_score": 0.0,
                      "status": "passed" if visible_ok else "failed",
                      "output": feedback(s, False, private_run=held_out_visibility != "visible"),
                      "visibility": "visible"})
        tests.append({"name": f"{name}: held-out checks", "score": s.score, "max_score": float(s.exercise.points),
                      "status": "passed" if s.score == s.exercise.points else "failed", "output": feedback(s, True),
                      "visibility": held_out_visibility})
    told = (f"{total:g} / {max_total} points" if held_out_visibility == "visible"
            else f"{max_total} points (the held-out checks are shown {held_out_visibility.replace('_', ' ')})")
    return {"score": total, "output": f"{told} over {len(scores)} exercises. Held-out inputs drawn with seed {seed} "
                                      f"(MINILLM_GRADE_SEED={seed} draws them again, to reproduce this grade).",
            "extra_data": {"seed": seed}, "tests": tests}


def results_problems(results) -> list[str]:
    """What makes `results` not a valid Gradescope results.json, field by field (empty when it is)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

    if not isinstance(results, dict):
        return [f"the results are a {type(results).__name__}, not an object"]
    problems = []
    if not number(results.get("score")):
        problems.append(f"top-level score {results.get('score')!r} is not a finite number")
    if "output" in results and not isinstance(results["output"], str):
        problems.append("top-level output is not a string")
    tests = results.get("tests")
    if not isinstance(tests, list):
        return problems + ["tests is not a list"]
    for i, t in enumerate(tests):
        if not isinstance(t, dict):
            problems.append(f"tests[{i}] is not an object")
            continue
        for key, ok in (("name", isinstance(t.get("name"), str) and t.get("name")), ("score", number(t.get("score"))),
                        ("max_score", number(t.get("max_score"))), ("output", isinstance(t.get("output"), str))):
            if not ok:
                problems.append(f"tests[{i}].{key} is {t.get(key)!r}")
        if t.get("visibility", "visible") not in VISIBILITIES:
            problems.append(f"tests[{i}].visibility {t.get('visibility')!r} is not one of {', '.join(VISIBILITIES)}")
        if t.get("status", "passed") not in ("passed", "failed"):
            problems.append(f"tests[{i}].status {t.get('status')!r} is not passed or failed")
        if number(t.get("score")) and number(t.get("max_score")) and not 0 <= t["score"] <= max(t["max_score"], 0):
            problems.append(f"tests[{i}].score {t['score']} is outside 0..{t['max_score']}")
    return problems


def check_writable(path: str | Path) -> None:
    """Refuse, before any grading, a results path that cannot be written: a file is made beside it and removed.
    The results file itself is written once, at the end, when no process of the graded code is left."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=target.name + ".", suffix=".probe", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ExerciseError(f"cannot write the results to {target}: {e.strerror or e}; give --json a path in a "
                            f"folder you can write") from None


def write_results(path: str | Path, data: dict) -> None:
    """Written whole to a file beside the target, then renamed into place: a reader never sees half a file. ASCII
    only (json escapes the rest), so that no character a submission produced, a lone surrogate included, can
    stop it being written."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(json.dumps(data, indent=1, ensure_ascii=True) + "\n")
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    except OSError as e:
        raise ExerciseError(f"cannot write the results to {target}: {e.strerror or e}; give --json a path in a "
                            f"folder you can write") from None


def failed_results(reason: str) -> dict:
    return {"score": 0.0, "output": reason, "tests": []}
