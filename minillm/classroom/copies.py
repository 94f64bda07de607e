"""Making a copy: exactly the files git tracks, the chosen regions stubbed, and a manifest."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import subprocess
from pathlib import Path

from .answers import ANSWERS, answers_of, prose_of
from .judge import EXERCISE_TESTS, load_checks
from .leaks import find_leaks
from .manifest import MANIFEST, MANIFEST_FORMAT, read_manifest
from .regions import (PACKAGE, ROOT, Exercise, ExerciseError, find_exercises, replace_region, select,
                      write_tree)

# The answer keys (the oracles) and the catalogue of wrong versions, one step from the right ones, stay with the
# instructor: no copy holds them.
INSTRUCTOR_ONLY = ("tests/exercises/key_*.py", "tests/exercises/wrong_*.py", "tests/test_exercise_catalogue.py")
ANSWER_KEYS = "tests/exercises/key_*.py"   # the one part of them a copy for the grading image holds


def instructor_only(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pattern) for pattern in INSTRUCTOR_ONLY)


def tracked_files(root: Path, keys: bool = False) -> list[str]:
    """The files git tracks under `root` (and that exist): exactly what a copy may hold. The instructor's own files
    are left out, except, with `keys`, the answer keys that a copy for the grading image needs."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ExerciseError(f"`make` copies exactly the files git tracks, and git could not list them ({e}); "
                            f"install git and run make from a clone of the project") from None
    if proc.returncode != 0:
        raise ExerciseError(f"`make` copies exactly the files git tracks, but {root} is not a git checkout "
                            f"({proc.stderr.strip()}); run make from a clone of the project")
    return sorted(f for f in proc.stdout.split("\0")
                  if f and f not in (MANIFEST, ANSWERS) and (root / f).is_file()
                  and (not instructor_only(f) or keys and fnmatch.fnmatch(f, ANSWER_KEYS)))


def untracked_files(root: Path) -> list[str]:
    """Files of the course's folders that git does not track, and so a copy will not hold (ignored ones aside)."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--others", "--exclude-standard", "--",
                           PACKAGE, "tests", "lessons"], capture_output=True, text=True, timeout=60)
    return sorted(f for f in proc.stdout.split("\0") if f) if proc.returncode == 0 else []


def make_copy(target: Path | str, only: str | list[str] | None = None, force: bool = False,
              root: Path = ROOT, keys: bool = False) -> list[Exercise]:
    """Write a student copy of the project at `root` into `target`; returns the stubbed exercises, at their lines
    in the copy. The copy holds the visible cases' answers as literal data (answers.py), not the answer keys;
    with `keys` it is a copy for the grading image instead, which also holds them (tests/exercises/key_*.py):
    never a student's."""
    root, target = Path(root).resolve(), Path(target).resolve()
    if target == root or root.is_relative_to(target) or target.is_relative_to(root):
        raise ExerciseError(f"target {target} is inside the project or holds it; choose a folder outside {root}")
    if target.exists() and not target.is_dir():
        raise ExerciseError(f"target {target} is a file; choose a folder")
    everything = find_exercises(root)
    chosen = select(everything, only)
    files = tracked_files(root, keys)
    answers = answers_of(load_checks(root)) if (root / EXERCISE_TESTS).is_dir() else None
    leaks = find_leaks(root, chosen, [f for f in files if not instructor_only(f)],
                       {ANSWERS: prose_of(answers)} if answers is not None else None)
    if leaks:
        raise ExerciseError("a solution would leak into the copy:\n  " + "\n  ".join(leaks)
                            + "\nrewrite these to name the idea and the shape, not the expression")
    texts = _stubbed_texts(root, files, chosen)
    try:
        _clear_previous_copy(target, files, force)
        write_tree(root, target, files, texts)
        if answers is not None:
            (target / ANSWERS).write_text(json.dumps(answers) + "\n", encoding="utf-8")
    except OSError as e:
        raise ExerciseError(f"cannot write the copy into {target}: {e.strerror or e} ({e.filename or target}); "
                            f"choose a folder you can create and write") from None
    in_copy = find_exercises(target)   # the copy's line numbers: stubs are shorter than code
    stubbed = {ex.id for ex in chosen}
    manifest = {"format": MANIFEST_FORMAT, "files": files + ([ANSWERS] if answers is not None else []),
                "answer_keys": keys,
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


