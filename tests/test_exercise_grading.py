"""Grading: the data a child may send, the judging of it, the results file, the CLI's errors, splicing a
submission's regions, and the real project graded end to end (stubbed: 0; solved: full marks).

Slow (-m slow): each region put back alone, and the whole suite in a stubbed copy."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from minillm.classroom import (callers, cli, exposure, grading, judge as judging, manifest as manifests,
                               results as report, runner, splice, wire)
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import ExerciseError, find_exercises

from exercise_tool_support import reference, stubbed_copy, tiny_project  # noqa: F401  (fixtures)
from exercise_tool_support import (IN_STUDENT_COPY, REGION, ROOT, SUBMITTED, TWO_REGIONS, judged, parse,
                                    reference_only, restore, results_by_exercise, run_tool, world_readable)


def test_only_plain_data_crosses_from_a_child():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    sent = {"ints": [AlwaysEqual(3), 4], "t": torch.arange(6).reshape(2, 3), "pair": (1.5, float("-inf")),
            "keys": {7: "x"}, "obj": object(), "flag": True}
    got = wire.over_the_wire(sent)
    assert type(got["ints"][0]) is int and got["ints"][0] != 5
    assert torch.equal(got["t"], torch.arange(6).reshape(2, 3)) and got["t"].dtype == torch.int64
    assert got["pair"] == (1.5, float("-inf")) and got["keys"] == {7: "x"} and got["flag"] is True
    assert isinstance(got["obj"], wire.Opaque) and got["obj"].opaque_type == "object"


@pytest.mark.parametrize("forged", [
    {"tensor": {"dtype": "float32", "shape": [2, 2], "data": [1.0]}},
    {"tensor": {"dtype": "complex_object", "shape": [1], "data": [1]}},
    {"tensor": {"dtype": "float32", "shape": [-1], "data": []}},
    {"pickle": "gASVAAAAAAAAAAA="},
    {"dict": [[[1, 2], 3]]},
])
def test_the_grader_refuses_data_it_did_not_encode(forged):
    with pytest.raises(ValueError):
        wire.from_wire(forged)


def test_the_grader_judges_each_case_once_and_says_what_happened():
    stub = {"type": "NotImplementedError", "message": "exercise pool-take (lesson 07): ...", "where": "minillm/pool.py:6"}
    score = judged([{"start": "c0"}, {"case": 0, "output": 0}, {"case": 1, "output": 7},
                    {"case": 2, "output": 2}, {"case": 2, "output": 2},      # twice: someone wrote to the channel
                    {"case": 3, "raised": stub}, {"case": 4, "raised": {"type": "SystemExit", "message": "0",
                                                                          "exit_code": "0", "where": ""}}],
                   ended="it ran past the time limit of 5 s and was stopped: an endless loop? (during case c5)")
    by_name = {r.name: r for r in score.results}
    assert [r.passed for r in score.results] == [True, False, False, False, False, False]
    assert "expected 1, got 7" in by_name["c1"].message
    assert "came back 2 times" in by_name["c2"].message
    assert by_name["c3"].message == "not written yet: the stub raises NotImplementedError"
    assert "sys.exit(0)" in by_name["c4"].message
    assert by_name["c5"].message == "never came back: the run ended early (see above)"
    assert "ran past the time limit" in report.feedback(score, True)
    assert score.score == 0.0
    half = judged([{"case": i, "output": i if i < 4 else -1} for i in range(6)])
    assert half.score == 1.0                       # 2 pts × 2/4 held-out checks; the visible cases do not count
    assert "2/4 held-out checks" in report.feedback(half, True) and "printed this" in report.feedback(half, True)
    edges = ["c0", "c1", "edge: a", "edge: b", "edge: c", "c5"]   # one edge of three passes: below the floor
    no_edge = judged([{"case": i, "output": i if i in (0, 1, 2, 5) else -1} for i in range(6)], names=edges)
    assert [r.passed for r in no_edge.of(True)] == [True, False, False, True] and no_edge.score == 0.0
    assert "No points" in report.feedback(no_edge, True) and "at least 50% of its edges" in report.feedback(no_edge, True)
    two_edges = judged([{"case": i, "output": i if i != 4 else -1} for i in range(6)], names=edges)
    assert two_edges.score == 1.5 and "No points" not in report.feedback(two_edges, True)


def test_gradescope_results_are_valid_field_by_field():
    score = judged([{"case": i, "output": i} for i in range(6)])
    results = report.gradescope_results([score], seed=123, held_out_visibility="after_due_date")
    assert report.results_problems(results) == []
    assert results["score"] == 2.0 and results["extra_data"] == {"seed": 123} and "seed 123" in results["output"]
    visible, held = results["tests"]
    assert (visible["max_score"], visible["visibility"], held["max_score"], held["visibility"]) == \
        (0.0, "visible", 2.0, "after_due_date")
    for broken, problem in [({**results, "score": "2"}, "top-level score"),
                            ({**results, "tests": [{**held, "visibility": "later"}]}, "visibility"),
                            ({**results, "tests": [{**held, "score": 3.0}]}, "outside 0..2.0"),
                            ({**results, "tests": [{k: v for k, v in held.items() if k != "output"}]}, "output"),
                            ({**results, "tests": [{**held, "name": ""}]}, "name"),
                            ({**results, "tests": [{**held, "max_score": None}]}, "max_score"),
                            ({**results, "tests": [{**held, "status": "ok"}]}, "status")]:
        assert any(problem in p for p in report.results_problems(broken)), (problem, report.results_problems(broken))


@reference_only
def test_cli_errors_are_one_clear_line_and_grade_still_writes_results(tmp_path, capsys, monkeypatch):
    assert cli.main(["make", str(tmp_path / "s"), "--only", "no-such-exercise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown exercise id no-such-exercise; the exercises are: ") and "\n" == err[-1]
    assert cli.main(["make", str(tmp_path / "s"), "--only", ","]) == 2
    assert "names no exercise" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert cli.main(["make", str(tmp_path / "full")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert cli.main(["make", "/proc/nope"]) == 2                # a folder that cannot be made: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the copy into /proc/nope") and len(err.splitlines()) == 1, err
    monkeypatch.setattr(cli, "ROOT", tmp_path)   # a tree without checks, then one with a corrupt manifest
    for manifest, said in ((None, "holds no checks"), ("{corrupt", "not valid JSON")):
        if manifest:
            (tmp_path / manifests.MANIFEST).write_text(manifest)
        assert cli.main(["grade", "--json", str(tmp_path / "results.json")]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.splitlines()) == 1, err
        results = json.loads((tmp_path / "results.json").read_text())
        assert results["score"] == 0 and "grading failed" in results["output"] and report.results_problems(results) == []
    assert cli.main(["grade", "--json", "/proc/nope/r.json"]) == 2   # nowhere to write the results: one line
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the results to /proc/nope/r.json") and len(err.splitlines()) == 1, err
    monkeypatch.setenv("MINILLM_GRADE_SEED", "1234")
    assert grading.grade_seed() == 1234
    assert "warning: the held-out inputs are fixed (seed 1234)" in capsys.readouterr().err
    monkeypatch.delenv("MINILLM_GRADE_SEED")
    assert grading.grade_seed() != grading.grade_seed()   # a fresh one each time (two equal draws in 2³¹: never)
    monkeypatch.setenv("MINILLM_GRADE_TIMEOUT", "soon")
    with pytest.raises(ExerciseError, match="MINILLM_GRADE_TIMEOUT"):
        grading.grade_timeout(None)


@reference_only
def test_every_exercise_has_a_check_whose_caller_holds_no_oracle(reference):
    checks = judging.load_checks(ROOT)
    assert sorted(checks) == sorted(ex.id for ex in reference), "every region needs exactly one Check"
    for ex in reference:
        c = checks[ex.id]
        visible, held, held_again, other = c.visible(), c.held_out(1), c.held_out(1), c.held_out(2)
        values = lambda cases: json.dumps(wire.to_wire(cases))   # noqa: E731
        assert values(held) == values(held_again) != values(other), f"{ex.id}: a seed must fix the held-out inputs"
        assert values(visible) == values(c.visible()), f"{ex.id}: a copy holds the visible answers, so the visible " \
                                                       f"inputs must be the same every time"
        assert not any(values(held[f"edge: {name}"]) == values(other[f"edge: {name}"]) for name in c.edges()), \
            f"{ex.id}: an edge keeps its situation and draws its values, so no two seeds share one"
        assert len(visible) >= 3 and len(held) >= 6, f"{ex.id}: {len(visible)} visible cases, {len(held)} held-out"
        assert sorted(held) == sorted(other), f"{ex.id}: every draw must hold the same situations"
        assert c.where == f"{ex.file}, {ex.function}", f"{ex.id}'s check says the code is at {c.where}"
        assert '"object"' not in values({**visible, **held}), f"{ex.id}: inputs must be plain data for the child"
        source = callers.caller_source(c)   # what the child gets: run, and what run uses
        compile(source, ex.id, "exec")
        assert "def verify" not in source and "oracle" not in source and "expected" not in source, source


def test_a_caller_that_reaches_an_oracle_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "tests" / "exercises"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / judging.EXERCISE_TESTS / "exercise_checks.py", folder)
    (folder / "test_ex_bad.py").write_text(
        "from exercise_checks import Check\n\n"
        "def attention_oracle(q, k, v):\n    return q.double()\n\n"
        "class Bad(Check):\n    exercise = 'bad'\n\n    def run(self, inputs):\n"
        "        return attention_oracle(inputs['q'], inputs['k'], inputs['v'])\n\nBAD = Bad()\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("exercise_checks", "test_ex_bad"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    checks = judging.load_checks(tmp_path)
    with pytest.raises(ExerciseError, match="Bad.run uses .*attention_oracle.*must hold no oracle"):
        callers.caller_source(checks["bad"])
    (folder / "key_bad.py").write_text("def answer(inputs):\n    return inputs\n")
    (folder / "test_ex_bad.py").write_text(
        "from exercise_checks import Check\n\n"
        "class Bad(Check):\n    exercise = 'bad'\n\n    def run(self, inputs):\n"
        "        from key_bad import answer\n        return answer(inputs)\n\nBAD = Bad()\n")
    sys.modules.pop("test_ex_bad", None)
    with pytest.raises(ExerciseError, match="Bad.run uses key_bad.*must hold no oracle"):
        callers.caller_source(judging.load_checks(tmp_path)["bad"])
    for name in ("exercise_checks", "test_ex_bad"):   # the real checks' module of the same name comes back
        sys.modules.pop(name, None)

PROBE = '''\
import importlib, pkgutil
import minillm
from minillm.model import attention_by_hand


def test_probe_every_module_imports():
    for m in pkgutil.iter_modules(minillm.__path__):
        if not m.name.startswith("__"):
            importlib.import_module("minillm." + m.name)


def test_probe_reaches_a_stub_it_does_not_own():
    attention_by_hand(None, None, None)
'''


@reference_only
def test_a_stubbed_copy_scores_0_and_its_pytest_report_is_one_line_per_exercise(stubbed_copy, reference, tmp_path):
    proc = run_tool(stubbed_copy, "grade", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")
    assert sorted(results) == sorted(ex.id for ex in reference)
    for ex in reference:
        held = results[ex.id]["held-out checks"]
        assert held["score"] == 0 and held["max_score"] == ex.points, held
        for part in results[ex.id].values():   # every case fails, each on this exercise's own stub
            failures = re.findall(r"FAIL .*\n(.*)", part["output"])
            assert failures and set(failures) == {"not written yet: the stub raises NotImplementedError"}, part["output"]
    check = run_tool(stubbed_copy, "check", "paged-slot-mapping")
    ex = next(e for e in find_exercises(stubbed_copy) if e.id == "paged-slot-mapping")
    assert check.returncode == 1 and "0/5 pass" in check.stdout and f"Hint: {ex.hint}" in check.stdout
    assert f"{ex.file}:{ex.line}, in {ex.function}" in check.stdout, check.stdout
    (stubbed_copy / "tests" / "test_probe.py").write_text(PROBE)
    try:
        pytest_run = subprocess.run([sys.executable, "-m", "pytest", "tests/exercises", "tests/test_probe.py", "-q",
                                     "-p", "no:cacheprovider", "-rs"], cwd=stubbed_copy, capture_output=True, text=True,
                                    timeout=600, env={**os.environ, "PYTHONPATH": str(stubbed_copy)})
    finally:
        (stubbed_copy / "tests" / "test_probe.py").unlink()
    out = pytest_run.stdout
    assert pytest_run.returncode == 1, out           # work is left, though nothing failed
    assert f"{len(reference)} exercises still to write" in out
    assert "needs exercise model-causal-attention, still a stub" in out
    for ex in find_exercises(stubbed_copy):
        assert f"{ex.id} ({ex.worth}): {ex.where()}" in out
    assert "Traceback" not in out and "NotImplementedError" not in out and len(out.splitlines()) < 30, out


@reference_only
def test_a_fully_solved_copy_scores_full_marks(tmp_path, reference):
    copy = tmp_path / "solved"
    make_copy(copy, keys=True)
    for ex in find_exercises(copy):
        restore(copy, next(r for r in reference if r.id == ex.id))
    proc = run_tool(copy, "grade", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")
    wrong = {i: r for i, r in results.items() if any(t["status"] != "passed" for t in r.values())}
    assert not wrong, json.dumps(wrong, indent=1)[:5000]
    assert json.loads((tmp_path / "results.json").read_text())["score"] == sum(ex.points for ex in reference)


@reference_only
@pytest.mark.slow
@pytest.mark.parametrize("ex_id", [ex.id for ex in find_exercises(ROOT)] if not IN_STUDENT_COPY else [])
def test_each_region_put_back_alone_passes_with_everything_else_stubbed(tmp_path, reference, ex_id):
    copy = tmp_path / "one"
    make_copy(copy, keys=True)
    restore(copy, next(e for e in reference if e.id == ex_id))
    proc = run_tool(copy, "grade", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")
    scored = {i: r["held-out checks"]["score"] for i, r in results.items() if r["held-out checks"]["score"]}
    assert scored == {ex_id: next(e.points for e in reference if e.id == ex_id)}, scored


@reference_only
@pytest.mark.slow
def test_the_whole_suite_in_a_stubbed_copy_reports_in_a_few_lines(stubbed_copy, reference):
    env = {**os.environ, "PYTHONPATH": str(stubbed_copy), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=stubbed_copy, env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 1 and " failed" not in out and " error" not in out, out[-5000:]
    assert f"{len(reference)} exercises still to write" in out and "Traceback" not in out, out[-5000:]
    assert len(out.splitlines()) < 60, out


def test_only_the_regions_of_a_submission_are_taken():
    mine = parse(TWO_REGIONS)
    bodies, broken = splice.regions_of_submission("import os\nos.system('x')\n" + SUBMITTED + "EVIL = 1\n",
                                                  "minillm/pool.py", mine)
    assert broken == {} and bodies == {"pool-take": ["        return [self.free.pop() for _ in range(n)]"],
                                       "pool-give": list(mine[1].body)}
    swapped = SUBMITTED.replace("pool-take", "POOL").replace("pool-give", "pool-take").replace("POOL", "pool-give")
    bodies, broken = splice.regions_of_submission(swapped, "minillm/pool.py", mine)   # in another order: still whole
    assert broken == {} and bodies["pool-give"] == ["        return [self.free.pop() for _ in range(n)]"]


@pytest.mark.parametrize("submitted, message", [
    (SUBMITTED.replace("        # >>> exercise pool-give (lesson 07, 1 pts): give blocks back\n", ""),
     {"pool-give": r"minillm/pool.py: the marker of exercise pool-give .* appears 0 times"}),
    (SUBMITTED + "        # >>> exercise pool-take (lesson 07, 2 pts): again\n",
     {"pool-take": r"minillm/pool.py: the marker of exercise pool-take .* appears 2 times \(lines 4, 15\)"}),
    (SUBMITTED.replace("        return [self.free.pop() for _ in range(n)]\n        # <<< exercise\n", "        x = 1\n", 1),
     {"pool-take": r"minillm/pool.py:4: exercise pool-take has no end marker"}),
    (SUBMITTED.replace("        return [self", '        x = """\n        return [self').replace(
        "            self.free.append(block)\n", '            self.free.append(block)\n        """\n'),
     {"pool-take": r"minillm/pool.py:\d+: the code of exercise pool-take is not valid Python on its own",
      "pool-give": r"minillm/pool.py:\d+: the code of exercise pool-give is not valid Python on its own"}),
])
def test_a_broken_region_costs_only_its_own_exercise_naming_file_and_marker(submitted, message):
    bodies, broken = splice.regions_of_submission(submitted, "minillm/pool.py", parse(TWO_REGIONS))
    assert sorted(broken) == sorted(message) and not set(bodies) & set(broken)
    assert sorted(bodies) == sorted({"pool-take", "pool-give"} - set(broken))
    for ex_id, pattern in message.items():
        assert re.search(pattern, broken[ex_id]), broken[ex_id]


