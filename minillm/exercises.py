"""Classroom exercises cut from the reference engine, checked by pytest, graded in one command.

The reference engine is the solution. Pieces of it are marked as exercise
regions, in place, in the concept modules:

    # >>> exercise kv-cache-write (lesson 02, 2 pts): store the new keys and values in their slots
    # hint: sequence s.rows[i] writes its T tokens at slots ...
    <reference code, at the marker's indentation or deeper>
    # <<< exercise

A student copy is the project with each chosen region's code replaced by one
line at the marker's indentation, markers and hint kept:

    raise NotImplementedError('exercise kv-cache-write (lesson 02): store ... Hint: ...')

so the copy still imports, and everything that does not reach a stub still runs.

    python -m minillm.exercises list                        # id, file, lesson, points, title, stub/written
    python -m minillm.exercises make DIR [--only IDS] [--force]
    python -m minillm.exercises check ID [-v]               # one exercise's tests, with a friendly summary
    python -m minillm.exercises grade [--json PATH]         # every exercise; Gradescope's results.json

Tests. Each exercise's tests live in tests/exercises/ and carry
`@pytest.mark.exercise("<id>")`; `pytest --exercise ID` selects them. They call
the function that holds the region directly, with crafted inputs, so they pass
as soon as that one region is right, whatever else is still a stub. A test that
reaches *another* exercise's stub is reported as skipped ("needs exercise <id>,
still a stub") by tests/conftest.py: a student copy's suite is green except the
stubbed exercises' own tests.

Grading. An exercise worth P points whose N tests pass n scores P·n/N, rounded
to 0.01: partial credit for a region that handles some of its cases. A test
that fails, errors, is skipped or never ran counts as not passed. The suite
(tests/test_exercises_tool.py) holds the invariants: the reference scores full
marks; in a copy with k exercises stubbed, exactly the other exercises' points
are scored; putting a region's code back makes its tests pass; no stub contains
its solution.

This file imports nothing from minillm, so `python minillm/exercises.py grade`
still runs when a submission has broken the package's imports.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the project this file lives in: the reference or a student copy
PACKAGE = "minillm"
EXERCISE_TESTS = "tests/exercises"
MANIFEST = "exercises.json"                  # written into each copy: the instructor's list, used by `grade`
# A copy leaves out version control, environments, caches, weights and measured results.
SKIP_NAMES = {".git", "weights", "__pycache__", ".pytest_cache", "build", "dist", MANIFEST}
SKIP_PATHS = {"lessons/results"}

BEGIN, END = "# >>> exercise", "# <<< exercise"
HEADER = re.compile(r"(?P<indent>[ \t]*)# >>> exercise (?P<id>[a-z0-9][a-z0-9-]*) "
                    r"\(lesson (?P<lesson>\d{2}), (?P<points>\d+) pts?\): (?P<title>\S.*?)\s*")
HINT = re.compile(r"(?P<indent>[ \t]*)# hint: (?P<hint>\S.*?)\s*")
HEADER_FORM = "'# >>> exercise <id> (lesson NN, N pts): <title>', id in lowercase-with-dashes"
ENCLOSING = re.compile(r"(?P<indent>[ \t]*)(?:async\s+)?(?:def|class)\s+(?P<name>\w+)")


class ExerciseError(ValueError):
    """A malformed region, an unknown id, or a target the tool will not overwrite."""


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    lesson: str                 # two digits, "02"
    points: int
    hint: str
    file: str                   # relative to the project root, "minillm/kv_cache.py"
    line: int                   # 1-based line of the `# >>> exercise` marker
    function: str               # what holds the region, "KVCache.write"
    indent: str
    body: tuple[str, ...] = field(default=(), repr=False)   # the lines between the hint and the end marker

    @property
    def message(self) -> str:
        return f"exercise {self.id} (lesson {self.lesson}): {self.title}. Hint: {self.hint}"

    def stub(self) -> list[str]:
        return [f"{self.indent}raise NotImplementedError({self.message!r})"]

    @property
    def is_stub(self) -> bool:
        return [b for b in self.body if b.strip()] == self.stub()

    def where(self) -> str:
        return f"{self.file}:{self.line}, in {self.function}"


# ---------------------------------------------------------------- parsing

def parse_regions(text: str, file: str) -> list[Exercise]:
    """Every exercise region of one source file, in order; malformed markers raise ExerciseError naming file:line."""
    lines = text.splitlines()
    found: list[Exercise] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith(END):
            raise ExerciseError(f"{file}:{i + 1}: '{END}' with no region open; "
                                f"every region starts with {HEADER_FORM}")
        if stripped.startswith(BEGIN):
            found.append(_parse_one(lines, i, file))
            i += len(found[-1].body) + 3     # header, hint, body, end
        else:
            i += 1
    return found


def _parse_one(lines: list[str], start: int, file: str) -> Exercise:
    head = HEADER.fullmatch(lines[start])
    if head is None:
        raise ExerciseError(f"{file}:{start + 1}: malformed exercise marker {lines[start].strip()!r}; "
                            f"expected {HEADER_FORM}")
    indent, ex_id = head["indent"], head["id"]
    hint = HINT.fullmatch(lines[start + 1]) if start + 1 < len(lines) else None
    if hint is None or hint["indent"] != indent:
        raise ExerciseError(f"{file}:{start + 2}: exercise {ex_id} needs a '# hint: ...' line right after "
                            f"its marker, at the marker's indentation")
    body: list[str] = []
    for j in range(start + 2, len(lines)):
        line, stripped = lines[j], lines[j].strip()
        if stripped.startswith(BEGIN):
            raise ExerciseError(f"{file}:{j + 1}: a region starts inside exercise {ex_id} "
                                f"(opened at {file}:{start + 1}); regions cannot nest: close it with '{END}' first")
        if stripped.startswith(END):
            if line != indent + END:
                raise ExerciseError(f"{file}:{j + 1}: the end marker of exercise {ex_id} must read '{END}' "
                                    f"at its opening marker's indentation ({len(indent)} spaces)")
            if not any(b.strip() for b in body):
                raise ExerciseError(f"{file}:{start + 1}: exercise {ex_id} has no code between its markers")
            return Exercise(ex_id, head["title"], head["lesson"], int(head["points"]), hint["hint"], file,
                            start + 1, _enclosing(lines, start, indent), indent, tuple(body))
        if stripped and not line.startswith(indent):
            raise ExerciseError(f"{file}:{j + 1}: code in exercise {ex_id} is indented less than its marker "
                                f"at {file}:{start + 1}, so its stub could not stand in for it")
        body.append(line)
    raise ExerciseError(f"{file}:{start + 1}: exercise {ex_id} has no end marker; "
                        f"add '{END}' after its last line of code, at the marker's indentation")


def _enclosing(lines: list[str], start: int, indent: str) -> str:
    """'Class.method', 'function' or '<module>': the definitions a region sits in."""
    names, limit = [], len(indent)
    for line in reversed(lines[:start]):
        m = ENCLOSING.match(line)
        if m and len(m["indent"]) < limit:
            names.append(m["name"])
            limit = len(m["indent"])
    return ".".join(reversed(names)) or "<module>"


def find_exercises(root: Path = ROOT) -> list[Exercise]:
    """Every region in the package under `root`; ids must be unique."""
    found: list[Exercise] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        if path.name == Path(__file__).name or "__pycache__" in path.parts:
            continue   # this file's docstring shows the marker format; it holds no region
        found += parse_regions(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix())
    seen: dict[str, Exercise] = {}
    for ex in found:
        if ex.id in seen:
            raise ExerciseError(f"{ex.file}:{ex.line}: exercise id {ex.id!r} is already used at "
                                f"{seen[ex.id].file}:{seen[ex.id].line}; ids must be unique")
        seen[ex.id] = ex
    return found


def load_exercises(root: Path = ROOT) -> list[Exercise]:
    """The exercises to grade: a copy's manifest (the instructor's list, immune to edited markers), else the source."""
    manifest = root / MANIFEST
    if not manifest.exists():
        return find_exercises(root)
    listed = [Exercise(**{k: v for k, v in e.items() if k != "stubbed"})
              for e in json.loads(manifest.read_text(encoding="utf-8"))["exercises"]]
    try:   # where each region is now: a student's code is longer than the stub
        lines = {ex.id: ex.line for ex in find_exercises(root)}
    except ExerciseError:
        lines = {}
    return [replace(ex, line=lines.get(ex.id, ex.line)) for ex in listed]


def select(exercises: list[Exercise], only: str | list[str] | None) -> list[Exercise]:
    """The exercises named in `only` (comma-separated or a list), or all of them."""
    if not only:
        return list(exercises)
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    known = {ex.id for ex in exercises}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ExerciseError(f"unknown exercise id{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the exercises are: {', '.join(ex.id for ex in exercises)}")
    return [ex for ex in exercises if ex.id in wanted]


def replace_region(text: str, file: str, ex_id: str, new_body: list[str]) -> str:
    """`text` with the code of region `ex_id` replaced by `new_body` (lines); markers and hint stay."""
    region = next((ex for ex in parse_regions(text, file) if ex.id == ex_id), None)
    if region is None:
        raise ExerciseError(f"{file} has no exercise {ex_id}")
    lines = text.splitlines()
    first = region.line + 1                   # 0-based index of the first body line
    lines[first:first + len(region.body)] = new_body
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


# ---------------------------------------------------------------- make

def make_copy(target: Path | str, only: str | list[str] | None = None, force: bool = False,
              root: Path = ROOT) -> list[Exercise]:
    """Write a student copy of the project at `root` into `target`; returns the exercises stubbed."""
    root, target = Path(root).resolve(), Path(target).resolve()
    if target == root or root.is_relative_to(target):
        raise ExerciseError(f"target {target} holds the project itself; choose a folder outside {root}")
    chosen = select(find_exercises(root), only)
    if target.exists() and not target.is_dir():
        raise ExerciseError(f"target {target} is a file; choose a folder")
    files = _project_files(root, target)
    if target.exists() and any(target.iterdir()):
        if not force:
            raise ExerciseError(f"target {target} exists and is not empty; choose an empty folder, "
                                f"or pass --force to replace the project's files in it")
        for top in {f.relative_to(root).parts[0] for f in files} | {MANIFEST}:
            old = target / top
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink(missing_ok=True)
    by_file: dict[str, list[Exercise]] = {}
    for ex in chosen:
        by_file.setdefault(ex.file, []).append(ex)
    for src in files:
        rel = src.relative_to(root).as_posix()
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel not in by_file:
            shutil.copy2(src, dst)
            continue
        text = src.read_text(encoding="utf-8")
        for ex in by_file[rel]:
            text = replace_region(text, rel, ex.id, ex.stub())
        try:
            compile(text, rel, "exec")
        except SyntaxError as e:
            raise ExerciseError(f"{rel}:{e.lineno}: stubbing {', '.join(x.id for x in by_file[rel])} leaves "
                                f"invalid Python ({e.msg}); move the region so it covers whole statements") from e
        dst.write_text(text, encoding="utf-8")
    stubbed = {ex.id for ex in chosen}
    manifest = [{**{k: v for k, v in asdict(ex).items() if k != "body"}, "stubbed": ex.id in stubbed}
                for ex in find_exercises(target)]   # the copy's line numbers: stubs are shorter than code
    (target / MANIFEST).write_text(json.dumps({"exercises": manifest}, indent=1) + "\n", encoding="utf-8")
    return chosen


def _project_files(root: Path, target: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not _skipped(here / d, root) and (here / d) != target)
        files += [here / f for f in sorted(filenames) if not _skipped(here / f, root)]
    return files


def _skipped(path: Path, root: Path) -> bool:
    name = path.name
    return (name in SKIP_NAMES or name.startswith(".venv") or name.endswith((".pyc", ".pyo", ".egg-info"))
            or path.relative_to(root).as_posix() in SKIP_PATHS)


# ---------------------------------------------------------------- running the tests

@dataclass
class ExerciseRun:
    collected: list[dict]   # one per selected test: nodeid, exercises
    results: list[dict]     # one per finished test: nodeid, exercises, outcome (passed/failed/skipped), message
    errors: list[dict]      # modules that could not be collected: nodeid, message
    output: str             # pytest's own output
    timed_out: bool

    def outcomes(self, ex_id: str) -> list[dict]:
        """Every selected test of `ex_id` with its outcome; a test that never finished counts as failed."""
        done = {r["nodeid"]: r for r in self.results}
        return [done.get(c["nodeid"], {**c, "outcome": "failed", "message": "did not finish: pytest was stopped "
                                       "by the time limit (an endless loop?)"})
                for c in self.collected if ex_id in c["exercises"]]


def run_exercise_tests(ids: list[str] | None, root: Path = ROOT, timeout: float | None = None) -> ExerciseRun:
    """Run the exercise tests (of `ids`, or all) in a pytest subprocess at `root`; per-test outcomes come back."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        cmd = [sys.executable, "-m", "pytest", EXERCISE_TESTS, "-m", "not gpu", "-q", "--tb=short",
               "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--exercise-report={report}"]
        if ids:
            cmd.append(f"--exercise={','.join(ids)}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            output, timed_out = proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            timed_out = True
        lines = [json.loads(x) for x in report.read_text(encoding="utf-8").splitlines()] if report.exists() else []
    by_kind: dict[str, list[dict]] = {"collected": [], "result": [], "error": []}
    for row in lines:
        by_kind[row.pop("kind")].append(row)
    return ExerciseRun(by_kind["collected"], by_kind["result"], by_kind["error"], output, timed_out)


def _explain(ex: Exercise, result: dict) -> str:
    """A failed test's message, shortened when all it says is that the exercise is still its stub."""
    if result["message"].startswith(f"NotImplementedError: exercise {ex.id} ("):
        return "not written yet: the stub raises NotImplementedError"
    return result["message"]


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def _why_nothing_ran(run: ExerciseRun, timeout: float | None) -> str:
    if run.timed_out and not run.collected:
        return f"pytest was stopped after {timeout:g} s, before it had collected the tests"
    if run.errors:
        return "the tests could not be collected:\n" + "\n".join(_import_error(e["message"]) for e in run.errors)
    if run.collected:
        return f"no test in {EXERCISE_TESTS}/ is marked with this exercise's id (its tests are missing)"
    return "pytest did not run:\n" + _tail(run.output, 15)


def _import_error(message: str) -> str:
    """pytest's collection error from the test module's failing line on, without importlib's frames."""
    lines = message.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("tests/")]
    return "\n".join(lines[starts[-1]:] if starts else lines[-15:])


