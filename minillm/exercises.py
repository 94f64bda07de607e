"""Classroom exercises cut from the reference engine, and a grader that the graded code cannot talk into points.

    python -m minillm.exercises list                         # id, lesson, points, stub/written, where, in lesson order
    python -m minillm.exercises make DIR [--only IDS] [--force]
    python -m minillm.exercises check ID                     # one exercise: visible cases and a fresh held-out draw
    python -m minillm.exercises grade [--json PATH]          # what the copy's manifest assigns; Gradescope's results

Regions. The reference engine is the solution. Pieces of it are marked, in
place, in the concept modules:

    # >>> exercise kv-cache-write (lesson 02, 2 pts): store the new keys and values in their slots
    # hint: <the idea and the shape, never the expression>
    <reference code, at the marker's indentation or deeper>
    # <<< exercise

`make` writes a student copy: exactly the files git tracks, each chosen
region's code replaced by one line at the marker's indentation (markers and
hint kept), so that the copy still imports and everything that does not reach
a stub still runs,

    raise NotImplementedError('exercise kv-cache-write (lesson 02): store ... Hint: ...')

and a manifest, exercises.json: every region with its place in the copy,
which ones were stubbed (the assignment), and every file the copy holds.

Checks. Each exercise has one `Check` in tests/exercises/ (see
tests/exercises/exercise_checks.py): named visible cases, held-out situations
drawn at grade time, `run` (calls the student's function, returns data) and
`verify` (judges that data). Pytest runs the visible cases for students;
the grader runs them and the held-out draws.

The grader, and what it defends against
---------------------------------------
  * The parent process decides the score and never imports the graded code
    (it runs as `python minillm/exercises.py`, so not even the package's
    `__init__` is loaded; `python -m` re-executes itself that way).
  * Each exercise runs in a child process of its own, forked before any
    student code is imported, in its own session, with a wall-clock limit. A
    crash, `os._exit`, `sys.exit` or an endless loop costs that exercise only,
    the message says which happened, and the whole process group is killed.
  * The child sends back data, not verdicts: JSON lines holding the outputs of
    the student's functions. The parent compares them with its own expected
    values, computed after the child is gone; every case sent must come back
    exactly once.
  * Held-out inputs come from a seed the grader chooses (MINILLM_GRADE_SEED,
    or a fresh one recorded in the results), so a table of answers fails. The
    score is the share of held-out checks passed; the visible cases are
    feedback, exactly what the student's pytest shows.
  * The manifest says what is graded; a tree without one, or whose regions
    disagree with it, is refused.
  * `--user` runs the children as an unprivileged user (run_autograder, in
    README.md, passes `--user nobody`), so the student's code cannot write the
    results or reach the grader's processes.
What no in-process check stops: code that reads the grader's files (keep the
reference off the grading image: upload the copy `make` writes), a process
that escapes its group and outlives the grade (unless --user), network use,
and resource exhaustion.

Adding an exercise
------------------
 1. Mark the region in the concept module, around whole statements of one
    function. Its hint, the function's docstring and the check's messages name
    the idea and the shape of the answer, never its expression: the leak check
    (`find_leaks`) fails on 8 consecutive tokens of the solution, names and
    spacing aside, in a hint, a docstring, a message, a lesson or a README
    (unless the run is generic, `f(a, b, c):`, or the given code shows it).
 2. Write its Check in tests/exercises/test_ex_<concept>.py: visible cases, one
    held-out situation per visible case, `run` importing minillm inside and
    calling only the function that holds the region (put independent stand-ins
    in place of other exercises' code), `verify` computing the expected value
    from a property or a small independent computation. End the file with
    `test_<name> = CHECK.pytest_test()`.
 3. `python -m pytest tests/test_exercises_tool.py` (and `-m slow`) then holds
    it to the rules: the region parses, every case fails on the stub and passes
    with the reference code, restoring the region alone scores exactly its
    points, nothing leaks, and no cheating submission scores.

This file imports nothing from minillm, and no module that a submission could
shadow: it is the one file of the package that grading trusts.
"""
import os
import sys

if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]   # run as a script: the package's folder, a submission's files, must not shadow the stdlib

import argparse  # the imports come after that fix, on purpose
import dataclasses
import importlib.util
import io
import json
import keyword
import numbers
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
import tokenize
import traceback
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the project this file lives in: the reference or a student copy
PACKAGE = "minillm"
EXERCISE_TESTS = "tests/exercises"
MANIFEST = "exercises.json"                  # written into each copy by `make`; `grade` reads it
MANIFEST_FORMAT = 2
DEFAULT_TIMEOUT_S = 60                       # per exercise (MINILLM_GRADE_TIMEOUT); a correct one needs a second
VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")   # Gradescope's

BEGIN, END = "# >>> exercise", "# <<< exercise"
HEADER = re.compile(r"(?P<indent>[ \t]*)# >>> exercise (?P<id>[a-z0-9][a-z0-9-]*) "
                    r"\(lesson (?P<lesson>\d{2}), (?P<points>\d+) pts?\): (?P<title>\S.*?)\s*")
HINT = re.compile(r"(?P<indent>[ \t]*)# hint: (?P<hint>\S.*?)\s*")
HEADER_FORM = "'# >>> exercise <id> (lesson NN, N pts): <title>', id in lowercase-with-dashes"
ENCLOSING = re.compile(r"(?P<indent>[ \t]*)(?:async\s+)?(?:def|class)\s+(?P<name>\w+)")
STUB_MESSAGE = re.compile(r"exercise (?P<id>[a-z0-9][a-z0-9-]*) \(lesson ")


class ExerciseError(ValueError):
    """A malformed region, an unknown id, a tree the grader refuses, or a target `make` will not write."""


