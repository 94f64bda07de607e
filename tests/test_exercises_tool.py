"""The classroom tool (minillm/classroom/) and the guarantees a student copy and its grade rest on.

Cheap checks first, in this process: the marker parser, `make` on a synthetic
git project, the leak check, the data encoding between a child and the grader,
the judging of what a child sent, the results format, the CLI's errors. Then the
guarantees on the real project, each with one grader run in a subprocess:

  1. a copy with every exercise stubbed scores 0, every case failing on its own
     stub; pytest there reports one line per exercise;
  2. Gradescope's run_autograder, as the README gives it, on a submission with
     half of the regions put back and cheats in the rest: exactly the restored
     exercises' points, and no cheat scores or costs another exercise a point;
  3. a fully solved copy scores full marks.

Slow (-m slow): each region put back alone, and the whole suite in a stubbed copy.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from minillm.classroom import (answers, callers, cli, copies, grading, judge as judging, leaks, manifest as manifests,
                               regions, results as report, runner, splice, wire)
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import ExerciseError, find_exercises, parse_regions, replace_region

ROOT = regions.ROOT
IN_STUDENT_COPY = (ROOT / manifests.MANIFEST).exists()
reference_only = pytest.mark.skipif(IN_STUDENT_COPY, reason="a student copy: the tool's guarantees are checked "
                                                            "in the reference project")

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


def parse(text: str) -> list[regions.Exercise]:
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
    assert {ex.id: ex.lesson for ex in find_exercises(ROOT)}["scheduler-budget-fill"] == "07"


# ------------------------------------------------------------------ make, on a synthetic git project

TWO_REGIONS = REGION + '''
    def give(self, blocks):
        # >>> exercise pool-give (lesson 05, 1 pts): give blocks back
        # hint: the free list grows at its end
        for block in blocks:
            self.free.append(block)
        # <<< exercise
'''


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def tiny_project(tmp_path):
    """A git project: tracked files, and beside them the strays that once carried solutions into copies."""
    root = tmp_path / "ref"
    tracked = {"minillm/__init__.py": "", "minillm/pool.py": TWO_REGIONS, "tests/test_pool.py": "x = 1\n",
               "lessons/01_x.py": "print(1)\n", "README.md": "# hi\n", "pyproject.toml": "[project]\n"}
    strays = {"venv/lib/minillm/pool.py": TWO_REGIONS, "minillm/pool.py~": TWO_REGIONS, "htmlcov/pool.html": TWO_REGIONS,
              "lessons/results/run.json": "{}", "weights/gpt2/model.safetensors": "w", ".venv/bin/python": "p",
              "minillm/__pycache__/pool.pyc": "c", "notes/scratch.py": "y = 2\n"}
    for rel, text in {**tracked, **strays}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", *tracked)
    return root


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


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


CHECK_OF_POOL = '''\
from pathlib import Path
import importlib.util
from exercise_checks import Check


class Take(Check):
    exercise = "pool-take"
    where = "minillm/pool.py, Pool.take"

    def visible(self):
        return {f"take {n} of 5": {"free": [1, 2, 3, 4, 5], "n": n} for n in (1, 2, 3)}

    def situations(self):
        return {"take some": lambda d: {"free": list(range(d.int(3, 9))), "n": d.int(1, 3)}}

    def run(self, inputs):
        path = Path(__file__).resolve().parents[2] / "minillm" / "pool.py"
        spec = importlib.util.spec_from_file_location("tiny_pool", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pool = module.Pool()
        pool.free = list(inputs["free"])
        return {"taken": pool.take(inputs["n"]), "left": pool.free}

    def expect(self, inputs):
        from key_pool import take
        return take(inputs["free"], inputs["n"])

    def judge(self, inputs, output, expected):
        assert output == expected["want"], f"expected {expected['want']}, got {output}"


TAKE = Take()
test_take = TAKE.pytest_test()
'''
KEY_OF_POOL = ("def take(free, n):\n    return {'want': {'taken': free[len(free) - n:], 'left': free[:len(free) - n]},\n"
               "            'mistakes': {'took from the front': free[:n]}}\n")


@pytest.fixture
def tiny_with_checks(tiny_project, monkeypatch):
    """The tiny project with a check of pool-take judged by expect and judge, its key in key_pool.py."""
    folder = tiny_project / "tests" / "exercises"
    folder.mkdir()
    shutil.copy(ROOT / judging.EXERCISE_TESTS / "exercise_checks.py", folder)
    (folder / "test_ex_pool.py").write_text(CHECK_OF_POOL)
    (folder / "key_pool.py").write_text(KEY_OF_POOL)
    (folder / "wrong_pool.py").write_text("WRONG = {}\n")
    git(tiny_project, "add", "tests/exercises")
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tiny_project
    for name in ("exercise_checks", "test_ex_pool", "key_pool"):   # the real checks' modules of these names return
        sys.modules.pop(name, None)


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


# ------------------------------------------------------------------ the manifest

def test_grading_refuses_a_tree_without_a_good_manifest_or_with_edited_markers(tiny_project, tmp_path):
    with pytest.raises(ExerciseError, match="exercises.json is missing, so this tree is not a student copy"):
        manifests.assigned_exercises(tiny_project)
    copy = tmp_path / "student"
    make_copy(copy, root=tiny_project)
    pool = copy / "minillm" / "pool.py"
    pool.write_text(pool.read_text().replace("(lesson 05, 1 pts): give", "(lesson 05, 9 pts): give"))
    with pytest.raises(ExerciseError, match=r"(?s)disagree.*pool-give: the manifest says .*1.*, the marker .*9"):
        manifests.assigned_exercises(copy)
    pool.write_text(re.sub(r".*# (>>>|<<<) exercise.*\n", "", pool.read_text()))
    with pytest.raises(ExerciseError, match="(?s)disagree.*pool-take .* has no region in the source"):
        manifests.assigned_exercises(copy)
    for broken in ("{not json", json.dumps({"exercises": []}), json.dumps([1, 2])):
        (copy / manifests.MANIFEST).write_text(broken)
        with pytest.raises(ExerciseError, match="exercises.json is not .*make the copy again"):
            manifests.assigned_exercises(copy)


# ------------------------------------------------------------------ the leak check

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
OLD_SLOT_HINT = "# hint: block_table[p DIV block_size] * block_size + p MOD block_size"   # the hint before issue 10


@reference_only
def test_no_hint_docstring_message_lesson_or_readme_leaks_a_solution():
    assert leaks.find_leaks(ROOT, find_exercises(ROOT), copies.tracked_files(ROOT)) == []


@reference_only
@pytest.mark.parametrize("where, change", [
    ("minillm/paged_attention.py", lambda t: t.replace(SLOT_HINT, leaky(OLD_SLOT_HINT))),     # the hint
    ("minillm/paged_attention.py", lambda t: t.replace(     # the function's docstring
        "    A token's block is found", leaky("    Its slot is table[p DIV size] · size + p MOD size.\n    A token's block is found"))),
    ("tests/exercises/test_ex_paged_attention.py", lambda t: t + leaky('\nMESSAGE = f"slot = t[p DIV {bs}] * {bs} + p MOD {bs}"\n')),
    ("lessons/05_fragmentation.py", lambda t: t + leaky("\nslots = [table[p DIV bs] * bs + p MOD bs for p in range(n)]\n")),
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


# ------------------------------------------------------------------ data between a child and the grader

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


# ------------------------------------------------------------------ judging what a child sent

class OneCheck:
    """verify: the output must equal the input's "want"."""

    def verify(self, inputs, output):
        assert output == inputs["want"], f"expected {inputs['want']}, got {output}"


