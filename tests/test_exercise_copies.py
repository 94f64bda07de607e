"""Making copies: the marker parser, `make` on a synthetic git project, the manifest, the leak check, and a
student copy that holds the visible answers as data and no answer key."""
from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from minillm.classroom import answers, copies, judge as judging, leaks, manifest as manifests, regions, wire
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import ExerciseError, find_exercises, replace_region

from exercise_tool_support import tiny_project, tiny_with_checks  # noqa: F401  (fixtures)
from exercise_tool_support import (KEY_OF_POOL, REGION, ROOT, TWO_REGIONS, files_under, git,
                                    only_sampling_top_k_stubbed, parse, pytest_in, reference_only, run_tool)


def test_parse_reads_every_field():
    (ex,) = parse(REGION)
    assert (ex.id, ex.title, ex.lesson, ex.points, ex.hint) == (
        "pool-take", "take n blocks off the free list", "07", 2, "pop from the end")
    assert (ex.file, ex.line, ex.function, ex.indent) == ("minillm/pool.py", 4, "Pool.take", " " * 8)
    assert ex.body == ("        taken = self.free[-n:]", "        del self.free[-n:]", "        return taken")
    assert ex.where() == "minillm/pool.py:4, in Pool.take"


def test_parse_accepts_one_pt_module_level_regions_and_deeper_code():
    text = ("# >>> exercise answer (lesson 02, 1 pt): the answer\n# hint: six times seven\n"
            "if True:\n    ANSWER = 42\n# <<< exercise\n")
    (ex,) = parse(text)
    assert (ex.points, ex.function, ex.body[-1]) == (1, "<module>", "    ANSWER = 42")


def test_parse_finds_several_regions_in_order():
    second = REGION.replace("pool-take", "pool-give").replace("def take", "def give")
    assert [ex.id for ex in parse(REGION + second)] == ["pool-take", "pool-give"]
    assert parse(REGION + second)[1].line == 13