def test_what_a_child_sends_costs_its_own_cases_only():
    forged = {"tensor": {"dtype": "int8", "shape": [1], "data": [100000]}}   # torch raises on decoding it
    score = judged([{"case": i, "output": forged if i == 3 else i} for i in range(6)])
    assert [r.passed for r in score.results] == [True, True, True, False, True, True]
    assert "cannot read" in score.results[3].message

    class Exploding:
        floor = 0.5

        def verify(self, inputs, output):
            raise RecursionError("a structure too deep to compare")   # a check's own error stays in its exercise

    (ex,) = parse(REGION)
    cases = [judging.Case("c", {}, True)]
    broken = judging.judge(ex, Exploding(), cases, runner.ChildRun([{"case": 0, "output": 1}], 0, "", ""))
    assert "could not be checked (RecursionError" in broken.results[0].message
    exploding_run = runner.ChildRun([{"case": 0, "output": 1}], 0, "", "")
    exploding_run.messages = None   # whatever goes wrong in judging itself: this exercise fails, with a reason
    broken = judging.judge(ex, Exploding(), cases, exploding_run)
    assert broken.score == 0 and not broken.results[0].passed
    assert runner.signal_name(11) == "SIGSEGV" and runner.signal_name(40) == "signal 40"


def test_the_results_file_is_ascii_and_written_whole_whatever_the_code_said(tmp_path):
    score = judged([{"case": i, "raised": {"type": "ValueError", "message": "\udcff é"}} for i in range(6)])
    path = tmp_path / "out" / "results.json"
    report.write_results(path, report.gradescope_results([score], seed=1))
    raw = path.read_bytes()
    assert all(b < 128 for b in raw) and "\udcff" in json.loads(raw)["tests"][1]["output"]
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]   # no partial file left behind