def judged(messages, ended="", stray=0):
    (ex,) = parse(REGION)
    cases = [judging.Case(f"c{i}", {"want": i}, held_out=i >= 2) for i in range(6)]
    return judging.judge(ex, OneCheck(), cases, runner.ChildRun(messages, stray, ended, "printed this"))


def test_the_grader_judges_each_case_once_and_says_what_happened():
    stub = {"type": "NotImplementedError", "message": "exercise pool-take (lesson 05): ...", "where": "minillm/pool.py:6"}
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


# ------------------------------------------------------------------ the CLI's errors

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


# ------------------------------------------------------------------ the real project

def run_tool(tree: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The one command, in its documented form, `python -m minillm.classroom`, run in `tree`."""
    return subprocess.run([sys.executable, "-m", "minillm.classroom", *args], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
                          capture_output=True, text=True, timeout=900)


def restore(copy: Path, ex: regions.Exercise, body: list[str] | None = None) -> None:
    """Put a region's reference code back in a copy (or `body`, lines at the region's indentation)."""
    path = copy / ex.file
    lines = list(ex.body) if body is None else [ex.indent + line for line in body]
    path.write_text(replace_region(path.read_text(encoding="utf-8"), ex.file, ex.id, lines), encoding="utf-8")


def results_by_exercise(path: Path) -> dict[str, dict]:
    results = json.loads(path.read_text())
    assert report.results_problems(results) == [], report.results_problems(results)
    out: dict[str, dict] = {}
    for t in results["tests"]:
        ex_id, part = t["name"].split(" ")[0], t["name"].rsplit(": ", 1)[1]
        out.setdefault(ex_id, {})[part] = t
    return out


@pytest.fixture(scope="module")
def reference():
    return find_exercises(ROOT)


@pytest.fixture(scope="module")
def stubbed_copy(tmp_path_factory, reference):
    copy = tmp_path_factory.mktemp("student") / "all_stubbed"   # with the keys: grade runs in it
    assert [ex.id for ex in make_copy(copy, keys=True)] == [ex.id for ex in reference]
    return copy


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


# ------------------------------------------------------------------ a student copy: answers as data, no key

def only_sampling_top_k_stubbed(tmp_path: Path) -> Path:
    copy = tmp_path / "student"
    assert [ex.id for ex in make_copy(copy, only="sampling-top-k")] == ["sampling-top-k"]
    return copy


def pytest_in(copy: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args], cwd=copy,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"})


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


@reference_only
def test_tampering_with_a_copys_answers_changes_no_grade(tmp_path):
    copy = only_sampling_top_k_stubbed(tmp_path)
    (ex,) = [e for e in find_exercises(copy) if e.id == "sampling-top-k"]
    restore(copy, ex, ["return logits"])                   # keeps every token...
    path = copy / answers.ANSWERS
    data = json.loads(path.read_text())
    for case, inputs in judging.load_checks(ROOT)["sampling-top-k"].visible().items():
        rows, vocab = inputs["logits"].shape                # ...and the copy's answers now say that is right
        data["exercises"]["sampling-top-k"][case] = wire.to_wire({"keep": [list(range(vocab))] * rows})
    path.write_text(json.dumps(data))
    fooled = pytest_in(copy, "tests/exercises/test_ex_sampling.py")
    assert fooled.returncode == 0 and fooled.stdout.count("PASSED") == 11, fooled.stdout[-3000:]
    proc = run_tool(ROOT, "grade", str(copy), "--only", "sampling-top-k", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")["sampling-top-k"]
    assert results["held-out checks"]["score"] == 0 and results["visible cases"]["status"] == "failed", results


FORGERY = """
# --- a forgery outside every region: if any process imported the package from here, it would forge the verdicts
import atexit as _atexit, json as _json, os as _os

