"""The manifest, exercises.json: what a copy assigns, where its regions are, and which files it holds."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .regions import Exercise, ExerciseError, find_exercises

MANIFEST = "exercises.json"                  # written into each copy by `make`; `grade` reads it
MANIFEST_FORMAT = 3                          # 3: visible answers as data, answer_keys


def read_manifest(root: Path) -> dict:
    """A copy's exercises.json, checked for shape; ExerciseError says what is wrong and how to get a good one."""
    path = root / MANIFEST
    remake = "it is written by `python -m minillm.classroom make`: make the copy again from the reference"
    if not path.is_file():
        raise ExerciseError(f"{path} is missing, so this tree is not a student copy and there is nothing "
                            f"assigned to grade; {remake}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExerciseError(f"{path} is not valid JSON ({e}); {remake}") from None
    fields = {f.name for f in dataclasses.fields(Exercise)} - {"body"}
    ok = (isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and isinstance(data.get("files"), list)
          and isinstance(data.get("answer_keys"), bool)
          and all(isinstance(f, str) for f in data["files"]) and isinstance(data.get("exercises"), list)
          and all(isinstance(e, dict) and set(e) == fields | {"stubbed"} for e in data["exercises"]))
    if not ok:
        raise ExerciseError(f"{path} is not a manifest of format {MANIFEST_FORMAT} (a 'format', a 'files' list, "
                            f"'answer_keys', and 'exercises' with the fields {', '.join(sorted(fields | {'stubbed'}))}); {remake}")
    return data


def is_student_copy(root: Path) -> bool:
    """A copy made for a student: it has a manifest and no answer keys, so its held-out checks cannot run here."""
    return (Path(root) / MANIFEST).exists() and not read_manifest(Path(root)).get("answer_keys")


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


