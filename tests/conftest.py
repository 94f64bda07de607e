"""Shared pytest setup: selecting exercises, and a student copy whose suite stays green.

Classroom exercises (minillm/exercises.py) add two options to pytest:

    pytest --exercise ID[,ID...]     run only the tests marked @pytest.mark.exercise("ID")
    pytest --exercise-report PATH    write JSON lines: each selected test, each outcome (nodeid, exercises,
                                     outcome, message), each collection error; `exercises check/grade` read it

and two rules. A test that fails because it reached the stub of an exercise
that is not one of its own (NotImplementedError("exercise <id> (lesson ...")) is
reported as SKIPPED "needs exercise <id>, still a stub": in a student copy the
stubbed exercises' own tests fail and everything else passes or waits for them,
and once a piece is written the end-to-end tests that need it run for real.
An exercise test that runs past EXERCISE_TEST_TIMEOUT_S (a student's endless
loop) is stopped with a TimeoutError that says so, where the OS has SIGALRM.
"""
from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import pytest

STUB_MESSAGE = re.compile(r"exercise (?P<id>[a-z0-9][a-z0-9-]*) \(lesson ")
EXERCISE_TEST_TIMEOUT_S = 30   # an exercise test takes well under a second; more means a loop that never ends
_STATE = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("exercises", "classroom exercises (minillm/exercises.py)")
    group.addoption("--exercise", action="append", default=[], metavar="ID",
                    help="run only the tests of these exercises (comma-separated, repeatable)")
    group.addoption("--exercise-report", metavar="PATH",
                    help="append one JSON line per test outcome and collection error to PATH")


def pytest_configure(config):
    if config.getoption("exercise_report"):
        config.pluginmanager.register(ExerciseReport(config.getoption("exercise_report")), "exercise-report")


def exercises_of(item) -> list[str]:
    return [m.args[0] for m in item.iter_markers("exercise")]


def pytest_collection_modifyitems(session, config, items):
    wanted = {w.strip() for opt in config.getoption("exercise") for w in opt.split(",") if w.strip()}
    if not wanted:
        return
    known = {e for item in items for e in exercises_of(item)}
    if wanted - known and not session.testsfailed:   # with collection errors the marker may just not be seen
        raise pytest.UsageError(f"--exercise {', '.join(sorted(wanted - known))}: no test is marked with it; "
                                f"exercises with tests here: {', '.join(sorted(known)) or 'none'}")
    keep = [item for item in items if wanted & set(exercises_of(item))]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def stub_reached(exc: BaseException | None) -> str | None:
    """The exercise id if `exc` (or what caused it) is an exercise stub's NotImplementedError."""
    for _ in range(10):  # follow the cause chain, not forever
        if exc is None:
            return None
        if isinstance(exc, NotImplementedError) and exc.args and isinstance(exc.args[0], str):
            m = STUB_MESSAGE.match(exc.args[0])
            if m:
                return m["id"]
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Stop an exercise test that runs away (a student's endless loop) with a message, where signals allow."""
    if not exercises_of(item) or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise TimeoutError(f"this test ran for over {EXERCISE_TEST_TIMEOUT_S} s, when it needs well under one: "
                           "is there a loop in your code that never ends?")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, EXERCISE_TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.excinfo is not None:
        needed = stub_reached(call.excinfo.value)
        if needed and needed not in exercises_of(item):
            rep.outcome = "skipped"
            rep.longrepr = (item.location[0], item.location[1] + 1, f"needs exercise {needed}, still a stub")
    report = item.config.pluginmanager.get_plugin("exercise-report")
    if report is not None:
        _record(report, item, call, rep)


def _record(report: "ExerciseReport", item, call, rep) -> None:
    state = item.stash.setdefault(_STATE, {"outcome": "passed", "message": ""})
    if rep.failed and state["outcome"] != "failed":
        state.update(outcome="failed", message=_failure_message(item, call))
    elif rep.skipped and state["outcome"] == "passed":
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        state.update(outcome="skipped", message=reason.removeprefix("Skipped: "))
    if rep.when == "teardown":
        report.append(kind="result", nodeid=item.nodeid, exercises=exercises_of(item), **state)


def _failure_message(item, call) -> str:
    """What went wrong, in at most 30 lines; for an exception other than a failed assert, also where it was raised."""
    if call.excinfo is None:
        return "failed"
    text = call.excinfo.exconly()
    if isinstance(call.excinfo.value, AssertionError):   # a test's own message says it; drop pytest's `assert ...` diff
        lines = text.splitlines()
        cut = next((i for i, line in enumerate(lines) if i and line.startswith("assert ")), len(lines))
        text = "\n".join(lines[:cut])
    else:
        root = item.config.rootpath
        for entry in reversed(call.excinfo.traceback):   # the innermost line of the project's code, tests aside
            path = Path(entry.path)
            rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
            if rel and not rel.startswith(("tests/", ".venv")):
                text += f"\n(raised at {rel}:{entry.lineno + 1})"
                break
    lines = text.splitlines()
    return "\n".join(lines[:30] + (["..."] if len(lines) > 30 else []))


class ExerciseReport:
    """--exercise-report: JSON lines, written as they happen so that a run stopped by a timeout still tells
    which tests finished: kind "collected" per selected test, "result" per finished test, "error" per
    module that could not be collected."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.path.write_text("", encoding="utf-8")

    def append(self, **row) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def pytest_collectreport(self, report):
        if report.failed:
            self.append(kind="error", nodeid=report.nodeid, message=report.longreprtext)

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.append(kind="collected", nodeid=item.nodeid, exercises=exercises_of(item))


@pytest.fixture(scope="session")
def context_model():
    """The tiny GPT-2 with a seeded init whose next token depends on the context (tests/models.py)."""
    from models import context_model as build
    return build()