def test_hidden_held_out_checks_keep_the_runs_output_out_of_sight():
    score = judged([{"case": i, "output": -1} for i in range(6)], ended="it ran past the time limit (during case c5)")
    hidden = report.gradescope_results([score], seed=1, held_out_visibility="after_due_date")
    visible_entry = next(t for t in hidden["tests"] if t["visibility"] == "visible")
    assert "printed this" not in visible_entry["output"] and "c5" not in visible_entry["output"]
    assert "points (the held-out checks are shown after due date)" in hidden["output"]
    shown = report.gradescope_results([score], seed=1)
    assert "printed this" in shown["tests"][0]["output"] and "0 / 2 points" in shown["output"]


@reference_only
def test_list_shows_whole_titles_within_100_columns(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) > 14 and max(len(line) for line in lines) <= cli.WIDTH, max(lines, key=len)
    words = " ".join(out.split())
    for ex in find_exercises(ROOT):   # every word of every title, in order, once the wrapping is undone
        assert " ".join(ex.title.split()) in words, ex.title


@reference_only
def test_one_broken_marker_costs_only_its_exercise_and_the_results_say_which(tmp_path, reference):
    """A submission whose top-p region lost its end marker: top-k, written honestly, still gets its points, and
    top-p's results name the file, the line and the marker."""
    graded = "sampling-top-k,sampling-top-p"
    make_copy(tmp_path / "grading", only=graded, keys=True)
    make_copy(tmp_path / "student", only=graded)
    restore(tmp_path / "student", next(r for r in reference if r.id == "sampling-top-k"))
    student = {ex.id: ex for ex in find_exercises(tmp_path / "student")}
    path = tmp_path / "student" / "minillm" / "sampling.py"
    lines = path.read_text().splitlines(keepends=True)
    top_p = student["sampling-top-p"]
    end = next(n for n in range(top_p.line, len(lines)) if lines[n].strip() == "# <<< exercise")
    path.write_text("".join(lines[:end] + lines[end + 1:]))
    proc = run_tool(tmp_path / "grading", "grade", str(tmp_path / "student"), "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")
    assert results["sampling-top-k"]["held-out checks"]["score"] == next(
        r.points for r in reference if r.id == "sampling-top-k")
    held = results["sampling-top-p"]["held-out checks"]
    assert held["score"] == 0 and (f"minillm/sampling.py:{top_p.line}: exercise sampling-top-p has no end marker"
                                   in held["output"]), held["output"]