def _tail(text: str, n: int) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


@dataclass
class Score:
    exercise: Exercise
    passed: int
    total: int
    output: str

    @property
    def score(self) -> float:
        return round(self.exercise.points * self.passed / self.total, 2) if self.total else 0.0


def score_exercises(exercises: list[Exercise], run: ExerciseRun, timeout: float | None = None) -> list[Score]:
    scores = []
    for ex in exercises:
        mine = run.outcomes(ex.id)
        passed = [r for r in mine if r["outcome"] == "passed"]
        if not mine:
            out = "No test of this exercise ran: " + _why_nothing_ran(run, timeout)
        else:
            out = f"{len(passed)}/{len(mine)} tests pass."
            if len(passed) < len(mine):
                out += f" The code to fix is in {ex.file}, in {ex.function}."
            for r in mine:
                if r["outcome"] != "passed":
                    out += f"\n\n{r['outcome'].upper()} {_short(r['nodeid'])}\n{_explain(ex, r)}"
        scores.append(Score(ex, len(passed), len(mine), out))
    return scores


def gradescope_results(scores: list[Score]) -> dict:
    """Gradescope's results.json: one entry per exercise, its score out of its points."""
    total = round(sum(s.score for s in scores), 2)
    max_total = sum(s.exercise.points for s in scores)
    return {
        "score": total,
        "output": f"{total:g} / {max_total} points over {len(scores)} exercises",
        "tests": [{"name": f"{s.exercise.id} (lesson {s.exercise.lesson}): {s.exercise.title}",
                   "score": s.score, "max_score": s.exercise.points, "output": s.output,
                   "visibility": "visible"} for s in scores],
    }


