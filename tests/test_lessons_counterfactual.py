"""Every check can fail: each lesson builds its checks from its figures with a pure `checks(figures)`, and its
test file feeds that function a counterfactual measurement per check (`test_each_check_can_fail`) and watches the
check come out NOT SUPPORTED. Every check a lesson's quick run writes carries its prediction and measured ÷
predicted (`lesson_checks.assert_predicted`, run on every lesson's quick run by `lessons_support.run_quick`); the
tests below also show that assertion failing on a results file that lacks either.
"""
import ast
import copy
from pathlib import Path

import pytest

from lesson_checks import assert_predicted
from lessons_support import LESSONS  # also puts lessons/ on sys.path

TESTS = Path(__file__).resolve().parent
NUMBERED = sorted(p for p in LESSONS.glob("[0-9][0-9]_*.py"))
IMPURE = {"print", "interleave", "open", "input", "judge", "print_verdict", "write_results", "save_plot", "start"}


def top_level_function(path: Path, name: str) -> ast.FunctionDef | None:
    tree = ast.parse(path.read_text())
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def calls_in(fn: ast.FunctionDef) -> set[str]:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_the_course_has_lessons_to_check():
    assert len(NUMBERED) >= 13 and all(p.stem[:2].isdigit() for p in NUMBERED)


@pytest.mark.parametrize("path", NUMBERED, ids=lambda p: p.stem)
def test_each_lesson_builds_its_checks_from_its_figures_in_a_pure_function(path):
    fn = top_level_function(path, "checks")
    assert fn is not None, f"lessons/{path.name} has no top-level `def checks(figures)` building its checks"
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    assert params == ["figures"], f"lessons/{path.name}: checks takes {params}, not (figures) alone"
    impure = calls_in(fn) & IMPURE
    assert not impure, f"lessons/{path.name}: checks(figures) calls {sorted(impure)}: it must only build checks"


@pytest.mark.parametrize("path", NUMBERED, ids=lambda p: p.stem)
def test_each_lesson_tests_that_each_check_can_fail(path):
    test_file = TESTS / f"test_lesson_{path.stem}.py"
    assert test_file.exists(), f"lessons/{path.name} has no test file {test_file.name}"
    fn = top_level_function(test_file, "test_each_check_can_fail")
    assert fn is not None, f"{test_file.name} has no test_each_check_can_fail (a counterfactual figures dict per check)"
    text = test_file.read_text()
    assert ".checks(" in text and ("NOT_SUPPORTED" in text or "NOT SUPPORTED" in text), \
        f"{test_file.name}: test_each_check_can_fail must call the lesson's checks() and expect NOT SUPPORTED"


# ---- the assertion every quick run makes, shown failing -------------------------------------------------------

GOOD = {"lesson": "99_example", "lesson_predictions": {"speedup": 4.0, "differ": 0.0}, "student_predictions": {},
        "verdict": {"checks": [
            {"name": "speedup", "key": "speedup", "median": 2.0, "interval": [1.8, 2.2], "predicted": 4.0,
             "measured_over_predicted": [0.5, 0.45, 0.55]},
            {"name": "tokens differing", "key": "differ", "median": 0.0, "interval": [0.0, 0.0], "predicted": 0.0,
             "measured_over_predicted": None}],
            "facts": [{"name": "bytes", "value": 10.0, "predicted": 10.0, "measured_over_predicted": 1.0, "why": ""}]}}


def broken(change) -> dict:
    doc = copy.deepcopy(GOOD)
    change(doc)
    return doc


def test_a_results_file_with_every_prediction_passes():
    assert_predicted(GOOD)
    assert_predicted(broken(lambda d: d.update(student_predictions={"speedup": 3.0})))


@pytest.mark.parametrize("change,message", [
    (lambda d: d["verdict"]["checks"][0].update(predicted=None), "no prediction"),
    (lambda d: d["verdict"]["checks"][0].update(measured_over_predicted=None), "is not"),
    (lambda d: d["verdict"]["checks"][0].update(measured_over_predicted=[0.5, 0.4, 0.6]), "is not"),
    (lambda d: d["verdict"]["checks"][1].update(measured_over_predicted=[1.0, 1.0, 1.0]), "no ratio"),
    (lambda d: d["verdict"]["checks"][1].update(key="speedup"), "keys repeat"),
    (lambda d: d.update(student_predictions={"nothing": 1.0}), "names no check"),
], ids=["no-prediction", "no-ratio", "wrong-ratio", "ratio-over-0", "repeated-key", "unknown-student-key"])
def test_a_results_file_missing_a_prediction_or_its_ratio_fails(change, message):
    with pytest.raises(AssertionError, match=message):
        assert_predicted(broken(change))