def _forge(*_):
    try:
        with open({path!r}, "w") as f:
            _json.dump({{"score": 30.0, "output": "forged", "tests": []}}, f)
    except Exception:
        pass

_forge()
_atexit.register(_forge)
"""


def region_lines(ex: regions.Exercise, *lines: str) -> list[str]:
    return [ex.indent + line for line in lines]


def cheat(student: Path, reference: list[regions.Exercise], source: Path, results_path: Path) -> dict[str, str]:
    """Every attack of issue 20 against its own exercise of the student's copy; returns {exercise: the attack}.
    The copy's other exercises are left for the caller to restore honestly."""
    by_id = {ex.id: ex for ex in find_exercises(student)}
    ref = {ex.id: ex for ex in reference}

    def put(ex_id: str, lines: list[str]) -> None:
        ex = by_id[ex_id]
        path = student / ex.file
        path.write_text(replace_region(path.read_text(), ex.file, ex_id, lines))

    init = student / "minillm" / "__init__.py"           # the -m form run as root, and module-level rebinding
    init.write_text(init.read_text() + FORGERY.format(path=str(results_path)))
    reference_prefix_match = (ROOT / "minillm" / "prefix_caching.py").read_text()
    block = reference_prefix_match[reference_prefix_match.index("def prefix_match("):]
    block = block[:block.index("\n\n\n")] if "\n\n\n" in block else block
    block = "\n".join(line for line in block.splitlines() if "# >>>" not in line and "# <<<" not in line
                      and "# hint:" not in line)
    caching = student / "minillm" / "prefix_caching.py"
    caching.write_text(caching.read_text() + "\n\n# rebinding the stub, outside its region\n" + block + "\n")
    tests = student / "tests" / "exercises" / "test_ex_sampling.py"   # the student's own judging, changed
    tests.write_text(tests.read_text() + "\nTopK.verify = lambda self, inputs, output: None\n")
    put("sampling-top-p", region_lines(by_id["sampling-top-p"], "from transformers import TopPLogitsWarper",
                                       "return TopPLogitsWarper(p)(None, logits)"))
    put("kv-cache-write", region_lines(by_id["kv-cache-write"], 'raise ValueError("\\\\udcff")'))
    forged = '{"case": %d, "output": {"tensor": {"dtype": "int8", "shape": [1], "data": [100000]}}}\n'
    put("kv-cache-read", region_lines(by_id["kv-cache-read"], "import os",
                                      "for fd in range(3, 64):",
                                      "    try:",
                                      f"        os.write(fd, b''.join({forged!r}.encode() % i for i in range(100)))",
                                      "    except OSError:",
                                      "        pass",
                                      "os._exit(0)"))
    put("paged-allocate", region_lines(by_id["paged-allocate"], "import importlib, sys",
                                       f"sys.path.insert(0, {str(source / 'tests' / 'exercises')!r})",
                                       "oracle = importlib.import_module('test_' + 'ex_block_manager')",
                                       "return oracle.ALLOCATE.verify"))
    put("paged-free", region_lines(by_id["paged-free"], "import gc, sys",
                                   "checks = [o for o in gc.get_objects() if hasattr(type(o), 'verify')]",
                                   "frames, f = [], sys._getframe()",
                                   "while f is not None:",
                                   "    frames += [v for v in f.f_locals.values() if hasattr(type(v), 'verify')]",
                                   "    f = f.f_back",
                                   "(checks + frames)[0].verify({}, None)"))
    table = visible_and_seeded_slots(1234)
    put("paged-slot-mapping", region_lines(by_id["paged-slot-mapping"],
                                           f"return {table!r}[(tuple(block_table), start, num_tokens, block_size)]"))
    put("paged-gather", region_lines(by_id["paged-gather"], "import os", "os.kill(os.getpid(), 40)"))
    put("scheduler-preempt", region_lines(by_id["scheduler-preempt"], "print('LEAKED-FROM-A-RUN', seq.request_id, num_tokens)",
                                          "raise RuntimeError('no room')"))
    put("speculative-accept", region_lines(by_id["speculative-accept"], "import importlib.util, sys",
                                           f"sys.path.insert(0, {str(source / 'tests')!r})",
                                           f"spec = importlib.util.spec_from_file_location('t', {str(source / 'tests' / 'test_speculative.py')!r})",
                                           "t = importlib.util.module_from_spec(spec)",
                                           "spec.loader.exec_module(t)",
                                           "return t.resample_from_p(draft_token_ids, draft_probs, target_probs, generator)"))
    honest = by_id["scheduler-budget-fill"]
    put("scheduler-budget-fill", region_lines(honest, "import statistics  # a lazy import of the standard library",
                                              "assert statistics.mean([1, 3]) == 2") + list(ref[honest.id].body))
    put("model-causal-attention", list(ref["model-causal-attention"].body))
    return {"model-heads": "a stub, and a forged results file from the package's __init__ (the -m form, as root)",
            "sampling-top-k": "a stub, and the student's own tests/exercises changed to pass anything",
            "prefix-match": "a stub, and the function rebound to a working one outside the region",
            "sampling-top-p": "transformers' TopPLogitsWarper", "kv-cache-write": "an exception whose message is a lone surrogate",
            "kv-cache-read": "forged channel lines holding out-of-range tensors, then os._exit",
            "paged-allocate": "importing the instructor's checks, oracles included",
            "paged-free": "looking for a Check's verify in its own process",
            "paged-slot-mapping": "a table of answers for seed 1234", "paged-gather": "os.kill with signal 40",
            "scheduler-preempt": "printing during held-out runs, hidden until the due date",
            "speculative-accept": "the acceptance rule spliced from tests/test_speculative.py"}


HONEST = {"model-causal-attention", "scheduler-budget-fill"}


def visible_and_seeded_slots(seed: int) -> dict:
    """slot_mapping's answers on the visible cases and seed `seed`'s held-out inputs: a table built offline."""
    from minillm.paged_attention import slot_mapping
    check = judging.load_checks(ROOT)["paged-slot-mapping"]
    cases = {**check.visible(), **check.held_out(seed)}
    return {(tuple(c["table"]), c["start"], c["num_tokens"], c["block_size"]):
            slot_mapping(list(c["table"]), c["start"], c["num_tokens"], c["block_size"]) for c in cases.values()}


def world_readable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXGRP | stat.S_IXOTH if p.is_dir() else 0))


def run_autograder_script() -> str:
    """The run_autograder that the README's instructor section gives, as it would be saved."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## For instructors"):], re.S).group(1)
    return "\n".join(line.removeprefix("  ") for line in block.splitlines()) + "\n"


def run_script(script: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"   # python3: this environment's
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PATH": path, "MINILLM_GRADE_TIMEOUT": "60", "PYTHONDONTWRITEBYTECODE": "1"})


def nobody_cannot_run_python() -> list[str]:
    """What `nobody` could not read of this interpreter and its packages (a clone in a mode-700 folder)."""
    import sysconfig
    return runner.unreadable_for("nobody", [os.path.realpath(sys.executable), sysconfig.get_paths()["stdlib"],
                                            *[p for p in sys.path if p and os.path.isabs(p)]])


@reference_only
def test_run_autograder_grades_only_the_regions_and_no_attack_scores(reference):
    """The README's run_autograder, end to end, as root with --user nobody where it can: the instructor's copy as
    the source, a student's tree as the submission. Every attack scores 0 on its own exercise and costs no other
    exercise a point; the honest ones, one with a lazy import of the standard library, score in full."""
    script = run_autograder_script()
    assert "cd /autograder/source" in script and "python3 -m minillm.classroom grade /autograder/submission" in script
    assert "--user nobody --json /autograder/results/results.json" in script and "chmod -R go-rwx tests/exercises" in script
    base = Path(tempfile.mkdtemp(prefix="autograder-"))   # under /tmp, so that `nobody` can read it
    try:
        autograder = base / "autograder"
        make_copy(autograder / "source", keys=True)       # what the instructor uploads: make --for-grading
        student = base / "student"
        make_copy(student)                                # the student's copy, honest in part, attacking in part
        results_path = autograder / "results" / "results.json"
        attacks = cheat(student, reference, autograder / "source", results_path)
        assert set(attacks) | HONEST == {ex.id for ex in reference}
        shutil.copytree(student, autograder / "submission")
        (autograder / "results").mkdir()
        world_readable(base)
        script = script.replace("/autograder", str(autograder))
        script = script.replace("grade ", "grade --held-out-visibility after_due_date ", 1)
        as_nobody = os.geteuid() == 0                     # only root can hand the children to `nobody`
        if as_nobody and nobody_cannot_run_python():      # Python under a folder nobody cannot read: a clear refusal
            proc = run_script(script)
            assert proc.returncode == 2 and "--user nobody cannot read what the student's code needs" in proc.stderr
            assert "--user nobody cannot read" in json.loads(results_path.read_text())["output"]
            as_nobody = False                             # ...and the attacks are still graded, without --user
        if not as_nobody:
            script = script.replace("--user nobody ", "")
        proc = run_script(script)
        raw = results_path.read_bytes()
        assert all(b < 128 for b in raw), "the results file must be ASCII"
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results = results_by_exercise(results_path)
        for ex in reference:
            held = results[ex.id]["held-out checks"]
            want = ex.points if ex.id in HONEST else 0
            assert held["score"] == want, (f"{ex.id} ({attacks.get(ex.id, 'honest')}) scored {held['score']} of "
                                           f"{ex.points}, expected {want}:\n{held['output']}")
        outputs = {ex_id: results[ex_id]["held-out checks"]["output"] for ex_id in attacks}
        assert "transformers" in outputs["sampling-top-p"] and "off limits" in outputs["sampling-top-p"]
        assert "killed by signal 40" in outputs["paged-gather"]
        assert "cannot read" in outputs["kv-cache-read"]           # the forged tensors were judged, alone
        assert "not written yet" in outputs["prefix-match"] and "not written yet" in outputs["model-heads"]
        visible = json.dumps([t for t in json.loads(raw)["tests"] if t["visibility"] == "visible"])
        assert "LEAKED" not in visible and "LEAKED" not in json.loads(raw)["output"]
        assert "LEAKED-FROM-A-RUN" in outputs["scheduler-preempt"]   # the instructor still sees it, after the due date
        assert json.loads(raw)["score"] == sum(ex.points for ex in reference if ex.id in HONEST)
    finally:
        shutil.rmtree(base, ignore_errors=True)


LINGERER = """\
import os as _os, time as _time
if _os.fork() == 0:                 # outlive the child, and forge the results once they are written
    for _ in range(300):
        _time.sleep(0.1)
        if _os.path.exists({path!r}):
            _time.sleep(0.5)
            with open({path!r}, "w") as f:
                f.write('{{"score": 25.0, "output": "forged", "tests": []}}')
            break
    _os._exit(0)
