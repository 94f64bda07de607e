"""Exercise regions: the marked pieces of the reference code, read, stubbed, and taken from a submission.

    # >>> exercise kv-cache-write (lesson 01, 2 pts): store the new keys and values in their slots
    # hint: <the idea and what to think about, never the steps>
    <reference code, at the marker's indentation or deeper>
    # <<< exercise

A hint may end with "Off limits: name, name." — calls the grader refuses inside that region.
This module also holds the one stub detector (`stub_of`) that pytest and the lessons use.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

PACKAGE = "minillm"
ROOT = Path(__file__).resolve().parents[2]   # the project this package lives in: the instructor's, or a copy
BEGIN, END = "# >>> exercise", "# <<< exercise"
HEADER = re.compile(r"(?P<indent>[ \t]*)# >>> exercise (?P<id>[a-z0-9][a-z0-9-]*) "
                    r"\(lesson (?P<lesson>\d{2}), (?P<points>\d+) pts?\): (?P<title>\S.*?)\s*")
HINT = re.compile(r"(?P<indent>[ \t]*)# hint: (?P<hint>\S.*?)\s*")
HEADER_FORM = "'# >>> exercise <id> (lesson NN, N pts): <title>', id in lowercase-with-dashes"
ENCLOSING = re.compile(r"(?P<indent>[ \t]*)(?:async\s+)?(?:def|class)\s+(?P<name>\w+)")
STUB_MESSAGE = re.compile(r"exercise (?P<id>[a-z0-9][a-z0-9-]*) \(lesson ")
OFF_LIMITS = re.compile(r"Off limits: (?P<names>[\w., ]+?)\.?$")


class ExerciseError(ValueError):
    """A malformed region, an unknown id, a tree the grader refuses, or a target `make` will not write."""


def stub_of(exc: BaseException | None) -> str | None:
    """The exercise id when `exc`, or an exception that caused it, is an exercise stub's NotImplementedError.

    The one stub detector: tests/conftest.py (skip "needs exercise X") and lessons/common.py (stop with one
    line) both call it, so a stub reads the same everywhere."""
    for _ in range(10):   # follow the cause chain, not forever
        if exc is None:
            return None
        if isinstance(exc, NotImplementedError) and exc.args and isinstance(exc.args[0], str):
            m = STUB_MESSAGE.match(exc.args[0])
            if m:
                return m["id"]
        exc = exc.__cause__ or exc.__context__
    return None


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
        """The one form a location takes everywhere: file:line, in the function."""
        return f"{self.file}:{self.line}, in {self.function}"

    @property
    def worth(self) -> str:
        return f"lesson {self.lesson}, {self.points} pt{'s' if self.points != 1 else ''}"

    @property
    def off_limits(self) -> tuple[str, ...]:
        """The calls the hint puts off limits in this region."""
        m = OFF_LIMITS.search(self.hint)
        return tuple(n.strip() for n in m["names"].split(",") if n.strip()) if m else ()

    def header(self) -> tuple:
        """What the marker line says: compared between a copy's manifest and its source."""
        return self.file, self.lesson, self.points, self.title


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


def find_exercises(root: Path) -> list[Exercise]:
    """Every region in the package under `root`, in lesson order; ids must be unique."""
    found: list[Exercise] = []
    classroom = Path(__file__).resolve().parent.name
    for path in sorted((Path(root) / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or rel.parts[1:2] == (classroom,):
            continue   # the grader's own files show the marker format in their docstrings; they hold no region
        found += parse_regions(path.read_text(encoding="utf-8"), rel.as_posix())
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


def write_tree(root: Path, target: Path, files, texts: dict[str, str]) -> None:
    """Copy `files` (paths relative to root) into target, writing `texts[rel]` instead where one is given."""
    for rel in files:
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in texts:
            dst.write_text(texts[rel], encoding="utf-8")
        else:
            shutil.copy2(root / rel, dst)
