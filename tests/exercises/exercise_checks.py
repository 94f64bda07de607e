"""The exercises' checks: one `Check` per exercise, written once, used by pytest and by the grader.

A Check holds an exercise's cases and the three parts of testing them:

    run(inputs)                      call the student's function on one case's inputs and return what it gave:
                                     tensors, numbers, lists, dicts. Imports minillm *inside* the method, never at
                                     module level: the grader imports this file and must never import student code.
                                     Inputs the function receives are passed as they are, not copied: any input
                                     that comes back changed fails the case (a region leaves its inputs alone).
    expect(inputs)                   the answer key of one case, as plain data, worked out by an oracle in
                                     tests/exercises/key_<concept>.py, imported inside the method. Instructor only.
    judge(inputs, output, expected)  raise AssertionError, with the message a student reads, unless `output` is
                                     right; it compares, and names a mistake whose answer `expected` also carries.

and three kinds of case:

    visible()               fixed, named cases: the tests a student reads and runs with pytest
    situations()            named generators of held-out cases; the grader draws `draws` of each at grade
                            time from a seed it chooses, so no table of answers can pass them
    edges()                 named held-out situations graded once on every seed: the edges where a plausible
                            mistake shows, fixed in their shape, with their values drawn from the seed

`verify(inputs, output)` is `judge` against `expect`: the grader's verdict. The
key_*.py files never leave the instructor, so a student copy holds no oracle:
`make` writes each visible case's answer into it as literal data
(tests/exercises/visible_answers.json), and there pytest judges against that
(`Check.pytest_test`); the held-out checks need the key, so they run at grading.
The grader (minillm/classroom/) runs `run`, cut out with what it uses, in a
fresh process that sends back only data, and `verify` in the parent, which
decides the score. Both pass the output through the same encoding, so a test
and the grader judge the same values.

Rules each check keeps (tests/test_exercise_grading.py and tests/test_exercise_catalogue.py hold them): every
case reaches the exercise's own region, so its stub fails them all and no other exercise's stub is reached; each
situation matches a visible case and is drawn the same number of times each run; the plausible wrong versions in
tests/exercises/wrong_<concept>.py score below full marks on every one of 200 seeds (the edges make sure of it);
a message names the idea, the shape and a recognised mistake, never the solution's expression; and this file and
test_ex_*.py hold no 8 tokens in a row of a solution (oracles live in key_*.py).
"""
from __future__ import annotations

import copy
import hashlib
import random
from pathlib import Path

import torch


class Draw:
    """Random inputs for held-out cases, reproducible from the grade's seed and the exercise's id."""

    def __init__(self, seed: int | str, exercise: str):
        digest = hashlib.sha256(f"{seed}:{exercise}".encode()).digest()
        self.random = random.Random(digest)
        self.generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    def int(self, lo: int, hi: int) -> int:
        """Uniform in lo..hi, both included."""
        return self.random.randint(lo, hi)

    def choice(self, options):
        return self.random.choice(list(options))

    def sample(self, options, k: int) -> list:
        return self.random.sample(list(options), k)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator)