@dataclasses.dataclass(frozen=True)
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
    body: tuple[str, ...] = dataclasses.field(default=(), repr=False)   # the lines between the hint and the end marker

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

    @property
    def worth(self) -> str:
        return f"lesson {self.lesson}, {self.points} pt{'s' if self.points != 1 else ''}"

    def header(self) -> tuple:
        """What the marker line says: compared between a copy's manifest and its source."""
        return self.file, self.lesson, self.points, self.title


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
    """Every region in the package under `root`, in lesson order; ids must be unique."""
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
    return sorted(found, key=lambda ex: ex.lesson)   # stable: within a lesson, file then line order


def select(exercises: list[Exercise], only: str | list[str] | None) -> list[Exercise]:
    """The exercises named in `only` (comma-separated or a list), or all of them when `only` is None."""
    if only is None:
        return list(exercises)
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    if not wanted:
        raise ExerciseError(f"--only {only!r} names no exercise; give comma-separated ids, e.g. "
                            f"--only {','.join(ex.id for ex in exercises[:2])}")
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


# ---------------------------------------------------------------- the manifest

def read_manifest(root: Path) -> dict:
    """A copy's exercises.json, checked for shape; ExerciseError says what is wrong and how to get a good one."""
    path = root / MANIFEST
    remake = "it is written by `python -m minillm.exercises make`: make the copy again from the reference"
    if not path.is_file():
        raise ExerciseError(f"{path} is missing, so this tree is not a student copy and there is nothing "
                            f"assigned to grade; {remake}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExerciseError(f"{path} is not valid JSON ({e}); {remake}") from None
    fields = {f.name for f in dataclasses.fields(Exercise)} - {"body"}
    ok = (isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and isinstance(data.get("files"), list)
          and all(isinstance(f, str) for f in data["files"]) and isinstance(data.get("exercises"), list)
          and all(isinstance(e, dict) and set(e) == fields | {"stubbed"} for e in data["exercises"]))
    if not ok:
        raise ExerciseError(f"{path} is not a manifest of format {MANIFEST_FORMAT} (a 'format', a 'files' list, and "
                            f"'exercises' with the fields {', '.join(sorted(fields | {'stubbed'}))}); {remake}")
    return data


def assigned_exercises(root: Path) -> list[Exercise]:
    """What `grade` grades: the exercises the manifest marks as stubbed, at their current lines; refused when the
    manifest is missing, unreadable, or disagrees with the regions in the source."""
    listed = read_manifest(root)["exercises"]
    try:
        found = {ex.id: ex for ex in find_exercises(root)}
    except ExerciseError as e:
        raise ExerciseError(f"the regions of this copy cannot be read ({e}); put the markers back as `make` wrote "
                            f"them") from None
    exercises = [Exercise(**{k: v for k, v in e.items() if k != "stubbed"}) for e in listed]
    problems = []
    for ex in exercises:
        if ex.id not in found:
            problems.append(f"exercise {ex.id} ({ex.file}) is in the manifest but has no region in the source")
        elif found[ex.id].header() != ex.header():
            problems.append(f"exercise {ex.id}: the manifest says {ex.header()}, the marker in the source says "
                            f"{found[ex.id].header()}")
    problems += [f"the source has a region {i} that the manifest does not list"
                 for i in found if i not in {ex.id for ex in exercises}]
    if problems:
        raise ExerciseError(f"{MANIFEST} and the source disagree, so this copy is not graded:\n  - "
                            + "\n  - ".join(problems) + "\nkeep every '# >>> exercise' marker line as `make` wrote it")
    stubbed = {e["id"] for e in listed if e["stubbed"]}
    return [dataclasses.replace(ex, line=found[ex.id].line) for ex in exercises if ex.id in stubbed]


# ---------------------------------------------------------------- make

def tracked_files(root: Path) -> list[str]:
    """The files git tracks under `root` (and that exist): exactly what a copy may hold."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ExerciseError(f"`make` copies exactly the files git tracks, and git could not list them ({e}); "
                            f"install git and run make from a clone of the project") from None
    if proc.returncode != 0:
        raise ExerciseError(f"`make` copies exactly the files git tracks, but {root} is not a git checkout "
                            f"({proc.stderr.strip()}); run make from a clone of the project")
    return sorted(f for f in proc.stdout.split("\0") if f and f != MANIFEST and (root / f).is_file())


def untracked_files(root: Path) -> list[str]:
    """Files of the course's folders that git does not track, and so a copy will not hold (ignored ones aside)."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--others", "--exclude-standard", "--",
                           PACKAGE, "tests", "lessons"], capture_output=True, text=True, timeout=60)
    return sorted(f for f in proc.stdout.split("\0") if f) if proc.returncode == 0 else []


def make_copy(target: Path | str, only: str | list[str] | None = None, force: bool = False,
              root: Path = ROOT) -> list[Exercise]:
    """Write a student copy of the project at `root` into `target`; returns the stubbed exercises, at their lines
    in the copy."""
    root, target = Path(root).resolve(), Path(target).resolve()
    if target == root or root.is_relative_to(target) or target.is_relative_to(root):
        raise ExerciseError(f"target {target} is inside the project or holds it; choose a folder outside {root}")
    if target.exists() and not target.is_dir():
        raise ExerciseError(f"target {target} is a file; choose a folder")
    everything = find_exercises(root)
    chosen = select(everything, only)
    files = tracked_files(root)
    leaks = find_leaks(root, chosen, files)
    if leaks:
        raise ExerciseError("a solution would leak into the copy:\n  " + "\n  ".join(leaks)
                            + "\nrewrite these to name the idea and the shape, not the expression")
    texts = _stubbed_texts(root, files, chosen)
    _clear_previous_copy(target, files, force)
    for rel in files:
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in texts:
            dst.write_text(texts[rel], encoding="utf-8")
        else:
            shutil.copy2(root / rel, dst)
    in_copy = find_exercises(target)   # the copy's line numbers: stubs are shorter than code
    stubbed = {ex.id for ex in chosen}
    manifest = {"format": MANIFEST_FORMAT, "files": files,
                "exercises": [{**{k: v for k, v in dataclasses.asdict(ex).items() if k != "body"},
                               "stubbed": ex.id in stubbed} for ex in in_copy]}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return [ex for ex in in_copy if ex.id in stubbed]


