"""The classroom tool (minillm/exercises.py) and the guarantees a student copy rests on.

Cheap checks first: the marker parser on synthetic files, `make` on a synthetic
project, the CLI's errors. Then the guarantees on the real project, with three
pytest subprocesses in the default run:

  1. a copy with every exercise stubbed: each exercise's tests fail on *its own*
     stub (a test that needed another exercise would show as skipped instead),
     every module still imports, and a test that reaches a stub it does not own
     is skipped by tests/conftest.py;
  2. that copy with every other region put back: `grade` scores exactly the
     points of the restored exercises, so each restored region's tests pass
     while the rest are stubs;
  3. `grade` on the reference: full marks.

Slow (-m slow): each region put back alone, and the whole suite run in a stubbed copy.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import exercises as tool
from minillm.exercises import ExerciseError, find_exercises, make_copy, parse_regions, replace_region

ROOT = Path(tool.__file__).resolve().parents[1]
IN_STUDENT_COPY = (ROOT / tool.MANIFEST).exists()
reference_only = pytest.mark.skipif(IN_STUDENT_COPY, reason="a student copy: the tool's guarantees are checked "
                                                            "in the reference project")
# How a region's code could leak into a copy: a line of at least LONG_LINE characters anywhere in any file
# (a hint, a test, the manifest), a line of at least SHORT_LINE characters as a whole line; shorter lines
# (`else:`, `return out`) are too generic to give a solution away.
SHORT_LINE, LONG_LINE = 12, 24

REGION = '''\
class Pool:
    def take(self, n):
        """Take n blocks."""
        # >>> exercise pool-take (lesson 05, 2 pts): take n blocks off the free list
        # hint: pop from the end
        taken = self.free[-n:]
        del self.free[-n:]
        return taken
        # <<< exercise
'''


def parse(text: str) -> list[tool.Exercise]:
    return parse_regions(text, "minillm/pool.py")


# ------------------------------------------------------------------ the parser

def test_parse_reads_every_field():
    (ex,) = parse(REGION)
    assert (ex.id, ex.title, ex.lesson, ex.points, ex.hint) == (
        "pool-take", "take n blocks off the free list", "05", 2, "pop from the end")
    assert (ex.file, ex.line, ex.function, ex.indent) == ("minillm/pool.py", 4, "Pool.take", " " * 8)
    assert ex.body == ("        taken = self.free[-n:]", "        del self.free[-n:]", "        return taken")
    assert ex.where() == "minillm/pool.py:4, in Pool.take"


def test_parse_accepts_one_pt_module_level_regions_and_deeper_code():
    text = ("# >>> exercise answer (lesson 01, 1 pt): the answer\n# hint: six times seven\n"
            "if True:\n    ANSWER = 42\n# <<< exercise\n")
    (ex,) = parse(text)
    assert (ex.points, ex.function, ex.body[-1]) == (1, "<module>", "    ANSWER = 42")


def test_parse_finds_several_regions_in_order():
    second = REGION.replace("pool-take", "pool-give").replace("def take", "def give")
    assert [ex.id for ex in parse(REGION + second)] == ["pool-take", "pool-give"]
    assert parse(REGION + second)[1].line == 13


@pytest.mark.parametrize("broken, message", [
    (REGION.replace("        # <<< exercise\n", ""), r"minillm/pool.py:4: exercise pool-take has no end marker"),
    (REGION.replace("(lesson 05, 2 pts)", "(lesson 5, 2 pts)"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("pool-take", "Pool_Take"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("2 pts): take", "2 pts) take"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("# hint: pop", "# pop"), r"minillm/pool.py:5: exercise pool-take needs a '# hint: \.\.\.' line"),
    (REGION.replace("        del self", "        # >>> exercise inner (lesson 05, 1 pts): x\n        del self"),
     r"minillm/pool.py:7: a region starts inside exercise pool-take \(opened at minillm/pool.py:4\)"),
    (REGION.replace("        # <<< exercise", "    # <<< exercise"), r"minillm/pool.py:9: the end marker .* indentation"),
    ("x = 1\n# <<< exercise\n", r"minillm/pool.py:2: '# <<< exercise' with no region open"),
    ("# >>> exercise e (lesson 01, 1 pts): t\n# hint: h\n\n# <<< exercise\n", r"minillm/pool.py:1: .*no code"),
    ("def f():\n    # >>> exercise e (lesson 01, 1 pts): t\n    # hint: h\n    x = 1\ny = 2\n    # <<< exercise\n",
     r"minillm/pool.py:5: code in exercise e is indented less than its marker"),
])
def test_parse_rejects_malformed_regions_naming_file_and_line(broken, message):
    with pytest.raises(ExerciseError, match=message):
        parse(broken)


def test_duplicate_ids_across_files_are_rejected(tmp_path):
    (tmp_path / "minillm").mkdir()
    (tmp_path / "minillm" / "a.py").write_text(REGION)
    (tmp_path / "minillm" / "b.py").write_text(REGION)
    with pytest.raises(ExerciseError, match=r"minillm/b.py:4: exercise id 'pool-take' is already used at minillm/a.py:4"):
        find_exercises(tmp_path)


def test_stub_keeps_markers_imports_and_raises_naming_the_exercise():
    (ex,) = parse(REGION)
    text = replace_region(REGION, ex.file, ex.id, ex.stub())
    assert "# >>> exercise pool-take" in text and "# hint: pop from the end" in text and "# <<< exercise" in text
    assert "self.free[-n:]" not in text
    namespace: dict = {}
    exec(compile(text, "pool.py", "exec"), namespace)
    with pytest.raises(NotImplementedError) as err:
        namespace["Pool"]().take(2)
    assert str(err.value) == ("exercise pool-take (lesson 05): take n blocks off the free list. Hint: pop from the end")
    (stubbed,) = parse(text)
    assert stubbed.is_stub and not ex.is_stub


def test_putting_the_code_back_restores_the_file_exactly():
    (ex,) = parse(REGION)
    stubbed = replace_region(REGION, ex.file, ex.id, ex.stub())
    assert replace_region(stubbed, ex.file, ex.id, list(ex.body)) == REGION


def test_select_names_the_known_ids_for_an_unknown_one():
    exs = parse(REGION + REGION.replace("pool-take", "pool-give"))
    assert [e.id for e in tool.select(exs, " pool-give ,")] == ["pool-give"]
    with pytest.raises(ExerciseError, match=r"unknown exercise id nope; the exercises are: pool-take, pool-give"):
        tool.select(exs, "pool-take,nope")


# ------------------------------------------------------------------ make, on a synthetic project

@pytest.fixture
def tiny_project(tmp_path):
    root = tmp_path / "ref"
    for rel, text in {"minillm/__init__.py": "", "minillm/pool.py": REGION, "tests/test_pool.py": "x = 1\n",
                      "lessons/01_x.py": "print(1)\n", "lessons/results/run.json": "{}", "README.md": "# hi\n",
                      "weights/gpt2/model.safetensors": "w", ".git/HEAD": "ref", "minillm/__pycache__/pool.pyc": "c",
                      ".venv/bin/python": "p", "pyproject.toml": "[project]\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_make_copies_the_project_without_solutions_or_heavy_files(tiny_project, tmp_path):
    chosen = make_copy(tmp_path / "student", root=tiny_project)
    assert [ex.id for ex in chosen] == ["pool-take"]
    assert files_under(tmp_path / "student") == {"minillm/__init__.py", "minillm/pool.py", "tests/test_pool.py",
                                                 "lessons/01_x.py", "README.md", "pyproject.toml", tool.MANIFEST}
    assert "self.free[-n:]" not in (tmp_path / "student/minillm/pool.py").read_text()
    manifest = json.loads((tmp_path / "student" / tool.MANIFEST).read_text())["exercises"]
    assert [(e["id"], e["points"], e["stubbed"]) for e in manifest] == [("pool-take", 2, True)]


def test_make_refuses_a_non_empty_target_unless_forced(tiny_project, tmp_path):
    target = tmp_path / "student"
    (target / "minillm").mkdir(parents=True)
    (target / "minillm" / "stale.py").write_text("old = True\n")
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExerciseError, match="exists and is not empty.*--force"):
        make_copy(target, root=tiny_project)
    assert (target / "minillm" / "stale.py").exists()        # nothing touched
    make_copy(target, root=tiny_project, force=True)
    assert not (target / "minillm" / "stale.py").exists()    # the project's folders are replaced...
    assert (target / "notes.txt").read_text() == "mine"      # ...and nothing else in the target


def test_make_refuses_to_write_over_the_project_itself(tiny_project):
    with pytest.raises(ExerciseError, match="holds the project itself"):
        make_copy(tiny_project, root=tiny_project, force=True)
    with pytest.raises(ExerciseError, match="holds the project itself"):
        make_copy(tiny_project.parent, root=tiny_project, force=True)


def test_make_stops_before_writing_on_an_unterminated_marker(tiny_project, tmp_path):
    (tiny_project / "minillm" / "pool.py").write_text(REGION.replace("        # <<< exercise\n", ""))
    with pytest.raises(ExerciseError, match=r"minillm/pool.py:4: exercise pool-take has no end marker"):
        make_copy(tmp_path / "student", root=tiny_project)
    assert not (tmp_path / "student").exists()


# ------------------------------------------------------------------ scoring

def test_scores_are_proportional_and_unfinished_tests_count_as_failed():
    exs = parse(REGION + REGION.replace("pool-take", "pool-give").replace("2 pts", "3 pts"))
    collected = [{"nodeid": f"t.py::test_{i}", "exercises": ["pool-take"]} for i in range(3)]
    results = [{**collected[0], "outcome": "passed", "message": ""},
               {**collected[1], "outcome": "failed", "message": "AssertionError: expected 1, got 2"}]
    run = tool.ExerciseRun(collected, results, [], "", timed_out=True)
    take, give = tool.score_exercises(exs, run, timeout=5)
    assert (take.passed, take.total, take.score) == (1, 3, 0.67)
    assert "expected 1, got 2" in take.output and "did not finish" in take.output and "minillm/pool.py" in take.output
    assert (give.total, give.score) == (0, 0.0) and "its tests are missing" in give.output
    results = tool.gradescope_results([take, give])
    assert results["score"] == 0.67 and [t["max_score"] for t in results["tests"]] == [2, 3]


# ------------------------------------------------------------------ the CLI's errors

def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert tool.main(["make", str(tmp_path / "s"), "--only", "no-such-exercise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown exercise id no-such-exercise; the exercises are: ") and "\n" == err[-1]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert tool.main(["make", str(tmp_path / "full")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert tool.main(["check", "no-such-exercise"]) == 2
    assert "unknown exercise id no-such-exercise" in capsys.readouterr().err


# ------------------------------------------------------------------ the real project

def marked_ids(path: Path) -> set[str]:
    return set(re.findall(r"""mark\.exercise\(\s*["']([a-z0-9-]+)["']""", path.read_text(encoding="utf-8")))


@reference_only
def test_every_exercise_has_tests_and_they_live_in_tests_exercises():
    ids = {ex.id for ex in find_exercises(ROOT)}
    in_folder = set().union(*(marked_ids(p) for p in (ROOT / tool.EXERCISE_TESTS).glob("test_*.py")))
    assert not ids - in_folder, (f"exercises without tests (add tests/exercises/test_ex_<concept>.py with "
                                 f"@pytest.mark.exercise(...)): {sorted(ids - in_folder)}")
    assert not in_folder - ids, f"tests marked with ids no region has: {sorted(in_folder - ids)}"
    outside = {p.name: marked_ids(p) for p in (ROOT / "tests").glob("test_*.py") if marked_ids(p)}
    assert not outside, f"exercise tests outside {tool.EXERCISE_TESTS}/ are never graded: {outside}"


PROBE = '''\
import importlib, pkgutil
import pytest
import minillm
from minillm.model import causal_attention

def test_probe_every_module_imports():
    for m in pkgutil.iter_modules(minillm.__path__):
        if not m.name.startswith("__"):
            importlib.import_module("minillm." + m.name)

def test_probe_reaches_a_stub_it_does_not_own():
    causal_attention(None, None, None)

def test_probe_other_not_implemented_errors_still_fail():
    raise NotImplementedError("not an exercise")
'''


def run_in(copy: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "minillm.exercises", *args], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=600)


def restore(copy: Path, ex: tool.Exercise) -> None:
    path = copy / ex.file
    path.write_text(replace_region(path.read_text(encoding="utf-8"), ex.file, ex.id, list(ex.body)), encoding="utf-8")


@pytest.fixture(scope="module")
def reference():
    return find_exercises(ROOT)


@pytest.fixture(scope="module")
def stubbed_copy(tmp_path_factory, reference):
    copy = tmp_path_factory.mktemp("student") / "all_stubbed"
    assert [ex.id for ex in make_copy(copy)] == [ex.id for ex in reference]
    return copy


def given_code_lines(root: Path, exercises: list[tool.Exercise]) -> set[str]:
    """Lines of the package that lie outside every region: handed to students anyway."""
    given: set[str] = set()
    for path in (root / tool.PACKAGE).glob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        in_regions = {ex.line + 1 + i for ex in exercises if ex.file == path.relative_to(root).as_posix()
                      for i in range(len(ex.body))}   # 0-based indices of region bodies
        given |= {line.strip() for i, line in enumerate(lines) if i not in in_regions}
    return given


@reference_only
def test_no_stub_contains_its_solution(stubbed_copy, reference):
    texts = {p.relative_to(stubbed_copy).as_posix(): p.read_text(encoding="utf-8", errors="replace")
             for p in stubbed_copy.rglob("*") if p.is_file()}
    assert not [p for p in texts if p.endswith((".pyc", ".pyo"))]
    given = given_code_lines(ROOT, reference)   # a loop header used both in and out of a region is no leak
    whole_lines = {f: {line.strip() for line in text.splitlines()} for f, text in texts.items()}
    for ex in reference:
        for line in {b.strip() for b in ex.body if len(b.strip()) >= SHORT_LINE}:
            found = [f for f, text in texts.items()
                     if (line in text if len(line) >= LONG_LINE else line in whole_lines[f])]
            leaks = [f for f in found if not (f.startswith(tool.PACKAGE + "/") and line in given)]
            assert not leaks, f"exercise {ex.id}'s code line {line!r} is still in the student copy: {leaks}"
    assert all(ex.is_stub for ex in find_exercises(stubbed_copy))


@reference_only
def test_in_a_stubbed_copy_each_exercise_fails_on_its_own_stub(stubbed_copy, reference):
    (stubbed_copy / tool.EXERCISE_TESTS / "test_probe.py").write_text(PROBE)
    try:
        run = tool.run_exercise_tests(None, stubbed_copy)
    finally:
        (stubbed_copy / tool.EXERCISE_TESTS / "test_probe.py").unlink()
    assert not run.errors and not run.timed_out, run.output[-3000:]
    by_name = {r["nodeid"].split("::")[-1]: r for r in run.results}
    assert by_name["test_probe_every_module_imports"]["outcome"] == "passed", by_name["test_probe_every_module_imports"]
    assert by_name["test_probe_reaches_a_stub_it_does_not_own"]["outcome"] == "skipped"
    assert by_name["test_probe_reaches_a_stub_it_does_not_own"]["message"] == \
        "needs exercise model-causal-attention, still a stub"
    assert by_name["test_probe_other_not_implemented_errors_still_fail"]["outcome"] == "failed"
    for ex in reference:
        mine = run.outcomes(ex.id)
        assert mine, f"no test of exercise {ex.id} ran in the student copy"
        for r in mine:
            assert r["outcome"] == "failed" and r["message"].startswith(f"NotImplementedError: exercise {ex.id} ("), (
                f"{r['nodeid']} should fail on exercise {ex.id}'s own stub in a copy where everything is stubbed; "
                f"it came out {r['outcome']}: {r['message']!r}. A test that reaches another exercise's stub "
                f"cannot pass until that one is written: test the function that holds the region directly.")


@reference_only
def test_putting_regions_back_scores_exactly_their_points(tmp_path, reference):
    copy = tmp_path / "half"
    make_copy(copy)
    restored = reference[::2]
    for ex in restored:
        restore(copy, ex)
    proc = run_in(copy, "grade", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    scores = {t["name"].split(" ")[0]: t for t in results["tests"]}
    for ex in reference:
        want = ex.points if ex in restored else 0
        assert scores[ex.id]["score"] == want and scores[ex.id]["max_score"] == ex.points, (
            f"{ex.id} ({'put back' if want else 'stubbed'}) scored {scores[ex.id]['score']} of {ex.points}, "
            f"expected {want}:\n{scores[ex.id]['output']}")
    assert results["score"] == sum(ex.points for ex in restored)
    stubbed_output = scores[reference[1].id]["output"]
    assert "not written yet" in stubbed_output and reference[1].file in stubbed_output
    stubbed = reference[1]
    check = run_in(copy, "check", stubbed.id)
    line = next(ex.line for ex in find_exercises(copy) if ex.id == stubbed.id)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "0/" in check.stdout and "not written yet" in check.stdout and f"Hint: {stubbed.hint}" in check.stdout
    assert f"{stubbed.file}:{line}, in {stubbed.function}" in check.stdout, check.stdout


@reference_only
def test_grade_on_the_reference_scores_full_marks(tmp_path, reference):
    run = tool.run_exercise_tests(None, ROOT)
    scores = tool.score_exercises(reference, run)
    assert [s.exercise.id for s in scores if s.score != s.exercise.points] == [], \
        "\n\n".join(s.output for s in scores if s.score != s.exercise.points)
    results = tool.gradescope_results(scores)
    assert results["score"] == sum(ex.points for ex in reference)
    assert all(set(t) >= {"name", "score", "max_score", "output"} for t in results["tests"])


# ------------------------------------------------------------------ slow: each region alone, the whole suite

@reference_only
@pytest.mark.slow
@pytest.mark.parametrize("ex_id", [ex.id for ex in find_exercises(ROOT)] if not IN_STUDENT_COPY else [])
def test_each_region_put_back_alone_passes_with_everything_else_stubbed(tmp_path, reference, ex_id):
    copy = tmp_path / "one"
    make_copy(copy)
    ex = next(e for e in reference if e.id == ex_id)
    restore(copy, ex)
    proc = run_in(copy, "check", ex_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@reference_only
@pytest.mark.slow
def test_the_whole_suite_in_a_stubbed_copy_fails_only_the_exercise_tests(stubbed_copy, tmp_path):
    report = tmp_path / "report.jsonl"
    env = {**os.environ, "PYTHONPATH": str(stubbed_copy), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--exercise-report={report}"],
                          cwd=stubbed_copy, env=env, capture_output=True, text=True, timeout=1800)
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert not [r for r in lines if r["kind"] == "error"], proc.stdout[-3000:]
    rows = [r for r in lines if r["kind"] == "result"]
    wrong = [f"{r['nodeid']}: {r['outcome']}: {r['message'][:300]}" for r in rows
             if (r["outcome"] == "failed") != bool(r["exercises"])]
    assert not wrong, "in a fully stubbed copy only exercise tests may fail, and all of them must:\n" + "\n".join(wrong)