# ---------------------------------------------------------------- commands

def cmd_list(args) -> int:
    exercises = find_exercises(ROOT)
    rows = [(ex.id, ex.file, ex.lesson, str(ex.points), "stub" if ex.is_stub else "written", ex.title)
            for ex in exercises]
    _table(("id", "file", "lesson", "pts", "state", "title"), rows)
    print(f"\n{len(exercises)} exercises, {sum(ex.points for ex in exercises)} points")
    return 0


def cmd_make(args) -> int:
    chosen = make_copy(args.dir, args.only, args.force)
    print(f"wrote a student copy to {Path(args.dir).resolve()}: {len(chosen)} exercises stubbed, "
          f"{sum(ex.points for ex in chosen)} points")
    for ex in chosen:
        print(f"  {ex.id:28} {ex.where()}")
    print(f"\nnext: cd {args.dir} && python -m minillm.exercises list")
    return 0


def cmd_check(args) -> int:
    ex = select(load_exercises(ROOT), [args.id])[0]
    run = run_exercise_tests([ex.id], ROOT, args.timeout)
    if args.verbose:
        print(run.output)
    score = score_exercises([ex], run, args.timeout)[0]
    print(f"exercise {ex.id} (lesson {ex.lesson}, {ex.points} pts): {ex.title}")
    for r in run.outcomes(ex.id):
        mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[r["outcome"]]
        print(f"  {mark}  {_short(r['nodeid'])}")
        if r["outcome"] != "passed":
            print("        " + _explain(ex, r).replace("\n", "\n        "))
    if score.total == 0:
        print(score.output)
    elif score.passed == score.total:
        print(f"\nall {score.total} tests pass: exercise {ex.id} is done.")
    else:
        print(f"\n{score.passed}/{score.total} tests pass. The code to write is at {ex.where()}.")
        print(f"Hint: {ex.hint}")
    return 0 if score.total and score.passed == score.total else 1