def _stubbed_texts(root: Path, files: list[str], chosen: list[Exercise]) -> dict[str, str]:
    """The new text of every file that holds a chosen region, checked to compile."""
    by_file: dict[str, list[Exercise]] = {}
    for ex in chosen:
        by_file.setdefault(ex.file, []).append(ex)
    texts = {}
    for rel, exercises in by_file.items():
        if rel not in files:
            raise ExerciseError(f"{rel} holds exercise {exercises[0].id} but git does not track it; git add it")
        text = (root / rel).read_text(encoding="utf-8")
        for ex in exercises:
            text = replace_region(text, rel, ex.id, ex.stub())
        try:
            compile(text, rel, "exec")
        except SyntaxError as e:
            raise ExerciseError(f"{rel}:{e.lineno}: stubbing {', '.join(x.id for x in exercises)} leaves invalid "
                                f"Python ({e.msg}); move the region so it covers whole statements") from None
        texts[rel] = text
    return texts


def _clear_previous_copy(target: Path, files: list[str], force: bool) -> None:
    """Make `target` ready: new or empty; or, with force, a previous copy whose own files (its manifest's list)
    are deleted, and nothing else."""
    if not target.exists() or not any(target.iterdir()):
        return
    if not force:
        raise ExerciseError(f"target {target} exists and is not empty; choose an empty folder, or pass --force to "
                            f"replace a previous copy made there")
    try:
        previous = read_manifest(target)["files"]
    except ExerciseError as e:
        raise ExerciseError(f"--force replaces only a previous copy, and {target} is not one ({e})") from None
    owned = set()
    for rel in previous + [MANIFEST]:
        path = (target / rel)
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ExerciseError(f"{target / MANIFEST} lists {rel!r}, which is outside the copy; delete the "
                                f"folder by hand if it is yours to delete")
        owned.add(path)
    strangers = [rel for rel in files if (target / rel).exists() and (target / rel) not in owned]
    if strangers:
        raise ExerciseError(f"{target} holds files the previous copy did not write, where the new copy would "
                            f"write: {', '.join(strangers[:5])}{' ...' if len(strangers) > 5 else ''}; move them "
                            f"away first")
    for path in sorted(owned, key=lambda p: len(p.parts), reverse=True):
        if path.is_file() or path.is_symlink():
            path.unlink()
    for folder in sorted({p.parent for p in owned}, key=lambda p: len(p.parts), reverse=True):
        while folder != target and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


# ---------------------------------------------------------------- the leak check

LEAK_TOKENS = 8          # this many consecutive tokens of a solution, names and spacing aside, is a leak...
LEAK_SPECIFIC = 3        # ...when at least this many of them are specific (not a name, string, comma, bracket,
                         # dot or `=`), one of them not a keyword: `f(a, b, c):` is the shape of any line
_PLAIN = {"n", "s", ",", "(", ")", "[", "]", ".", "="}
_TOKEN = re.compile(r"[^\W\d]\w*|\d+(?:\.\d+)?|\*\*|//|->|:=|[-+*/%@&|^<>=!]=|\.\.\.|[^\s\w]")
_MATH = str.maketrans({"·": "*", "×": "*", "−": "-", "≤": "<=", "≥": ">=", "≠": "!=", "÷": "/"})
_IGNORED = {"{", "}", "'", '"', "`", "#"}   # f-string braces, quotes and comment signs carry no code


def code_tokens(text: str) -> list[str]:
    """`text` as normalised tokens: every name one chooses is `n`, math signs become Python's, and spacing,
    quotes and braces go; keywords and attributes (`.values`, `.popleft`: the API, not a choice) stay.
    `a[i // w] * w` and `rows[j // size] · size` are the same 8 tokens."""
    out: list[str] = []
    for tok in _TOKEN.findall(text.translate(_MATH)):
        if tok in _IGNORED:
            continue
        is_name = tok[0].isalpha() or tok[0] == "_"
        out.append("n" if is_name and not keyword.iskeyword(tok) and not (out and out[-1] == ".") else tok)
    return out


def _specific(gram: tuple[str, ...]) -> bool:
    keywords = sum(keyword.iskeyword(tok) for tok in gram)
    others = sum(tok not in _PLAIN and not keyword.iskeyword(tok) for tok in gram)
    return others >= 1 and keywords + others >= LEAK_SPECIFIC


