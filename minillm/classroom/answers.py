"""The visible cases' answers as literal data: what a student copy holds instead of the answer key.

A Check works an answer out with `expect`, whose oracle lives in tests/exercises/key_<concept>.py, and that file
stays with the instructor. So `make` runs `expect` on every visible case of every exercise (stubbed or not: no
copy holds a key) and writes the answers, wire-encoded (wire.py), into tests/exercises/visible_answers.json:

    {"format": 1, "exercises": {"<exercise id>": {"<case name>": <answer>, ...}, ...}}

In a copy, pytest and `check` judge the visible cases against these answers, and only these: the held-out checks
need the key, so they run at grading, in the instructor's copy. Editing the file changes no grade: the grader
works every answer out again from its own keys.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from .regions import ExerciseError
from .wire import changed_inputs, from_wire, over_the_wire, to_wire

ANSWERS = "tests/exercises/visible_answers.json"
ANSWERS_FORMAT = 1


def _defined_below_base(check, name: str) -> bool:
    """Whether the check's own class (not exercise_checks.Check) defines method `name`."""
    for cls in type(check).__mro__:
        if name in vars(cls):
            return not (cls.__name__ == "Check" and cls.__module__ == "exercise_checks")
    return False


def has_answer_key(check) -> bool:
    """Whether a check is judged by `expect` and `judge`, as every check must be, so that its visible answers can
    be written down as data. (One with a `verify` of its own would work its answers out inside it: its oracle would
    have to travel with the copy.)"""
    return _defined_below_base(check, "expect") and not _defined_below_base(check, "verify")


def answers_of(checks: dict) -> dict:
    """The answers file's content for `checks` (by exercise id): each visible case's `expect`, wire-encoded.

    Before writing one down, the reference must pass its own case: `run` on this tree's code, judged against the
    answer as the copy will read it. A check that the reference fails is refused, naming exercise and case."""
    exercises: dict[str, dict] = {}
    for ex_id, check in sorted(checks.items()):
        if not has_answer_key(check):
            raise ExerciseError(f"exercise {ex_id}: {type(check).__name__} needs `expect` (its answer key, from "
                                f"tests/exercises/key_<concept>.py) and `judge`, and no `verify` of its own, so that "
                                f"a copy can hold its visible answers as data (see exercise_checks.py)")
        exercises[ex_id] = {}
        for case, inputs in check.visible().items():
            try:
                wired = to_wire(check.expect(copy.deepcopy(inputs)))
                if _holds_an_object(wired):
                    raise TypeError("it returned an object that is not data")
                answer = from_wire(json.loads(json.dumps(wired)))
                given = copy.deepcopy(inputs)
                output = over_the_wire(check.run(given))
                if changed_inputs(to_wire(inputs), given):
                    raise AssertionError(f"it changed its inputs {', '.join(changed_inputs(to_wire(inputs), given))}")
                check.judge(inputs, output, answer)
            except AssertionError as e:
                raise ExerciseError(f"exercise {ex_id}, visible case {case!r}: the reference fails its own check, so "
                                    f"its answer is not written into a copy ({e}); fix the reference or the check")
            except Exception as e:
                raise ExerciseError(f"exercise {ex_id}, visible case {case!r}: working out its answer failed "
                                    f"({type(e).__name__}: {e}); `expect` must return plain data (see "
                                    f"tests/exercises/exercise_checks.py)") from None
            exercises[ex_id][case] = wired
    return {"format": ANSWERS_FORMAT, "exercises": exercises}


def prose_of(answers: dict) -> str:
    """The words of an answers file, one string a line (the names of mistakes, a message): what the leak check
    reads of it, as its numbers are no code."""
    found: list[str] = []

    def walk(x):
        if isinstance(x, str):
            found.append(x)
        elif isinstance(x, list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k, v in x.items():
                if k != "tensor":   # a tensor's dtype, shape and values
                    walk(v)

    walk(answers["exercises"])
    return "\n".join(found)


def _holds_an_object(wired) -> bool:
    """Whether to_wire met a value that is not data (it crosses as its type and repr only)."""
    if isinstance(wired, list):
        return any(_holds_an_object(x) for x in wired)
    if isinstance(wired, dict):
        return "object" in wired or any(_holds_an_object(x) for x in wired.values())
    return False


def read_answers(root: Path) -> dict[str, dict] | None:
    """The visible answers of a copy, by exercise id then case name, decoded; None where there is no answers file
    (the instructor's tree, which works the answers out)."""
    path = Path(root) / ANSWERS
    if not path.is_file():
        return None
    stamp = (str(path.resolve()), path.stat().st_mtime_ns, path.stat().st_size)
    if stamp not in _READ:   # read once per process: pytest asks for every exercise's
        _READ.clear()
        _READ[stamp] = _decoded(path)
    return _READ[stamp]


_READ: dict[tuple, dict] = {}


def _decoded(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != ANSWERS_FORMAT or not isinstance(data.get("exercises"), dict):
            raise ValueError(f"not format {ANSWERS_FORMAT}")
        return {ex_id: {case: from_wire(answer) for case, answer in cases.items()}
                for ex_id, cases in data["exercises"].items()}
    except (ValueError, AttributeError, TypeError) as e:
        raise ExerciseError(f"{path} cannot be read ({e}); it is written by `python -m minillm.classroom make`: "
                            f"make the copy again") from None


def literal_answer(answers: dict[str, dict], check, case: str):
    """The literal answer of one visible case in a copy; ExerciseError when the copy should hold it and does not."""
    if case not in answers.get(check.exercise, {}):
        raise ExerciseError(f"this copy's {ANSWERS} holds no answer for the visible case {case!r} of exercise "
                            f"{check.exercise}; ask for a fresh copy (it is written by `make`)")
    return answers[check.exercise][case]
