"""Shared pytest setup: selecting exercises, and a student copy whose suite reports in a few lines.

Classroom exercises (minillm/classroom/) add one option to pytest:

    pytest --exercise ID[,ID...]     run only the tests marked @pytest.mark.exercise("ID")

and three rules for a student copy:
  * the tests of an exercise whose region is still its stub are not run: the
    summary lists each such exercise in one line, where to write it and how to
    check it, and the run exits 1 while any is left (`--exercise ID` runs them
    anyway, to see them fail);
  * a test that fails because it reached the stub of an exercise that is not
    its own (NotImplementedError("exercise <id> (lesson ...")) is SKIPPED
    "needs exercise <id>, still a stub", and runs for real once it is written;
  * an exercise test that runs past EXERCISE_TEST_TIMEOUT_S (an endless loop)
    is stopped with an alarm that says so, where the OS has SIGALRM (minillm/alarm.py).
Grading does not go through pytest: `python -m minillm.classroom grade` runs the same checks in
processes of its own (see minillm/classroom/).
"""
from __future__ import annotations

import pytest

from minillm.bench.alarm import time_limit

@pytest.fixture(autouse=True, scope="session")
def one_cpu_on_every_machine():
    """The loader's CPU-dependent choices (`cpu_layout.choose_layout`: numpy's BLAS for one row on an AMD
    CPU, bf16 packing and bf16 decode attention by hand where the CPU has native bf16) are pinned, for the whole
    session, to what every x86 CPU takes: torch's BLAS for one row, packed copies in fp32 only, torch's fused
    attention. Session-wide, so that a model a module- or session-scoped fixture lays out (set up before any
    function-scoped fixture) takes the same path as one a test builds. The other paths are asked for by name
    (`choose_layout(numpy_one_row=..., packed=...)`) and tested the same way everywhere, and the choices
    themselves are tested as pure functions of the flags."""
    from minillm import cpu_layout
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_layout, "cpu_vendor", lambda: "")      # no vendor: numpy's BLAS never pays
        mp.setattr(cpu_layout, "cpuinfo", lambda field: "")    # no flags: no native bf16
        yield


@pytest.fixture(autouse=True)
def one_attention_kernel_per_test(monkeypatch):
    """Every test starts on torch's fused attention, as model.py has it, and whatever it swaps in is put back
    after it (`cpu_layout.use_decode_attention_by_hand` swaps process-wide)."""
    import torch.nn.functional as F

    from minillm import model
    monkeypatch.setattr(model, "scaled_dot_product_attention", F.scaled_dot_product_attention)


EXERCISE_TEST_TIMEOUT_S = 30   # an exercise test takes well under a second; more means a loop that never ends
_STUBS = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("exercises", "classroom exercises (minillm/classroom/)")
    group.addoption("--exercise", action="append", default=[], metavar="ID",
                    help="run only the tests of these exercises (comma-separated, repeatable)")


def exercises_of(item) -> list[str]:
    return [m.args[0] for m in item.iter_markers("exercise")]


def pytest_collection_modifyitems(session, config, items):
    wanted = {w.strip() for opt in config.getoption("exercise") for w in opt.split(",") if w.strip()}
    if wanted:
        known = {e for item in items for e in exercises_of(item)}
        if wanted - known and not session.testsfailed:   # with collection errors the marker may just not be seen
            raise pytest.UsageError(f"--exercise {', '.join(sorted(wanted - known))}: no test is marked with it; "
                                    f"exercises with tests here: {', '.join(sorted(known)) or 'none'}")
        keep = [item for item in items if wanted & set(exercises_of(item))]
    else:
        stubs = still_stubs(config)
        keep = [item for item in items if not {e.id for e in stubs} & set(exercises_of(item))]
        config.stash[_STUBS] = [e for e in stubs if any(e.id in exercises_of(item) for item in items)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def still_stubs(config) -> list:
    """The exercises whose region in this tree is still its stub (none in the reference)."""
    from minillm.classroom.regions import ExerciseError, find_exercises
    try:
        return [ex for ex in find_exercises(config.rootpath) if ex.is_stub]
    except ExerciseError as e:
        raise pytest.UsageError(f"the exercise regions cannot be read: {e}") from None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stubs = config.stash.get(_STUBS, [])
    if not stubs:
        return
    tr = terminalreporter
    tr.section(f"{len(stubs)} exercise{'s' if len(stubs) > 1 else ''} still to write (their tests did not run)", sep="=")
    for ex in stubs:
        tr.line(f"{ex.id} ({ex.worth}): {ex.where()}")
    tr.line("once one is written: python -m minillm.classroom check <id>")


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash.get(_STUBS, []) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED   # work is left: the run is not a pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Stop an exercise test that runs away (a student's endless loop) with a message, where signals allow."""
    if not exercises_of(item):
        yield
        return
    with time_limit(EXERCISE_TEST_TIMEOUT_S, f"this test ran for over {EXERCISE_TEST_TIMEOUT_S} s, when it needs "
                    "well under one: is there a loop in your code that never ends?"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.excinfo is not None:
        from minillm.classroom.regions import stub_of   # the one stub detector, shared with the lessons
        needed = stub_of(call.excinfo.value)
        if needed and needed not in exercises_of(item):
            rep.outcome = "skipped"
            rep.longrepr = (item.location[0], item.location[1] + 1, f"needs exercise {needed}, still a stub")


@pytest.fixture(scope="session")
def context_model():
    """The tiny GPT-2 with a seeded init whose next token depends on the context (tests/models.py)."""
    from models import context_model as build
    return build()


@pytest.fixture
def one_thread():
    """The test runs inside lessons/common.py's `one_thread()`: tiny models on one torch thread."""
    import lessons_support  # noqa: F401  (puts lessons/ on sys.path)
    from common import one_thread as on_one_thread
    with on_one_thread():
        yield