def _code_only(code: str) -> list[str]:
    """Python code as normalised tokens, without its comments, and each string as one token `s`: what a
    solution *does* is in its code; the prose of its error messages is no more a leak than any sentence."""
    try:
        kept = [("s" if t.type == tokenize.STRING else t.string)
                for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        kept = [re.sub(r"#.*", "", code)]
    return code_tokens(" ".join(kept))


def _prose_of_python(text: str, skip_lines: set[int]) -> list[tuple[int, str]]:
    """(line, text) of every comment and string in a Python source, outside `skip_lines` (1-based)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return list(enumerate(text.splitlines(), 1))
    return [(t.start[0], t.string) for t in tokens
            if t.type in (tokenize.COMMENT, tokenize.STRING) and t.start[0] not in skip_lines]


def find_leaks(root: Path, exercises: list[Exercise], files: list[str]) -> list[str]:
    """Where LEAK_TOKENS consecutive tokens of an exercise's solution appear in what a student reads of `files`:
    the comments, hints, docstrings and messages of the package and the tests, the lessons, and the READMEs.
    Each leak as 'file:line: exercise <id>: <the tokens>'."""
    bodies: dict[str, set[int]] = {}
    for ex in exercises:   # the regions' code leaves the copy; their hints and markers stay
        bodies.setdefault(ex.file, set()).update(range(ex.line + 2, ex.line + 2 + len(ex.body)))
    given: set[tuple[str, ...]] = set()   # sequences the copy's own code shows anyway: idioms, not answers
    for rel in files:
        if rel.startswith(PACKAGE + "/") and rel.endswith(".py"):
            lines = (root / rel).read_text(encoding="utf-8").splitlines()
            tokens = _code_only("\n".join("" if n in bodies.get(rel, ()) else line for n, line in enumerate(lines, 1)))
            given.update(tuple(tokens[i:i + LEAK_TOKENS]) for i in range(len(tokens) - LEAK_TOKENS + 1))
    grams: dict[tuple[str, ...], str] = {}
    for ex in exercises:
        tokens = _code_only(textwrap.dedent("\n".join(ex.body)) + "\n")
        for i in range(len(tokens) - LEAK_TOKENS + 1):
            gram = tuple(tokens[i:i + LEAK_TOKENS])
            if gram not in given and _specific(gram):
                grams.setdefault(gram, ex.id)
    if not grams:
        return []
    texts: list[tuple[str, int, str]] = []
    for rel in files:
        if not rel.endswith((".py", ".md")):
            continue
        text = (root / rel).read_text(encoding="utf-8")
        if rel.endswith(".md") or rel.startswith("lessons/"):   # read whole: lessons are code the student runs
            texts += [(rel, n, line) for n, line in enumerate(text.splitlines(), 1)]
        else:
            texts += [(rel, n, piece) for n, piece in _prose_of_python(text, bodies.get(rel, set()))]
    leaks = []
    for rel, start_line, text in _joined_by_file(texts):
        tokens = [(code_tokens(piece), line) for line, piece in text]
        flat = [(tok, line) for toks, line in tokens for tok in toks]
        reported: set[tuple[int, str]] = set()
        for i in range(len(flat) - LEAK_TOKENS + 1):
            ex_id = grams.get(tuple(tok for tok, _ in flat[i:i + LEAK_TOKENS]))
            if ex_id and (flat[i][1], ex_id) not in reported:
                reported.add((flat[i][1], ex_id))
                leaks.append(f"{rel}:{flat[i][1]}: exercise {ex_id}: "
                             f"{' '.join(tok for tok, _ in flat[i:i + LEAK_TOKENS])}")
    return leaks


def _joined_by_file(texts: list[tuple[str, int, str]]):
    """Each file's pieces in order, so a sequence split over two lines of a docstring is still seen."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for rel, line, text in texts:
        for offset, piece in enumerate(text.splitlines() or [""]):
            by_file.setdefault(rel, []).append((line + offset, piece))
    return [(rel, pieces[0][0] if pieces else 1, pieces) for rel, pieces in by_file.items()]


# ---------------------------------------------------------------- data over the wire

class Opaque:
    """A returned value that is not data (an object of the student's): only its type and repr cross over."""

    def __init__(self, type_name: str, text: str):
        self.opaque_type, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.opaque_type}: {self.text}>"


TENSOR_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
MAX_WIRE_ITEMS = 2_000_000