"""


@reference_only
def test_what_the_graded_code_leaves_running_is_killed_with_its_child(tmp_path, reference):
    copy = tmp_path / "lingering"
    make_copy(copy, only="sampling-top-k", keys=True)
    (ex,) = [e for e in find_exercises(copy) if e.id == "sampling-top-k"]
    results = tmp_path / "results.json"
    body = region_lines(ex, *LINGERER.format(path=str(results)).splitlines())
    restore(copy, ex, [line[len(ex.indent):] for line in body] + [line[len(ex.indent):] for line in
                                                                    next(r for r in reference if r.id == ex.id).body])
    proc = run_tool(copy, "grade", "--json", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import time
    time.sleep(2)
    assert json.loads(results.read_text())["score"] == 1.0, results.read_text()


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


# ------------------------------------------------------------------ slow: each region alone, the whole suite

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


# ------------------------------------------------------------------ splicing, off-limits calls, a child's worst

SUBMITTED = TWO_REGIONS.replace("        taken = self.free[-n:]\n        del self.free[-n:]\n        return taken\n",
                                "        return [self.free.pop() for _ in range(n)]\n")


def test_only_the_regions_of_a_submission_are_taken():
    mine = parse(TWO_REGIONS)
    bodies = splice.regions_of_submission("import os\nos.system('x')\n" + SUBMITTED + "EVIL = 1\n", "minillm/pool.py", mine)
    assert bodies == {"pool-take": ["        return [self.free.pop() for _ in range(n)]"],
                      "pool-give": list(mine[1].body)}


@pytest.mark.parametrize("submitted, message", [
    (SUBMITTED.replace("        # >>> exercise pool-give (lesson 05, 1 pts): give blocks back\n", ""),
     r"minillm/pool.py: the marker of exercise pool-give .* appears 0 times"),
    (SUBMITTED + "        # >>> exercise pool-take (lesson 05, 2 pts): again\n",
     r"minillm/pool.py: the marker of exercise pool-take .* appears 2 times"),
    (SUBMITTED.replace("pool-take", "POOL").replace("pool-give", "pool-take").replace("POOL", "pool-give"),
     r"minillm/pool.py: the exercise markers are out of order \(pool-give, pool-take\)"),
    (SUBMITTED.replace("        return [self.free.pop() for _ in range(n)]\n        # <<< exercise\n", "        x = 1\n", 1),
     r"minillm/pool.py:4: exercise pool-take has no end marker"),
    (SUBMITTED.replace("        return [self", '        x = """\n        return [self').replace(
        "            self.free.append(block)\n", '            self.free.append(block)\n        """\n'),
     r"minillm/pool.py:\d+: the code of exercise pool-take is not valid Python on its own"),
])
def test_a_submission_with_broken_markers_is_refused_naming_file_and_marker(submitted, message):
    with pytest.raises(ExerciseError, match=message):
        splice.regions_of_submission(submitted, "minillm/pool.py", parse(TWO_REGIONS))