@pytest.mark.parametrize("broken, message", [
    (REGION.replace("        # <<< exercise\n", ""), r"minillm/pool.py:4: exercise pool-take has no end marker"),
    (REGION.replace("(lesson 07, 2 pts)", "(lesson 5, 2 pts)"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("pool-take", "Pool_Take"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("2 pts): take", "2 pts) take"), r"minillm/pool.py:4: malformed exercise marker"),
    (REGION.replace("# hint: pop", "# pop"), r"minillm/pool.py:5: exercise pool-take needs a '# hint: \.\.\.' line"),
    (REGION.replace("        del self", "        # >>> exercise inner (lesson 07, 1 pts): x\n        del self"),
     r"minillm/pool.py:7: a region starts inside exercise pool-take \(opened at minillm/pool.py:4\)"),
    (REGION.replace("        # <<< exercise", "    # <<< exercise"), r"minillm/pool.py:9: the end marker .* indentation"),
    ("x = 1\n# <<< exercise\n", r"minillm/pool.py:2: '# <<< exercise' with no region open"),
    ("# >>> exercise e (lesson 02, 1 pts): t\n# hint: h\n\n# <<< exercise\n", r"minillm/pool.py:1: .*no code"),
    ("def f():\n    # >>> exercise e (lesson 02, 1 pts): t\n    # hint: h\n    x = 1\ny = 2\n    # <<< exercise\n",
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
    assert str(err.value) == ("exercise pool-take (lesson 07): take n blocks off the free list. Hint: pop from the end")
    (stubbed,) = parse(text)
    assert stubbed.is_stub and not ex.is_stub


def test_putting_the_code_back_restores_the_file_exactly():
    (ex,) = parse(REGION)
    stubbed = replace_region(REGION, ex.file, ex.id, ex.stub())
    assert replace_region(stubbed, ex.file, ex.id, list(ex.body)) == REGION


def test_select_names_the_known_ids_and_refuses_an_empty_list():
    exs = parse(REGION + REGION.replace("pool-take", "pool-give"))
    assert [e.id for e in regions.select(exs, " pool-give ,")] == ["pool-give"]
    with pytest.raises(ExerciseError, match=r"unknown exercise id nope; the exercises are: pool-take, pool-give"):
        regions.select(exs, "pool-take,nope")
    for empty in (",", " , ", ""):
        with pytest.raises(ExerciseError, match="names no exercise"):
            regions.select(exs, empty)


@reference_only
def test_exercises_are_listed_in_lesson_order():
    lessons = [ex.lesson for ex in find_exercises(ROOT)]
    assert lessons == sorted(lessons)
    assert {ex.id: ex.lesson for ex in find_exercises(ROOT)}["scheduler-budget-fill"] == "10"


def test_make_copies_exactly_what_git_tracks_and_the_copys_line_numbers(tiny_project, tmp_path):
    chosen = make_copy(tmp_path / "student", root=tiny_project)
    assert files_under(tmp_path / "student") == {"minillm/__init__.py", "minillm/pool.py", "tests/test_pool.py",
                                                 "lessons/01_x.py", "README.md", "pyproject.toml", manifests.MANIFEST}
    text = (tmp_path / "student/minillm/pool.py").read_text()
    assert "self.free[-n:]" not in text and "self.free.append" not in text
    # pool-give starts 2 lines earlier in the copy: pool-take's 3 lines of code became 1 stub line.
    reference = {ex.id: ex.line for ex in find_exercises(tiny_project)}
    assert [(ex.id, ex.line) for ex in chosen] == [("pool-take", 4), ("pool-give", reference["pool-give"] - 2)]
    assert text.splitlines()[chosen[1].line - 1].strip().startswith("# >>> exercise pool-give")
    manifest = json.loads((tmp_path / "student" / manifests.MANIFEST).read_text())
    assert [(e["id"], e["line"], e["stubbed"]) for e in manifest["exercises"]] == [(ex.id, ex.line, True) for ex in chosen]
    assert set(manifest["files"]) == files_under(tmp_path / "student") - {manifests.MANIFEST}
    assert "minillm/pool.py~" in copies.untracked_files(tiny_project)   # make tells the instructor what it left out


def test_the_catalogue_of_wrong_versions_stays_with_the_instructor():
    files = copies.tracked_files(ROOT)
    assert not [f for f in files if "/wrong_" in f or "/key_" in f] and "tests/test_exercise_catalogue.py" not in files
    assert (ROOT / "tests/exercises/wrong_sampling.py").is_file()


def test_make_only_stubs_the_chosen_and_the_manifest_says_so(tiny_project, tmp_path):
    chosen = make_copy(tmp_path / "s", only="pool-give", root=tiny_project)
    assert [ex.id for ex in chosen] == ["pool-give"]
    assigned = manifests.assigned_exercises(tmp_path / "s")
    assert [ex.id for ex in assigned] == ["pool-give"] and assigned[0].line == chosen[0].line
    with pytest.raises(ExerciseError, match="names no exercise"):
        make_copy(tmp_path / "t", only=",", root=tiny_project)
    assert not (tmp_path / "t").exists()


def test_make_writes_only_into_a_new_or_empty_folder_outside_the_project(tiny_project, tmp_path):
    for inside in (tiny_project, tiny_project / "lessons", tiny_project.parent):
        with pytest.raises(ExerciseError, match="inside the project or holds it"):
            make_copy(inside, root=tiny_project, force=True)
    assert (tiny_project / "README.md").read_text() == "# hi\n" and not (tiny_project / "lessons" / "minillm").exists()
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExerciseError, match="exists and is not empty.*--force"):
        make_copy(target, root=tiny_project)
    with pytest.raises(ExerciseError, match="--force replaces only a previous copy"):
        make_copy(target, root=tiny_project, force=True)
    assert files_under(target) == {"notes.txt"}


def test_make_force_deletes_only_what_the_previous_copy_wrote(tiny_project, tmp_path):
    target = tmp_path / "student"
    make_copy(target, root=tiny_project)
    (target / "notes.txt").write_text("mine")                      # the student's own files...
    (target / "minillm" / "mine.py").write_text("mine = 1\n")
    (target / "minillm" / "pool.py").write_text("edited\n")        # ...and an edit of a copied one
    (target / "minillm" / "__pycache__").mkdir()
    (target / "minillm" / "__pycache__" / "pool.cpython.pyc").write_text("c")
    git(tiny_project, "rm", "-q", "--cached", "lessons/01_x.py")  # the project no longer has the lesson
    make_copy(target, root=tiny_project, force=True)
    assert (target / "notes.txt").read_text() == "mine" and (target / "minillm" / "mine.py").exists()
    assert (target / "minillm" / "__pycache__" / "pool.cpython.pyc").exists()
    assert "# >>> exercise pool-take" in (target / "minillm" / "pool.py").read_text()
    assert not (target / "lessons").exists(), "the old copy's lesson (and its then empty folder) go"
    (target / "README.md").unlink()
    manifest = json.loads((target / manifests.MANIFEST).read_text())
    manifest["files"].remove("README.md")                          # a file the copy did not write...
    (target / manifests.MANIFEST).write_text(json.dumps(manifest))
    (target / "README.md").write_text("someone else's\n")           # ...where the new copy would write
    with pytest.raises(ExerciseError, match="(?s)holds files the previous copy did not write.*README.md"):
        make_copy(target, root=tiny_project, force=True)
    assert (target / "README.md").read_text() == "someone else's\n"


def test_make_refuses_a_tree_git_does_not_track(tiny_project, tmp_path):
    shutil.rmtree(tiny_project / ".git")
    with pytest.raises(ExerciseError, match="not a git checkout"):
        make_copy(tmp_path / "student", root=tiny_project)


def test_make_stops_before_writing_on_an_unterminated_marker(tiny_project, tmp_path):
    (tiny_project / "minillm" / "pool.py").write_text(REGION.replace("        # <<< exercise\n", ""))
    with pytest.raises(ExerciseError, match=r"minillm/pool.py:4: exercise pool-take has no end marker"):
        make_copy(tmp_path / "student", root=tiny_project)
    assert not (tmp_path / "student").exists()


def test_make_refuses_a_hint_that_gives_the_solution_away(tiny_project, tmp_path):
    told = TWO_REGIONS.replace("# hint: pop from the end", "# hint: taken = self.free[-n:] then del self.free[-n:]")
    (tiny_project / "minillm" / "pool.py").write_text(told)
    with pytest.raises(ExerciseError, match=r"(?s)would leak.*minillm/pool.py:5: exercise pool-take"):
        make_copy(tmp_path / "student", root=tiny_project)
    assert not (tmp_path / "student").exists()

TAKE_IN_CODE = "def test_take(pool, n):\n    taken = pool.free[-n:]\n    del pool.free[-n:]\n    return taken\n"


@pytest.mark.parametrize("test_file, leak", [
    (TAKE_IN_CODE, "tests/test_pool.py:2: exercise pool-take"),                       # the solution, as a test's code
    ("x = 1\n# taken = pool.free[-n:]; del pool.free[-n:]\n", "tests/test_pool.py:2: exercise pool-take"),  # a comment
    ("def test_peek(pool, n):\n    assert pool.free[-n:] == pool.peek(n)\n", None),   # a line the package shows too
])
def test_make_reads_the_tests_code_and_prose_and_names_the_leak(tiny_project, tmp_path, test_file, leak):
    pool = TWO_REGIONS + "\n    def peek(self, n):\n        return self.free[-n:]\n"   # outside the regions: an idiom
    (tiny_project / "minillm" / "pool.py").write_text(pool)
    (tiny_project / "tests" / "test_pool.py").write_text(test_file)
    if leak is None:
        make_copy(tmp_path / "student", root=tiny_project)
        return
    with pytest.raises(ExerciseError, match=rf"(?s)would leak.*{re.escape(leak)}") as refused:
        make_copy(tmp_path / "student", root=tiny_project)
    assert "minillm/pool.py" not in str(refused.value), "the package's own code is not a leak"
    assert not (tmp_path / "student").exists()


def test_a_copy_of_a_solution_in_a_test_is_a_leak_even_where_the_package_shows_its_pieces(tiny_project, tmp_path):
    # Every 8 tokens of pool-take appear in the package outside its region, so each is an idiom; 16 in a row in a
    # test are still a copy of the solution.
    pool = TWO_REGIONS + "\n    def take_again(self, n):\n        taken = self.free[-n:]\n        del self.free[-n:]\n" \
                         "        return taken\n"
    (tiny_project / "minillm" / "pool.py").write_text(pool)
    (tiny_project / "tests" / "test_pool.py").write_text(TAKE_IN_CODE)
    with pytest.raises(ExerciseError, match=r"(?s)would leak.*tests/test_pool.py:2: exercise pool-take"):
        make_copy(tmp_path / "student", root=tiny_project)


def test_make_writes_the_visible_answers_as_data_and_no_key(tiny_with_checks, tmp_path):
    copy = tmp_path / "student"
    make_copy(copy, only="pool-give", root=tiny_with_checks)
    held = {p.name for p in (copy / "tests" / "exercises").iterdir()}
    assert held == {"exercise_checks.py", "test_ex_pool.py", "visible_answers.json"}, held
    written = json.loads((copy / answers.ANSWERS).read_text())
    assert written["format"] == answers.ANSWERS_FORMAT
    assert {case: wire.from_wire(a)["want"] for case, a in written["exercises"]["pool-take"].items()} == {
        "take 1 of 5": {"taken": [5], "left": [1, 2, 3, 4]}, "take 2 of 5": {"taken": [4, 5], "left": [1, 2, 3]},
        "take 3 of 5": {"taken": [3, 4, 5], "left": [1, 2]}}
    manifest = json.loads((copy / manifests.MANIFEST).read_text())
    assert answers.ANSWERS in manifest["files"] and manifest["answer_keys"] is False
    graders = tmp_path / "grader"
    make_copy(graders, only="pool-give", root=tiny_with_checks, keys=True)   # for the grading image: the keys too
    assert {p.name for p in (graders / "tests" / "exercises").iterdir()} == held | {"key_pool.py"}
    assert json.loads((graders / manifests.MANIFEST).read_text())["answer_keys"] is True


def test_make_refuses_an_answer_it_cannot_write_into_a_copy(tiny_with_checks, tmp_path):
    """One the reference fails, one that is not data, and one whose mistake's name spells out the solution."""
    key = tiny_with_checks / "tests" / "exercises" / "key_pool.py"
    key.write_text(KEY_OF_POOL.replace("return {", "return {'want': []} if n == 2 else {"))
    with pytest.raises(ExerciseError, match=r"exercise pool-take, visible case 'take 2 of 5': the reference fails"):
        make_copy(tmp_path / "student", root=tiny_with_checks)
    assert not (tmp_path / "student").exists()
    key.write_text("def take(free, n):\n    return object()\n")   # an answer must be data, to be written down
    sys.modules.pop("key_pool", None)
    with pytest.raises(ExerciseError, match=r"pool-take, visible case 'take 1 of 5': .*not data.*plain data"):
        make_copy(tmp_path / "student", root=tiny_with_checks)
    sys.modules.pop("key_pool", None)   # a mistake's name is written into the copy: it may not hold the solution
    key.write_text(KEY_OF_POOL.replace("'took from the front'", "'taken = self.free[-n:]; del self.free[-n:]'"))
    with pytest.raises(ExerciseError, match=r"(?s)would leak.*tests/exercises/visible_answers.json:\d+: exercise pool-take"):
        make_copy(tmp_path / "student", root=tiny_with_checks)


def test_grading_refuses_a_tree_without_a_good_manifest_or_with_edited_markers(tiny_project, tmp_path):
    with pytest.raises(ExerciseError, match="exercises.json is missing, so this tree is not a student copy"):
        manifests.assigned_exercises(tiny_project)
    copy = tmp_path / "student"
    make_copy(copy, root=tiny_project)
    pool = copy / "minillm" / "pool.py"
    pool.write_text(pool.read_text().replace("(lesson 07, 1 pts): give", "(lesson 07, 9 pts): give"))
    with pytest.raises(ExerciseError, match=r"(?s)disagree.*pool-give: the manifest says .*1.*, the marker .*9"):
        manifests.assigned_exercises(copy)
    pool.write_text(re.sub(r".*# (>>>|<<<) exercise.*\n", "", pool.read_text()))
    with pytest.raises(ExerciseError, match="(?s)disagree.*pool-take .* has no region in the source"):
        manifests.assigned_exercises(copy)
    for broken in ("{not json", json.dumps({"exercises": []}), json.dumps([1, 2])):
        (copy / manifests.MANIFEST).write_text(broken)
        with pytest.raises(ExerciseError, match="exercises.json is not .*make the copy again"):
            manifests.assigned_exercises(copy)


def test_tokens_ignore_names_spacing_and_math_notation():
    assert leaks.code_tokens("rows[i // w] - w * 2") == leaks.code_tokens("r[j//k]−k·2") == \
        ["n", "[", "n", "//", "n", "]", "-", "n", "*", "2"]
    assert leaks.code_tokens("x.values[0] <= y") == leaks.code_tokens("z.values[0] ≤ q") == \
        ["n", ".", "values", "[", "0", "]", "<=", "n"]
    assert leaks.code_tokens("for s in xs if s is not None") == ["for", "n", "in", "n", "if", "n", "is", "not", "None"]
    assert leaks.code_tokens('f"slot {p // bs}"') == ["n", "n", "n", "//", "n"]


def leaky(text: str) -> str:
    """A solution written here with placeholders (DIV for //, MOD for %, DOTS for ...), so that this file, which
    student copies hold too, never spells one out."""
    return text.replace("DIV", "//").replace("MOD", "%").replace("DOTS", "...")

SLOT_HINT = "# hint: which entry of the block table holds position p"

OLD_SLOT_HINT = "# hint: block_table[p DIV block_size] * block_size + p MOD block_size"   # a hint that once gave it away


@reference_only
def test_no_hint_docstring_message_lesson_or_readme_leaks_a_solution():
    assert leaks.find_leaks(ROOT, find_exercises(ROOT), copies.tracked_files(ROOT)) == []


@reference_only
@pytest.mark.parametrize("where, change", [
    ("minillm/paged_attention.py", lambda t: t.replace(SLOT_HINT, leaky(OLD_SLOT_HINT))),     # the hint
    ("minillm/paged_attention.py", lambda t: t.replace(     # the function's docstring
        "    A token's block is found", leaky("    Its slot is table[p DIV size] · size + p MOD size.\n    A token's block is found"))),
    ("tests/exercises/test_ex_paged_attention.py", lambda t: t + leaky('\nMESSAGE = f"slot = t[p DIV {bs}] * {bs} + p MOD {bs}"\n')),
    ("lessons/07_fragmentation.py", lambda t: t + leaky("\nslots = [table[p DIV bs] * bs + p MOD bs for p in range(n)]\n")),
    ("minillm/sampling.py", lambda t: t.replace(      # the old top-k hint
        "# hint: each row has its own threshold", leaky("# hint: torch.topk(logits, k).values[DOTS, -1:] is the threshold"))),
])
def test_the_leak_check_finds_a_solution_in_a_hint_docstring_message_or_lesson(tmp_path, where, change):
    files = copies.tracked_files(ROOT)
    for rel in files:
        if rel.endswith((".py", ".md")):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp_path / rel)
    original = (tmp_path / where).read_text()
    (tmp_path / where).write_text(change(original))
    assert (tmp_path / where).read_text() != original, "the test's edit did not apply: update it"
    found = leaks.find_leaks(tmp_path, find_exercises(tmp_path), files)
    assert found and all(leak.startswith(where + ":") for leak in found), found


@reference_only
def test_a_copy_holds_the_visible_answers_as_data_and_no_key(tmp_path):
    copy = only_sampling_top_k_stubbed(tmp_path)
    held = {p.relative_to(copy).as_posix() for p in copy.rglob("*.py")}
    assert not [f for f in held if "/key_" in f or "/wrong_" in f] and "tests/test_exercise_catalogue.py" not in held
    written = answers.read_answers(copy)
    checks = judging.load_checks(ROOT)
    keyed = find_exercises(ROOT)
    assert all(answers.has_answer_key(checks[ex.id]) for ex in keyed), "every check is judged by expect and judge"
    tests = sorted(f for f in held if f.startswith("tests/"))
    assert {"sampling-top-k", "sampling-top-p"} <= {ex.id for ex in keyed}
    assert leaks.find_leaks(copy, keyed, tests) == [], "no test of a copy holds 8 tokens of a keyed solution"
    assert not [f for f in tests if re.search(r"def (nucleus|k_largest|top_[kp]_key)\b", (copy / f).read_text())]
    for ex_id, check in checks.items():   # every exercise judged by a key, stubbed or not: none is in the copy
        assert sorted(written[ex_id]) == sorted(check.visible())
        for case, inputs in check.visible().items():
            assert json.dumps(wire.to_wire(written[ex_id][case])) == json.dumps(wire.to_wire(check.expect(inputs)))
    assert {"sampling-top-k", "sampling-top-p"} <= set(written)
    grading_copy = tmp_path / "grading"
    make_copy(grading_copy, only="sampling-top-k", keys=True)
    assert (grading_copy / "tests/exercises/key_sampling.py").is_file()
    assert not list((grading_copy / "tests/exercises").glob("wrong_*.py"))


@reference_only
def test_a_copys_tests_judge_against_its_literal_answers(tmp_path):
    copy = only_sampling_top_k_stubbed(tmp_path)
    written = pytest_in(copy, "tests/exercises")   # every other exercise is written, and no key is here
    assert written.returncode == 1 and "FAILED" not in written.stdout and "ERROR" not in written.stdout, \
        written.stdout[-3000:]
    assert written.stdout.count("PASSED tests/exercises/test_ex_sampling.py::test_top_p") == 7, written.stdout[-3000:]
    assert "1 exercise still to write" in written.stdout and "sampling-top-k" in written.stdout
    stubbed = pytest_in(copy, "tests/exercises/test_ex_sampling.py", "--exercise", "sampling-top-k,sampling-top-p")
    failed, passed = (re.findall(rf"{verdict} \S+::(test_top_\w)", stubbed.stdout) for verdict in ("FAILED", "PASSED"))
    assert (failed, passed) == (["test_top_k"] * 4, ["test_top_p"] * 7), stubbed.stdout[-3000:]


@reference_only
def test_check_in_a_copy_runs_the_visible_cases_and_leaves_the_held_out_to_grading(tmp_path):
    copy = only_sampling_top_k_stubbed(tmp_path)
    written = run_tool(copy, "check", "sampling-top-p")
    assert written.returncode == 0, written.stdout + written.stderr
    assert "visible cases: 7/7 pass" in written.stdout and "held-out checks run at grading" in written.stdout
    assert "drawn with seed" not in written.stdout and "edge:" not in written.stdout and "#1" not in written.stdout
    stubbed = run_tool(copy, "check", "sampling-top-k")
    assert stubbed.returncode == 1 and "visible cases: 0/4 pass" in stubbed.stdout, stubbed.stdout
    refused = run_tool(copy, "grade")
    assert refused.returncode == 2 and "is a student copy" in refused.stderr, refused.stderr
    instructor = run_tool(ROOT, "check", "sampling-top-p")   # the instructor's tree: visible, then a fresh draw
    assert instructor.returncode == 0 and "held-out checks, drawn with seed" in instructor.stdout, instructor.stdout
    assert "edge: a per-row tensor p" in instructor.stdout


def test_make_refuses_a_check_that_works_its_answers_out_in_verify():
    """A check with a `verify` of its own and no `expect` would need its oracle in the copy: make names it."""
    checks = judging.load_checks(ROOT)
    Base = type(checks["sampling-top-k"]).__mro__[1]    # exercise_checks.Check, as the grader loaded it

    class OwnVerify(Base):
        exercise = "own-verify"

        def visible(self):
            return {"one": {"x": 1}}

        def verify(self, inputs, output):
            assert output == inputs["x"]

    with pytest.raises(ExerciseError, match="exercise own-verify: OwnVerify needs `expect`"):
        answers.answers_of({"own-verify": OwnVerify()})
    assert answers.answers_of({"sampling-top-k": checks["sampling-top-k"]})["exercises"]["sampling-top-k"]