def cmd_grade(args) -> int:
    try:
        exercises = select(load_exercises(ROOT), args.only)
    except ExerciseError as e:
        if args.json:   # Gradescope needs a results file even when the submission broke the markers
            _write_json(args.json, {"score": 0, "output": f"grading failed: {e}", "tests": []})
        raise
    run = run_exercise_tests(None, ROOT, args.timeout)
    scores = score_exercises(exercises, run, args.timeout)
    rows = [(s.exercise.id, s.exercise.lesson, f"{s.passed}/{s.total}", f"{s.score:g}", str(s.exercise.points))
            for s in scores]
    _table(("exercise", "lesson", "tests", "score", "of"), rows)
    results = gradescope_results(scores)
    print(f"\ntotal: {results['output']}")
    if args.json:
        _write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


def _write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.exercises",
                                     description="Classroom exercises: list them, make a student copy, check, grade.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="table of the exercises in this project").set_defaults(run=cmd_list)
    p = sub.add_parser("make", help="write a student copy with exercises replaced by stubs")
    p.add_argument("dir", help="where to write the copy (must be empty unless --force)")
    p.add_argument("--only", help="comma-separated exercise ids to stub (default: all)")
    p.add_argument("--force", action="store_true", help="replace the project's files in a non-empty DIR")
    p.set_defaults(run=cmd_make)
    p = sub.add_parser("check", help="run one exercise's tests and explain the failures")
    p.add_argument("id")
    p.add_argument("-v", "--verbose", action="store_true", help="also print pytest's own output")
    p.add_argument("--timeout", type=float, default=600, help="seconds before pytest is stopped (default 600)")
    p.set_defaults(run=cmd_check)
    p = sub.add_parser("grade", help="run every exercise's tests; print scores; write Gradescope's results.json")
    p.add_argument("--json", help="where to write the results file, e.g. /autograder/results/results.json")
    p.add_argument("--only", help="comma-separated exercise ids to grade (default: all)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before pytest is stopped (default 1200)")
    p.set_defaults(run=cmd_grade)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