def test_off_limits_names_are_found_in_the_code_not_in_its_comments():
    (ex,) = parse(REGION.replace("# hint: pop from the end", "# hint: pop from the end. Off limits: heapq, sorted."))
    assert ex.off_limits == ("heapq", "sorted")
    assert judging.forbidden_calls(ex, ["# sorted and heapq are banned", "x = 'heapq'", "return 1"]) == []
    assert judging.forbidden_calls(ex, ["import heapq", "return sorted(self.free)"]) == ["heapq", "sorted"]
    assert judging.forbidden_calls(ex, ["from transformers import TopKLogitsWarper", "return 1"]) == ["transformers"]
    assert judging.forbidden_calls(ex, ["import test_ex_pool", "return 1"]) == ["test_ex_pool"]


def test_no_region_may_import_the_answer_keys_or_the_catalogue():
    (ex,) = parse(REGION)
    assert judging.forbidden_calls(ex, ["import key_sampling", "from wrong_sampling import WRONG", "return 1"]) == \
        ["key_sampling", "wrong_sampling"]
    assert judging.forbidden_calls(ex, ["import importlib", "return importlib.import_module('key_model').f"]) == \
        ["key_model"]
    assert judging.forbidden_calls(ex, ["key_states = self.free", "wrong_way = 1", "return key_states"]) == [], \
        "a name of one's own that starts like a key module is no offence"


def test_what_a_child_sends_costs_its_own_cases_only():
    forged = {"tensor": {"dtype": "int8", "shape": [1], "data": [100000]}}   # torch raises on decoding it
    score = judged([{"case": i, "output": forged if i == 3 else i} for i in range(6)])
    assert [r.passed for r in score.results] == [True, True, True, False, True, True]
    assert "cannot read" in score.results[3].message

    class Exploding:
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
def test_list_fits_100_columns(capsys):
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 14 and max(len(line) for line in lines) <= cli.WIDTH, max(lines, key=len)


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