def to_wire(value, depth: int = 0):
    """A value as plain JSON data. Subclasses become their base type, so no object crosses with its methods
    (an `__eq__` that is always True stays behind)."""
    if depth > 30:
        return {"object": {"type": "too deeply nested", "repr": ""}}
    if value is None or isinstance(value, str) and type(value) is str:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if type(value).__name__ == "Tensor" and type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        return {"tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "data": t.flatten().tolist()}}
    if isinstance(value, tuple):
        return {"tuple": [to_wire(x, depth + 1) for x in value]}
    if isinstance(value, (list, deque)):
        return [to_wire(x, depth + 1) for x in value]
    if isinstance(value, dict):
        return {"dict": [[to_wire(k, depth + 1), to_wire(v, depth + 1)] for k, v in value.items()]}
    try:
        text = repr(value)[:200]
    except Exception:
        text = "(its repr failed)"
    return {"object": {"type": type(value).__name__, "repr": text}}


def from_wire(data):
    """Decode what to_wire wrote; anything else raises ValueError. Runs in the grader on what a child sent."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_wire(x) for x in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(from_wire(x) for x in body)
        if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            pairs = [(from_wire(k), from_wire(v)) for k, v in body]
            if all(isinstance(k, (str, int, float, bool, tuple)) or k is None for k, _ in pairs):
                return dict(pairs)
        if tag == "tensor" and isinstance(body, dict):
            return _tensor_from_wire(body)
        if tag == "object" and isinstance(body, dict):
            return Opaque(str(body.get("type"))[:100], str(body.get("repr"))[:200])
    raise ValueError(f"not the grader's encoding: {str(data)[:100]}")


def _tensor_from_wire(body: dict):
    import torch
    dtype, shape, values = body.get("dtype"), body.get("shape"), body.get("data")
    if (dtype not in TENSOR_DTYPES or not isinstance(shape, list) or not isinstance(values, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            or len(values) > MAX_WIRE_ITEMS or not all(isinstance(x, (int, float, bool)) for x in values)):
        raise ValueError("not the grader's encoding of a tensor")
    count = 1
    for n in shape:
        count *= n
    if count != len(values):
        raise ValueError(f"a tensor of shape {shape} cannot hold {len(values)} values")
    return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)


def over_the_wire(value):
    """What the grader would see of `value`: pytest passes outputs through this too, so both judge the same data."""
    return from_wire(json.loads(json.dumps(to_wire(value))))


# ---------------------------------------------------------------- the checks

def load_checks(root: Path) -> dict:
    """Every Check in tests/exercises/, by exercise id. Imports test modules, never the package: refused if they did."""
    folder = root / EXERCISE_TESTS
    sys.path.insert(0, str(folder))
    checks: dict = {}
    for path in sorted(folder.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ExerciseError(f"{path.relative_to(root)} cannot be imported: {type(e).__name__}: {e}") from None
        base = sys.modules["exercise_checks"].Check if "exercise_checks" in sys.modules else None
        for value in vars(module).values():
            if base is not None and isinstance(value, base):
                if value.exercise in checks and checks[value.exercise] is not value:
                    raise ExerciseError(f"two checks claim exercise {value.exercise}: "
                                        f"{type(checks[value.exercise]).__name__} and {type(value).__name__}")
                checks[value.exercise] = value
    loaded = sorted(m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + "."))
    if loaded:
        raise ExerciseError(f"the grader must never import the code it grades, but {', '.join(loaded)} is loaded in "
                            f"its process; run it as `python {PACKAGE}/exercises.py ...`, and keep minillm imports "
                            f"inside the checks' run()")
    return checks


@dataclasses.dataclass
class Case:
    name: str
    inputs: dict
    held_out: bool


def cases_of(check, seed: int) -> list[Case]:
    return ([Case(name, inputs, False) for name, inputs in check.visible().items()]
            + [Case(name, inputs, True) for name, inputs in check.held_out(seed).items()])


# ---------------------------------------------------------------- one child process per exercise

@dataclasses.dataclass
class ChildRun:
    messages: list[dict]   # what the child sent, in order
    stray: int             # lines that were not messages at all
    ended: str             # "" when it finished; otherwise what happened, in words
    printed: str           # the tail of what the code printed


class _Child:
    """A forked child running one exercise's cases; the parent's handle on it."""

    def __init__(self, ex: Exercise, check, cases: list[Case], root: Path, timeout: float, user, others: list):
        self.ex, self.timeout, self.num_cases = ex, timeout, len(cases)
        self.out = tempfile.TemporaryFile()
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:   # the child: it never returns from here
            code = 0
            try:
                os.close(read)
                for other in others:        # other children's channels and outputs are not this one's business
                    os.close(other.fd)
                    os.close(other.out.fileno())
                os.setsid()                 # a session of its own: the parent kills the whole group at the end
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(self.out.fileno(), 1)
                os.dup2(self.out.fileno(), 2)
                _child_main(check, cases, root, write, user)
            except BaseException:
                traceback.print_exc()
                code = 70
            finally:
                os._exit(code)
        os.close(write)
        self.fd = read
        os.set_blocking(read, False)
        self.deadline = time.monotonic() + timeout
        self.buffer = bytearray()

    def read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.buffer += chunk
            if len(self.buffer) > 64 << 20:
                return

    def exited(self) -> bool:
        """Whether it has ended, without reaping it: its pid, and so its group's id, stay ours until finish()."""
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def finish(self) -> ChildRun:
        """Stop it if it still runs, kill what it left behind, and read everything it sent."""
        timed_out = not self.exited()
        too_much = len(self.buffer) > 64 << 20
        self._kill_group()
        status = os.waitpid(self.pid, 0)[1]
        self.read()
        os.close(self.fd)
        messages, stray = _parse_messages(bytes(self.buffer[:64 << 20]))
        started = [m["start"] for m in messages if "start" in m]
        answered = {m["case"] for m in messages if isinstance(m.get("case"), int)}
        ended = ""
        if too_much:
            ended = "it sent over 64 MB of output and was stopped"
        elif timed_out:
            ended = (f"it ran past the time limit of {self.timeout:g} s and was stopped: an endless loop? (a loop "
                     f"that catches BaseException cannot escape this limit)")
        elif len(answered) < self.num_cases:
            code = os.waitstatus_to_exitcode(status)
            if code < 0:
                ended = f"the process was killed by signal {signal.Signals(-code).name}: a crash"
            else:
                ended = (f"the process exited with status {code} before returning its results: os._exit() was "
                         f"called, or the interpreter crashed")
        if ended and started:
            ended += f" (during case {started[-1]})"
        self.out.seek(0, os.SEEK_END)
        self.out.seek(max(0, self.out.tell() - 3000))
        printed = self.out.read().decode("utf-8", errors="replace")
        self.out.close()
        return ChildRun(messages, stray, ended, printed)

    def _kill_group(self) -> None:
        """SIGKILL its session's process group (what it forked) and the child itself, in case it never got to setsid."""
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _parse_messages(data: bytes) -> tuple[list[dict], int]:
    """The JSON objects, one per line, and how many lines were something else."""
    messages, stray = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if isinstance(message, dict):
            messages.append(message)
        else:
            stray += 1
    return messages, stray


def _child_main(check, cases: list[Case], root: Path, channel: int, user: str | None) -> None:
    """In the child: import the student's code through check.run, case by case, and send back each output."""
    if user:
        _drop_privileges(user)
    os.chdir(root)
    sys.path.insert(0, str(root))
    sys.dont_write_bytecode = True
    import torch
    torch.set_num_threads(1)            # one core per child; children run side by side

    def send(message: dict) -> None:
        data = (json.dumps(message, allow_nan=True) + "\n").encode()
        while data:
            data = data[os.write(channel, data):]

    for i, case in enumerate(cases):
        send({"start": case.name})
        try:
            message = {"case": i, "output": to_wire(check.run(case.inputs))}
        except BaseException as e:        # SystemExit and KeyboardInterrupt too: they end this case, not the run
            message = {"case": i, "raised": _describe_exception(e, root)}
        try:
            send(message)
        except (TypeError, ValueError, RecursionError, OverflowError) as e:
            send({"case": i, "raised": {"type": "UnsendableOutput", "message": f"the output cannot be sent: {e}"}})
    os.close(channel)


def _drop_privileges(user: str) -> None:
    import pwd
    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    os.environ["HOME"] = tempfile.gettempdir()


def _describe_exception(e: BaseException, root: Path) -> dict:
    try:
        text = str(e)[:3000]
    except BaseException:
        text = "(its message could not be read)"
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = Path(frame.filename)
        if path.is_absolute() and path.is_relative_to(root):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(PACKAGE + "/"):
                where = f"{rel}:{frame.lineno}"
                break
    return {"type": type(e).__name__, "message": text, "where": where,
            "exit_code": str(e.code) if isinstance(e, SystemExit) else None}


def run_exercises(work: list[tuple[Exercise, object, list[Case]]], root: Path, timeout: float, jobs: int,
                  user: str | None) -> dict[str, ChildRun]:
    """Run each exercise's cases in a child of its own, `jobs` at a time; what each child sent, by exercise id."""
    if not hasattr(os, "fork"):
        raise ExerciseError("the grader runs each exercise in a forked process and this system has no fork(); "
                            "use Linux, macOS or WSL, or run the visible tests: python -m pytest --exercise ID")
    pending, running, done = list(work), [], {}
    selector = selectors.PollSelector()   # poll keeps no file descriptor that a child could inherit
    try:
        while pending or running:
            while pending and len(running) < jobs:
                ex, check, cases = pending.pop(0)
                child = _Child(ex, check, cases, root, timeout, user, running)
                running.append(child)
                selector.register(child.fd, selectors.EVENT_READ, child)
            for key, _ in selector.select(timeout=0.02):
                key.data.read()
            now = time.monotonic()
            for child in list(running):
                if child.exited() or now > child.deadline or len(child.buffer) > 64 << 20:
                    selector.unregister(child.fd)
                    running.remove(child)
                    done[child.ex.id] = child.finish()
    finally:
        for child in running:
            child._kill_group()
    return done


# ---------------------------------------------------------------- judging

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

    def of(self, held_out: bool) -> list[CaseResult]:
        return [r for r in self.results if r.held_out == held_out]

    @property
    def score(self) -> float:
        """The exercise's points times the share of held-out checks passed: the visible cases are feedback."""
        held = self.of(True)
        return round(self.exercise.points * sum(r.passed for r in held) / len(held), 2) if held else 0.0


def judge(ex: Exercise, check, cases: list[Case], run: ChildRun) -> Score:
    """Compare what the child sent with the expected values, case by case; the child's own words count for nothing."""
    answers: dict[int, list[dict]] = {}
    stray = run.stray
    for m in run.messages:
        if "case" in m and isinstance(m["case"], int) and 0 <= m["case"] < len(cases):
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
        else:
            message = _verify(check, case, got[0].get("output"))
        results.append(CaseResult(case.name, case.held_out, message == "", message))
    ended = run.ended + (f"; {stray} line(s) on the grader's channel were not its messages" if stray else "")
    return Score(ex, results, ended, run.printed)


def _verify(check, case: Case, wire) -> str:
    try:
        output = from_wire(wire)
    except (ValueError, TypeError, RecursionError) as e:
        return f"the child sent data the grader cannot read: {e}"
    try:
        check.verify(case.inputs, output)
    except AssertionError as e:
        return str(e) or "wrong"
    except Exception as e:
        return f"the output could not be checked ({type(e).__name__}: {e}); the code returned {output!r:.300}"
    return ""


def _raised_message(ex: Exercise, raised: dict) -> str:
    if not isinstance(raised, dict):
        return "failed"
    kind, text, where = str(raised.get("type")), str(raised.get("message")), raised.get("where") or ""
    stub = STUB_MESSAGE.match(text) if kind == "NotImplementedError" else None
    if stub and stub["id"] == ex.id:
        return "not written yet: the stub raises NotImplementedError"
    if stub:
        return f"needs exercise {stub['id']}, still a stub (this check should not reach it: tell your instructor)"
    if kind == "SystemExit":
        return (f"the code called sys.exit({raised.get('exit_code')}): a function returns its result, it does "
                f"not end the program" + (f" (at {where})" if where else ""))
    return f"{kind}: {text}" + (f" (raised at {where})" if where else "")


# ---------------------------------------------------------------- grading

def grade_exercises(exercises: list[Exercise], root: Path = ROOT, seed: int | None = None,
                    timeout: float = DEFAULT_TIMEOUT_S, jobs: int | None = None, user: str | None = None) -> tuple[list[Score], int]:
    """Grade `exercises` of the tree at `root`: every one in a child process, judged here. Returns the scores and
    the seed the held-out cases were drawn from."""
    seed = grade_seed() if seed is None else seed
    checks = load_checks(root)
    missing = [ex.id for ex in exercises if ex.id not in checks]
    if missing:
        raise ExerciseError(f"no check in {EXERCISE_TESTS}/ for exercise{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)}; every exercise needs one (see exercise_checks.py)")
    work = [(ex, checks[ex.id], cases_of(checks[ex.id], seed)) for ex in exercises]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    runs = run_exercises(work, root, timeout, jobs or cores, user)
    return [judge(ex, check, cases, runs[ex.id]) for ex, check, cases in work], seed


def grade_timeout(given: float | None) -> float:
    text = os.environ.get("MINILLM_GRADE_TIMEOUT", "").strip() if given is None else str(given)
    try:
        timeout = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise ExerciseError(f"time limit {text!r} (--timeout or MINILLM_GRADE_TIMEOUT) must be a number of seconds "
                            f"above 0; the default is {DEFAULT_TIMEOUT_S}")
    return timeout


def grade_seed() -> int:
    text = os.environ.get("MINILLM_GRADE_SEED", "").strip()
    if not text:
        return secrets.randbelow(2**31)
    try:
        return int(text)
    except ValueError:
        raise ExerciseError(f"MINILLM_GRADE_SEED={text!r} is not an integer; unset it for a fresh seed") from None


def feedback(score: Score, held_out: bool, limit: int = 6) -> str:
    """One exercise's visible cases, or its held-out checks, as a student reads them."""
    results = score.of(held_out)
    passed = sum(r.passed for r in results)
    what = "held-out checks (fresh inputs)" if held_out else "visible cases (the tests in tests/exercises/)"
    lines = [f"{passed}/{len(results)} {what} pass."]
    if score.ended:
        lines.append(f"The run did not finish normally: {score.ended}.")
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append(f"The code to fix is at {score.exercise.where()}.")
    for r in failed[:limit]:
        lines.append(f"\nFAIL {r.name}\n{r.message}")
    if len(failed) > limit:
        lines.append(f"\n... and {len(failed) - limit} more")
    if failed and score.printed.strip():
        lines.append("\nWhat the code printed (the end):\n" + score.printed.strip()[-1500:])
    return "\n".join(lines)


def gradescope_results(scores: list[Score], seed: int, held_out_visibility: str = "visible") -> dict:
    """Gradescope's results.json: per exercise, its visible cases (no points, always shown) and its held-out
    checks (its points, shown as the instructor chooses)."""
    total = round(sum(s.score for s in scores), 2)
    max_total = sum(s.exercise.points for s in scores)
    tests = []
    for s in scores:
        name = f"{s.exercise.id} (lesson {s.exercise.lesson}): {s.exercise.title}"
        visible_ok = all(r.passed for r in s.of(False))
        tests.append({"name": f"{name}: visible cases", "score": 0.0, "max_score": 0.0,
                      "status": "passed" if visible_ok else "failed", "output": feedback(s, False),
                      "visibility": "visible"})
        tests.append({"name": f"{name}: held-out checks", "score": s.score, "max_score": float(s.exercise.points),
                      "status": "passed" if s.score == s.exercise.points else "failed", "output": feedback(s, True),
                      "visibility": held_out_visibility})
    return {"score": total, "output": f"{total:g} / {max_total} points over {len(scores)} exercises. Held-out "
                                      f"inputs drawn with seed {seed} (MINILLM_GRADE_SEED={seed} draws them again).",
            "extra_data": {"seed": seed}, "tests": tests}


def results_problems(results) -> list[str]:
    """What makes `results` not a valid Gradescope results.json, field by field (empty when it is)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

    if not isinstance(results, dict):
        return [f"the results are a {type(results).__name__}, not an object"]
    problems = []
    if not number(results.get("score")):
        problems.append(f"top-level score {results.get('score')!r} is not a finite number")
    if "output" in results and not isinstance(results["output"], str):
        problems.append("top-level output is not a string")
    tests = results.get("tests")
    if not isinstance(tests, list):
        return problems + ["tests is not a list"]
    for i, t in enumerate(tests):
        if not isinstance(t, dict):
            problems.append(f"tests[{i}] is not an object")
            continue
        for key, ok in (("name", isinstance(t.get("name"), str) and t.get("name")), ("score", number(t.get("score"))),
                        ("max_score", number(t.get("max_score"))), ("output", isinstance(t.get("output"), str))):
            if not ok:
                problems.append(f"tests[{i}].{key} is {t.get(key)!r}")
        if t.get("visibility", "visible") not in VISIBILITIES:
            problems.append(f"tests[{i}].visibility {t.get('visibility')!r} is not one of {', '.join(VISIBILITIES)}")
        if t.get("status", "passed") not in ("passed", "failed"):
            problems.append(f"tests[{i}].status {t.get('status')!r} is not passed or failed")
        if number(t.get("score")) and number(t.get("max_score")) and not 0 <= t["score"] <= max(t["max_score"], 0):
            problems.append(f"tests[{i}].score {t['score']} is outside 0..{t['max_score']}")
    return problems


# ---------------------------------------------------------------- commands

def cmd_list(args) -> int:
    exercises = find_exercises(ROOT)
    try:
        assigned = {ex.id for ex in assigned_exercises(ROOT)} if (ROOT / MANIFEST).exists() else None
    except ExerciseError:
        assigned = None
    rows = [(ex.id, ex.lesson, str(ex.points), "stub" if ex.is_stub else "written", f"{ex.file}:{ex.line}", ex.title)
            + ((("yes" if ex.id in assigned else "no"),) if assigned is not None else ()) for ex in exercises]
    _table(("id", "lesson", "pts", "state", "where", "title") + (("graded",) if assigned is not None else ()), rows)
    print(f"\n{len(exercises)} exercises, {sum(ex.points for ex in exercises)} points, in lesson order")
    return 0


def cmd_make(args) -> int:
    chosen = make_copy(args.dir, args.only, args.force)
    print(f"wrote a student copy to {Path(args.dir).resolve()}: {len(chosen)} exercises stubbed, "
          f"{sum(ex.points for ex in chosen)} points")
    for ex in chosen:
        print(f"  {ex.id:28} {ex.where()}")
    untracked = untracked_files(ROOT)
    if untracked:
        print(f"\nnot copied, because git does not track them (git add those that belong to the course): "
              f"{', '.join(untracked[:8])}{' ...' if len(untracked) > 8 else ''}")
    print(f"\nnext: cd {args.dir} && python -m minillm.exercises list")
    return 0


def cmd_check(args) -> int:
    ex = select(find_exercises(ROOT), [args.id])[0]
    user = _checked_user(args.user)
    (score,), seed = grade_exercises([ex], ROOT, args.seed, grade_timeout(args.timeout), 1, user)
    print(f"exercise {ex.id} ({ex.worth}): {ex.title}")
    for held_out in (False, True):
        results = score.of(held_out)
        print(f"\n{'held-out checks, drawn with seed ' + str(seed) if held_out else 'visible cases'}: "
              f"{sum(r.passed for r in results)}/{len(results)} pass")
        for r in results:
            print(f"  {'PASS' if r.passed else 'FAIL'}  {r.name}")
            if not r.passed:
                print("        " + r.message.replace("\n", "\n        "))
    if score.ended:
        print(f"\nThe run did not finish normally: {score.ended}.")
    if score.printed.strip() and not all(r.passed for r in score.results):
        print("\nWhat the code printed (the end):\n" + score.printed.strip()[-1500:])
    if all(r.passed for r in score.results):
        print(f"\nall {len(score.results)} cases pass: exercise {ex.id} is done ({score.score:g}/{ex.points} points).")
        return 0
    print(f"\nscore {score.score:g}/{ex.points}. The code to write is at {ex.where()}.\nHint: {ex.hint}")
    return 1


def cmd_grade(args) -> int:
    started = time.perf_counter()
    try:
        if args.held_out_visibility not in VISIBILITIES:
            raise ExerciseError(f"--held-out-visibility {args.held_out_visibility!r} is not one of "
                                f"{', '.join(VISIBILITIES)}")
        if args.jobs is not None and args.jobs < 1:
            raise ExerciseError(f"--jobs {args.jobs}: grade at least 1 exercise at a time")
        user = _checked_user(args.user)
        exercises = select(assigned_exercises(ROOT), args.only)
        scores, seed = grade_exercises(exercises, ROOT, args.seed, grade_timeout(args.timeout), args.jobs, user)
    except ExerciseError as e:
        if args.json:   # Gradescope needs a results file whatever went wrong
            _write_json(args.json, {"score": 0.0, "output": f"grading failed: {e}", "tests": []})
        raise
    except BaseException as e:
        if args.json:
            _write_json(args.json, {"score": 0.0, "output": f"the grader failed ({type(e).__name__}: {e}); "
                                                            f"tell your instructor", "tests": []})
        raise
    rows = [(s.exercise.id, s.exercise.lesson, f"{sum(r.passed for r in s.of(False))}/{len(s.of(False))}",
             f"{sum(r.passed for r in s.of(True))}/{len(s.of(True))}", f"{s.score:g}", str(s.exercise.points),
             s.ended[:60]) for s in scores]
    _table(("exercise", "lesson", "visible", "held-out", "score", "of", "run"), rows)
    results = gradescope_results(scores, seed, args.held_out_visibility)
    problems = results_problems(results)
    if problems:
        raise RuntimeError(f"the grader built invalid results: {problems}")
    print(f"\ntotal: {results['output']}\ngraded in {time.perf_counter() - started:.1f} s")
    if args.json:
        _write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


def _checked_user(user: str | None) -> str | None:
    if not user:
        return None
    import pwd
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ExerciseError(f"--user {user}: no such user on this system (Gradescope's images have nobody)") from None
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise ExerciseError(f"--user {user} needs the grader to run as root, to hand the children to that user; "
                            f"Gradescope runs run_autograder as root")
    return user


def _write_json(path: str, data: dict) -> None:
    """Written whole, then renamed into place: a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(partial, target)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.exercises",
                                     description="Classroom exercises: list them, make a student copy, check, grade.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises of this project, in lesson order").set_defaults(run=cmd_list)
    p = sub.add_parser("make", help="write a student copy with exercises replaced by stubs")
    p.add_argument("dir", help="where to write the copy: a new or empty folder outside the project")
    p.add_argument("--only", help="comma-separated exercise ids to stub (default: all)")
    p.add_argument("--force", action="store_true", help="replace a previous copy in DIR (the files its manifest lists)")
    p.set_defaults(run=cmd_make)
    for name, text in (("check", "one exercise: its visible cases and a fresh draw of held-out checks"),
                       ("grade", "every assigned exercise; print scores; write Gradescope's results.json")):
        p = sub.add_parser(name, help=text)
        if name == "check":
            p.add_argument("id")
        else:
            p.add_argument("--json", help="where to write the results file, e.g. /autograder/results/results.json")
            p.add_argument("--only", help="comma-separated exercise ids to grade (default: what the manifest assigns)")
            p.add_argument("--jobs", type=int, default=None, help="exercises graded at once (default: the cores "
                                                                   "this process may use)")
            p.add_argument("--held-out-visibility", default="visible",
                           help=f"Gradescope visibility of the held-out checks: {', '.join(VISIBILITIES)}")
        p.add_argument("--seed", type=int, default=None, help="seed of the held-out inputs (default: "
                                                               "MINILLM_GRADE_SEED, else a fresh one)")
        p.add_argument("--timeout", type=float, default=None, help=f"seconds each exercise may run (default: "
                       f"MINILLM_GRADE_TIMEOUT, else {DEFAULT_TIMEOUT_S})")
        p.add_argument("--user", help="run the student's code as this unprivileged user (needs root), e.g. nobody")
        p.set_defaults(run=cmd_check if name == "check" else cmd_grade)
    args = parser.parse_args(argv)
    if args.command in ("check", "grade") and PACKAGE in sys.modules and __name__ == "__main__":
        # `python -m minillm.exercises` imported the package, which is a submission's code: start again without it.
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