class Check:
    """One exercise's cases, the call into the student's code, and the judgement of what came back."""

    exercise = ""    # the id in the region's marker
    where = ""       # "minillm/<file>.py, <function>": where the student's code goes
    draws = 3        # held-out cases drawn per situation
    off_limits: tuple[str, ...] = ()   # names the region may not use, besides its hint's (the grader reads them)
    calls: tuple[str, ...] = ()        # the other exercises whose functions the region may call
    floor = 0.5      # no points unless at least this share of the held-out edges pass (the grader reads it)

    def visible(self) -> dict[str, dict]:
        raise TypeError(f"{type(self).__name__} must define visible()")

    def situations(self) -> dict:
        """name -> function(draw) -> inputs, one per situation a visible case shows."""
        raise TypeError(f"{type(self).__name__} must define situations()")

    def edges(self) -> dict:
        """name -> function(draw) -> inputs: the edge situations where a plausible mistake shows (a prompt ending
        exactly on a block boundary, more keys than queries, a per-row p), one case each on every seed besides
        the situations' draws. The situation is fixed, its values are drawn (the numbers, the block ids, the
        names): a table of answers built offline for one seed then answers no case of another."""
        return {}

    def run(self, inputs: dict):
        raise TypeError(f"{type(self).__name__} must define run()")

    def expect(self, inputs: dict):
        """The answer key of one case: plain data (tensors, numbers, lists, dicts) that `judge` compares the
        output with, worked out by an oracle that lives in tests/exercises/key_<concept>.py. Instructor only:
        `make` leaves the key_ files out of every copy and writes the visible cases' answers as literal data."""
        raise TypeError(f"{type(self).__name__} must define expect()")

    def judge(self, inputs: dict, output, expected) -> None:
        """Raise AssertionError, with the message a student reads, unless `output` is right for `inputs` given
        the answer key `expected`. Works out nothing itself: it compares, and names a mistake it recognises."""
        raise TypeError(f"{type(self).__name__} must define judge()")

    def verify(self, inputs: dict, output) -> None:
        """The grader's verdict on one case: the key worked out here, then judged."""
        self.judge(inputs, output, self.expect(inputs))

    def held_out(self, seed: int | str) -> dict[str, dict]:
        draw = Draw(seed, self.exercise)
        drawn = {f"{name} #{i + 1}": make(draw) for name, make in self.situations().items()
                 for i in range(self.draws)}
        return {**{f"edge: {name}": make(draw) for name, make in self.edges().items()}, **drawn}

    def pytest_test(self):
        """A pytest test per visible case, marked with the exercise: `test_x = CHECK.pytest_test()`."""
        import pytest

        check, cases = self, self.visible()

        @pytest.mark.exercise(check.exercise)
        @pytest.mark.parametrize("case", list(cases))
        def test(case):
            from minillm.classroom.answers import literal_answer, read_answers
            from minillm.classroom.judge import changed_message
            from minillm.classroom.manifest import MANIFEST
            from minillm.classroom.regions import ExerciseError
            from minillm.classroom.wire import changed_inputs, over_the_wire, to_wire
            given = copy.deepcopy(cases[case])
            output = over_the_wire(check.run(given))
            changed = changed_inputs(to_wire(cases[case]), given)
            if changed:                                              # as the grader says it
                pytest.fail(changed_message(check, changed), pytrace=False)
            try:
                root = Path(__file__).resolve().parents[2]   # a copy (it has a manifest) judges against its answers
                answers = (read_answers(root) or {}) if (root / MANIFEST).is_file() else None
                if answers is not None:                              # a student copy: no key, the answer as data
                    check.judge(cases[case], output, literal_answer(answers, check, case))
                else:                                                # the instructor's tree: the key works it out
                    check.verify(cases[case], output)
            except (AssertionError, ExerciseError) as e:
                pytest.fail(str(e), pytrace=False)

        test.__doc__ = f"{check.exercise}: the visible cases of {type(check).__name__} (tests/exercises/exercise_checks.py)."
        return test


def kind(value) -> str:
    """A returned value's type, as a message names it (an object that is not data arrives as exercises.Opaque)."""
    if hasattr(value, "opaque_type"):
        return f"a {value.opaque_type}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


# ---------------------------------------------------------------- judging outputs

def assert_close(actual, expected: torch.Tensor, what: str, where: str,
                 axes: tuple[str, ...] | None = None, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """`actual` equals `expected` within fp32 tolerances (-inf only matches -inf).

    `axes` names the dimensions, so a wrong value is reported as e.g. (row 1, head 2, query 0, dim 5).
    """
    named = f" = ({', '.join(axes)})" if axes else ""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(expected.shape)}{named}, "
                             f"got {kind(actual)}. Look at {where}.")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}{named}, "
                             f"got shape {tuple(actual.shape)}. Look at {where}.")
    got, want = actual.detach().cpu().double(), expected.detach().cpu().double()
    close = torch.isclose(got, want, rtol=rtol, atol=atol)
    if bool(close.all()):
        return
    bad = (~close).nonzero()
    first = tuple(bad[0].tolist())
    at = ", ".join(f"{a} {i}" for a, i in zip(axes, first)) if axes else ", ".join(map(str, first))
    raise AssertionError(f"{what}: {len(bad)} of {want.numel()} values are wrong. The first is at ({at}): "
                         f"expected {want[first].item():.6g}, got {got[first].item():.6g}. Look at {where}.")


def as_int_list(value, what: str, where: str) -> list[int]:
    """A returned list (or 1-D integer tensor) of integers, as plain ints; anything else fails with its type."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        return [int(x) for x in value.tolist()]
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    raise AssertionError(f"{what}: expected a list of integers, got {kind(value)} {value!r:.200}. Look at {where}.")


def raised(step) -> bool:
    return isinstance(step, dict) and "raised" in step


def call_recording_errors(function, *args):
    """Call `function`; an exercise stub's NotImplementedError propagates, any other exception becomes data:
    {"raised": type name, "runtime_error": isinstance RuntimeError, "message": str}."""
    try:
        return function(*args)
    except NotImplementedError:
        raise
    except Exception as e:
        return {"raised": type(e).__name__, "runtime_error": isinstance(e, RuntimeError), "message": str(e)[:500]}
