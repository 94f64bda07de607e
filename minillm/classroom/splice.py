"""Only the regions count: a submission's code between its markers, spliced into the instructor's own files.

Grading never runs a submission's files. It reads the text between each
assigned exercise's markers, checks it, and writes it into a copy of the
instructor's package in a fresh folder; every line outside the regions, the
package's `__init__` and the grader included, is the instructor's. A region
that cannot be taken (a marker missing or duplicated, code that leaves its
function) keeps its stub and fails its own exercise, saying why.
"""
from __future__ import annotations

import ast
import os
import stat
import tempfile
import textwrap
from pathlib import Path

from .regions import BEGIN, END, HINT, PACKAGE, Exercise, ExerciseError, replace_region, write_tree

MAX_FILE_BYTES = 1 << 20      # a graded file of the submission; more is that file's error
MAX_REGION_CHARS = 20_000     # a region's code, before it is parsed
MAX_LINE_CHARS = 1_000        # one of its lines


def regions_of_submission(text: str, file: str, expected: list[Exercise]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The code of each of `expected` (the instructor's regions of `file`) in a submission's `file`, and for each
    region that cannot be taken, what is wrong with it, naming the file, the line and the marker: a marker missing
    or duplicated, no end marker before the next region, or code that is not a block of statements staying inside
    its function. A broken region costs only its own exercise; the order of the regions does not matter."""
    lines = text.splitlines()
    opened = []
    for n, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            rest = stripped[len(BEGIN):].split()
            opened.append((rest[0] if rest else "", n))
    bodies: dict[str, list[str]] = {}
    broken: dict[str, str] = {}
    for ex in expected:
        starts = [n for ex_id, n in opened if ex_id == ex.id]
        if len(starts) != 1:
            where = f" (lines {', '.join(str(n + 1) for n in starts)})" if starts else ""
            broken[ex.id] = (f"{file}: the marker of exercise {ex.id} ('{BEGIN} {ex.id} ...') appears {len(starts)} "
                             f"times{where}; keep exactly one, as the copy you were given has it")
            continue
        start = starts[0]
        stop = min([n for _, n in opened if n > start], default=len(lines))
        ends = [n for n in range(start + 1, stop) if lines[n].strip().startswith(END)]
        if not ends:
            broken[ex.id] = (f"{file}:{start + 1}: exercise {ex.id} has no end marker '{END}' before the next region "
                             f"or the end of the file; put it back after your code")
            continue
        first = start + 1 + (HINT.fullmatch(lines[start + 1]) is not None if start + 1 < ends[0] else 0)
        try:
            bodies[ex.id] = _checked_body(lines[first:ends[0]], ex, file, first + 1)
        except ExerciseError as e:
            broken[ex.id] = str(e)
    return bodies, broken


def _checked_body(body: list[str], ex: Exercise, file: str, first_line: int) -> list[str]:
    """The body re-indented to the instructor's marker, refused unless it is whole statements of one block, within
    MAX_REGION_CHARS and MAX_LINE_CHARS: whatever the parser makes of it fails this region alone."""
    code = textwrap.dedent("\n".join(body))
    if not code.strip():
        raise ExerciseError(f"{file}:{first_line}: exercise {ex.id} has no code between its markers")
    longest = max(range(len(body)), key=lambda i: len(body[i]))
    if len(code) > MAX_REGION_CHARS or len(body[longest]) > MAX_LINE_CHARS:
        where = first_line + longest if len(body[longest]) > MAX_LINE_CHARS else first_line
        raise ExerciseError(f"{file}:{where}: the code of exercise {ex.id} is longer than a region may be "
                            f"({MAX_REGION_CHARS} characters, {MAX_LINE_CHARS} on a line); write it shorter")
    wrapped = "def _region():\n" + textwrap.indent(code, "    ") + "\n"
    try:
        tree = ast.parse(wrapped, filename=file)
    except SyntaxError as e:
        raise ExerciseError(f"{file}:{first_line - 2 + (e.lineno or 1)}: the code of exercise {ex.id} is not "
                            f"valid Python on its own ({e.msg}); a region holds whole statements, every string and "
                            f"bracket it opens closed inside it") from None
    except (MemoryError, RecursionError, ValueError) as e:
        raise ExerciseError(f"{file}:{first_line}: the code of exercise {ex.id} cannot be parsed "
                            f"({type(e).__name__}: nested too deeply, or a null byte); write it plainly") from None
    if len(tree.body) != 1:
        raise ExerciseError(f"{file}:{first_line}: the code of exercise {ex.id} leaves its function")
    return [(ex.indent + line) if line.strip() else "" for line in code.splitlines()]


def read_submitted(submission: Path, rel: str) -> str:
    """The text of `rel` in the submission, read as what it claims to be: a regular file with one name, under
    MAX_FILE_BYTES, inside the submission folder, each folder on the way opened without following a link and the
    file without blocking. Anything else is an ExerciseError naming `rel` alone: what a link points at, and whether
    it exists, is never read nor said."""
    parts = rel.split("/")
    fd = os.open(submission, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_NONBLOCK if last else os.O_DIRECTORY
            try:
                opened = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=fd)
            except FileNotFoundError:
                raise ExerciseError(f"the submission has no {rel}; submit the package's files") from None
            except OSError:
                raise ExerciseError(f"the submission's {rel} is a link, or lies under one (or under something that "
                                    f"is not a folder); submit the file itself") from None
            os.close(fd)
            fd = opened
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise ExerciseError(f"the submission's {rel} is not a plain file (a pipe, a device, a folder or a file "
                                f"with several names); submit the file itself")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ExerciseError(f"the submission's {rel} is over {MAX_FILE_BYTES} bytes; submit the package's file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExerciseError(f"the submission's {rel} cannot be read as UTF-8 text ({e})") from None


def package_files(root: Path, listed: list[str] | None) -> list[str]:
    """The instructor's package files a graded folder holds: the copy's manifest list, or what is on disk."""
    if listed is not None:
        return [f for f in listed if f.startswith(PACKAGE + "/") and (root / f).is_file()]
    return sorted(p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def spliced_folder(root: Path, submission: Path, graded: list[Exercise], listed: list[str] | None,
                   group: int | None = None) -> tuple[Path, dict[str, str]]:
    """A fresh folder holding the instructor's package with each graded region's code taken from `submission`,
    and, by exercise, why a region could not be taken: that region holds its stub, and only it fails.

    Writable by its owner alone; with `group` (the student's user's own group), readable by that group and no
    one else, so that a run of another grade cannot read it; else readable by everyone."""
    from .regions import parse_regions
    root, submission = Path(root), Path(submission)
    by_file: dict[str, list[Exercise]] = {}
    for ex in sorted(graded, key=lambda e: (e.file, e.line)):
        by_file.setdefault(ex.file, []).append(ex)
    texts: dict[str, str] = {}
    broken: dict[str, str] = {}
    for rel, exercises in by_file.items():
        mine = (root / rel).read_text(encoding="utf-8")
        try:
            bodies, broken_here = regions_of_submission(read_submitted(submission, rel), rel,
                                                        parse_regions(mine, rel))
        except ExerciseError as e:
            bodies, broken_here = {}, {ex.id: str(e) for ex in exercises}
        for ex in exercises:
            if ex.id in bodies:
                mine = replace_region(mine, rel, ex.id, bodies[ex.id])
            else:   # the stub, never this tree's own code (in the reference tree, the solution)
                broken[ex.id] = broken_here[ex.id]
                mine = replace_region(mine, rel, ex.id, ex.stub())
        texts[rel] = mine
    folder = Path(tempfile.mkdtemp(prefix="minillm-graded-"))
    write_tree(root, folder, package_files(root, listed), texts)
    for path in [folder, *folder.rglob("*")]:
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, (0o755 if path.is_dir() else 0o644) & (0o750 if group is not None else 0o777))
    return folder, broken