def test_grading_refuses_a_tree_whose_graded_solutions_the_user_can_reach(tiny_project, monkeypatch):
    """The tree graded from holds the solutions (its files, its .git): with --user, grading from it is refused,
    saying what to do instead, unless the user cannot reach it; a copy whose regions are stubs is graded."""
    monkeypatch.setattr(exposure, "installed_packages", lambda: [])   # only the tree graded from, here
    base = Path(tempfile.mkdtemp(prefix="minillm-exposure-"))
    try:
        base.chmod(0o755)
        monkeypatch.chdir(base)
        tree = base / "reference"
        shutil.copytree(tiny_project, tree)
        world_readable(base)
        exercises = find_exercises(tree)
        assert exposure.solutions_in(tree, exercises) == ["pool-take", "pool-give"]
        with pytest.raises(ExerciseError, match=rf"the tree you grade from, {tree}, holds the solution of pool-take, "
                                                rf"pool-give, and nobody can read it .*--for-grading.*chmod 700 {tree}"):
            exposure.check_out_of_reach("nobody", tree, exercises)
        tree.chmod(0o700)
        exposure.check_out_of_reach("nobody", tree, exercises)     # out of nobody's reach: graded
        tree.chmod(0o755)
        copy = base / "copy"
        make_copy(copy, root=tree)
        world_readable(copy)
        assert exposure.solutions_in(copy, exercises) == []
        exposure.check_out_of_reach("nobody", copy, exercises)     # stubs: nothing to read
        (copy / "tests" / "exercises").mkdir(parents=True)
        (copy / "tests" / "exercises").chmod(0o755)
        with pytest.raises(ExerciseError, match=r"nobody can read the checks .*chmod -R go-rwx"):
            exposure.check_out_of_reach("nobody", copy, exercises)
    finally:
        shutil.rmtree(base, ignore_errors=True)
