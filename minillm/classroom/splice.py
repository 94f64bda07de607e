"""Only the regions count: a submission's code between its markers, spliced into the instructor's own files.

Grading never runs a submission's files. It reads the text between each
assigned exercise's markers, checks it, and writes it into a copy of the
instructor's package in a fresh folder; every line outside the regions, the
package's `__init__` and the grader included, is the instructor's.
"""
from __future__ import annotations

import ast
import os
import tempfile
import textwrap
from pathlib import Path

from .regions import BEGIN, END, HINT, PACKAGE, Exercise, ExerciseError, replace_region, write_tree


def regions_of_submission(text: str, file: str, expected: list[Exercise]) -> dict[str, list[str]]:
    """The code of each of `expected` (the instructor's regions of `file`, in order) in a submission's `file`.

    Refused, naming the file and the marker, when a marker is missing, duplicated or out of order, when an end
    marker is missing, or when a region's code is not a block of statements that stays inside its function."""
    lines = text.splitlines()
    opened = []
    for n, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            rest = stripped[len(BEGIN):].split()
            opened.append((rest[0] if rest else "", n))
    ids = [i for i, _ in opened]
    for ex in expected:
        count = ids.count(ex.id)
        if count != 1:
            raise ExerciseError(f"{file}: the marker of exercise {ex.id} ('{BEGIN} {ex.id} ...') appears {count} "
                                f"times; keep exactly one, as the copy you were given has it")
    strangers = [i for i in ids if i not in {ex.id for ex in expected}]
    if strangers:
        raise ExerciseError(f"{file}: a marker '{BEGIN} {strangers[0]}' that the assignment does not have here; "
                            f"keep the markers as the copy you were given has them")
    if ids != [ex.id for ex in expected]:
        raise ExerciseError(f"{file}: the exercise markers are out of order ({', '.join(ids)}); the assignment has "
                            f"{', '.join(ex.id for ex in expected)}: put the code back between its own markers")
    bodies = {}
    for k, ((ex_id, start), ex) in enumerate(zip(opened, expected)):
        stop = opened[k + 1][1] if k + 1 < len(opened) else len(lines)
        ends = [n for n in range(start + 1, stop) if lines[n].strip().startswith(END)]
        if not ends:
            raise ExerciseError(f"{file}:{start + 1}: exercise {ex_id} has no end marker '{END}' before the next "
                                f"region; put it back after your code")
        first = start + 1 + (HINT.fullmatch(lines[start + 1]) is not None if start + 1 < ends[0] else 0)
        body = lines[first:ends[0]]
        bodies[ex_id] = _checked_body(body, ex, file, first + 1)
    return bodies


def _checked_body(body: list[str], ex: Exercise, file: str, first_line: int) -> list[str]:
    """The body re-indented to the instructor's marker, refused unless it is whole statements of one block."""
    code = textwrap.dedent("\n".join(body))
    if not code.strip():
        raise ExerciseError(f"{file}:{first_line}: exercise {ex.id} has no code between its markers")
    wrapped = "def _region():\n" + textwrap.indent(code, "    ") + "\n"
    try:
        tree = ast.parse(wrapped, filename=file)
    except SyntaxError as e:
        raise ExerciseError(f"{file}:{first_line - 2 + (e.lineno or 1)}: the code of exercise {ex.id} is not "
                            f"valid Python on its own ({e.msg}); a region holds whole statements, every string and "
                            f"bracket it opens closed inside it") from None
    if len(tree.body) != 1:
        raise ExerciseError(f"{file}:{first_line}: the code of exercise {ex.id} leaves its function")
    return [(ex.indent + line) if line.strip() else "" for line in code.splitlines()]


def package_files(root: Path, listed: list[str] | None) -> list[str]:
    """The instructor's package files a graded folder holds: the copy's manifest list, or what is on disk."""
    if listed is not None:
        return [f for f in listed if f.startswith(PACKAGE + "/") and (root / f).is_file()]
    return sorted(p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def spliced_folder(root: Path, submission: Path, graded: list[Exercise], listed: list[str] | None) -> Path:
    """A fresh folder holding the instructor's package with each graded region's code taken from `submission`.

    Readable by everyone and writable by no one but its owner: the children read it as an unprivileged user."""
    root, submission = Path(root), Path(submission)
    by_file: dict[str, list[Exercise]] = {}
    for ex in sorted(graded, key=lambda e: (e.file, e.line)):
        by_file.setdefault(ex.file, []).append(ex)
    texts: dict[str, str] = {}
    for rel, exercises in by_file.items():
        source = submission / rel
        try:
            submitted = source.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ExerciseError(f"the submission has no {rel}, which holds exercise{'s' * (len(exercises) > 1)} "
                                f"{', '.join(e.id for e in exercises)}; submit the package's files") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ExerciseError(f"the submission's {rel} cannot be read as UTF-8 text ({e})") from None
        mine = (root / rel).read_text(encoding="utf-8")
        from .regions import parse_regions
        in_mine = [ex for ex in parse_regions(mine, rel)]
        bodies = regions_of_submission(submitted, rel, in_mine)
        for ex in exercises:
            mine = replace_region(mine, rel, ex.id, bodies[ex.id])
        texts[rel] = mine
    folder = Path(tempfile.mkdtemp(prefix="minillm-graded-"))
    write_tree(root, folder, package_files(root, listed), texts)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder
