"""Judging: the instructor's checks, the cases drawn from the seed, and the verdict on what each child sent.

Everything here runs in the grader. A child's output is decoded and judged
inside a guard of its own exercise: whatever it sent can cost that exercise
its points, never another's, and never the results file.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from .answers import literal_answer
from .regions import ExerciseError, Exercise, STUB_MESSAGE
from .runner import ChildRun
from .wire import from_wire

EXERCISE_TESTS = "tests/exercises"


def load_checks(root: Path) -> dict:
    """Every Check in the instructor's tests/exercises/, by exercise id."""
    folder = Path(root) / EXERCISE_TESTS
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    checks: dict = {}
    for path in sorted(folder.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ExerciseError(f"{path} cannot be imported: {type(e).__name__}: {e}") from None
        base = sys.modules["exercise_checks"].Check if "exercise_checks" in sys.modules else None
        for value in vars(module).values():
            if base is not None and isinstance(value, base):
                if value.exercise in checks and checks[value.exercise] is not value:
                    raise ExerciseError(f"two checks claim exercise {value.exercise}: "
                                        f"{type(checks[value.exercise]).__name__} and {type(value).__name__}")
                checks[value.exercise] = value
    return checks


EDGE = "edge: "         # how a held-out edge's name starts (exercise_checks.Check.held_out)
NO_ANSWER = object()   # a case whose answer the grader works out here, with the check's key (`verify`)


@dataclasses.dataclass
class Case:
    name: str
    inputs: dict
    held_out: bool
    answer: object = NO_ANSWER   # a student copy's literal answer (answers.py), judged with the check's `judge`


def cases_of(check, seed: int | None, answers: dict | None = None) -> list[Case]:
    """The visible cases and the held-out ones drawn from `seed`; with a copy's literal `answers` (seed None),
    the visible cases alone, each with its answer: the held-out checks need the key, which the copy lacks."""
    if answers is None:
        return ([Case(name, inputs, False) for name, inputs in check.visible().items()]
                + [Case(name, inputs, True) for name, inputs in check.held_out(seed).items()])
    return [Case(name, inputs, False, literal_answer(answers, check, name)) for name, inputs in check.visible().items()]


@dataclasses.dataclass
class CaseResult:
    name: str
    held_out: bool
    passed: bool
    message: str = ""


@dataclasses.dataclass
class Score:
    exercise: Exercise
    results: list[CaseResult]
    ended: str = ""
    printed: str = ""
    floor: float = 0.5   # the check's: no points unless at least this share of the held-out edges pass

    def of(self, held_out: bool) -> list[CaseResult]:
        return [r for r in self.results if r.held_out == held_out]

    @property
    def score(self) -> float:
        """The exercise's points times the share of held-out checks passed, or nothing when more than `floor` of
        its edges fail: a one-line non-solution passes some drawn cases by chance, never the edges; the visible
        cases are feedback."""
        held = self.of(True)
        if not held or not self.edges_held():
            return 0.0
        return round(self.exercise.points * sum(r.passed for r in held) / len(held), 2)

    def edges_held(self) -> bool:
        """At least `floor` of the held-out edges pass (true when there are none)."""
        edges = [r for r in self.of(True) if r.name.startswith(EDGE)]
        return not edges or sum(r.passed for r in edges) >= self.floor * len(edges)


def failed_all(ex: Exercise, cases: list[Case], why: str) -> Score:
    return Score(ex, [CaseResult(c.name, c.held_out, False, why) for c in cases], why)


def judge(ex: Exercise, check, cases: list[Case], run: ChildRun) -> Score:
    """Compare what the child sent with the expected values, case by case; the child's own words count for nothing.
    Nothing the child sent can raise out of here: the worst it can do is fail its own cases."""
    try:
        return _judge(ex, check, cases, run)
    except Exception as e:
        return failed_all(ex, cases, f"the grader could not judge what this exercise's run sent back "
                                     f"({type(e).__name__}); it counts as failed")


def _judge(ex: Exercise, check, cases: list[Case], run: ChildRun) -> Score:
    answers: dict[int, list[dict]] = {}
    stray = run.stray
    for m in run.messages:
        if "case" in m and type(m["case"]) is int and 0 <= m["case"] < len(cases):
            answers.setdefault(m["case"], []).append(m)
        elif "start" not in m:
            stray += 1
    results = []
    for i, case in enumerate(cases):
        got = answers.get(i, [])
        if not got:
            message = "never came back: the run ended early (see above)" if run.ended else "never came back"
        elif len(got) > 1:
            message = (f"came back {len(got)} times: something in the submission wrote to the grader's channel, "
                       f"so this case counts as failed")
        elif "raised" in got[0]:
            message = _raised_message(ex, got[0]["raised"])
        elif got[0].get("changed"):
            message = changed_message(check, got[0]["changed"])
        else:
            message = _verify(check, case, got[0].get("output"))
        results.append(CaseResult(case.name, case.held_out, message == "", message))
    ended = run.ended + (f"; {stray} line(s) on the grader's channel were not its messages" if stray else "")
    return Score(ex, results, ended, run.printed, check.floor)


def changed_message(check, names) -> str:
    """What a student reads when the code changed inputs it was only given to read."""
    names = [str(n)[:100] for n in names] if isinstance(names, list) else [str(names)[:100]]
    return (f"{check.where.split(', ')[-1]} changed its input{'s' * (len(names) > 1)} {', '.join(names)} in place; "
            f"the caller keeps using {'them' if len(names) > 1 else 'it'} (the engine reuses what it passes), so "
            f"leave the inputs as they were and return new values. Look at {check.where}.")


def _verify(check, case: Case, wire) -> str:
    try:
        output = from_wire(wire)
    except Exception as e:   # an out-of-range tensor raises RuntimeError in torch: any failure is the child's
        return f"the child sent data the grader cannot read ({type(e).__name__}: {str(e)[:200]})"
    try:
        if case.answer is NO_ANSWER:
            check.verify(case.inputs, output)
        else:
            check.judge(case.inputs, output, case.answer)
    except AssertionError as e:
        return str(e) or "wrong"
    except Exception as e:
        return f"the output could not be checked ({type(e).__name__}: {e}); the code returned {output!r:.300}"
    return ""


def _raised_message(ex: Exercise, raised: dict) -> str:
    if not isinstance(raised, dict):
        return "failed"
    kind, text, where = str(raised.get("type"))[:100], str(raised.get("message")), str(raised.get("where") or "")[:200]
    stub = STUB_MESSAGE.match(text) if kind == "NotImplementedError" else None
    if stub and stub["id"] == ex.id:
        return "not written yet: the stub raises NotImplementedError"
    if stub:
        return f"needs exercise {stub['id']}, still a stub (this check should not reach it: tell your instructor)"
    if kind == "SystemExit":
        return (f"the code called sys.exit({str(raised.get('exit_code'))[:50]}): a function returns its result, it "
                f"does not end the program" + (f" (at {where})" if where else ""))
    return f"{kind}: {text[:3000]}" + (f" (raised at {where})" if where else "")
