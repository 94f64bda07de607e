"""The answer out of reach: where the student's user could read a graded region's solution or an answer key.

While a graded region runs as `--user`, nothing that user can read may hold an
answer key, an oracle, or the code of a region being graded. Before grading,
the grader looks where such code lies on a real machine:

  * the tree it grades from (`root`): the reference holds every solution, in
    its files, its .git and its caches alike, so a tree holding the solution of
    a graded region must be out of the user's reach as a whole; a copy made
    with `make --for-grading` holds stubs, and only its checks are private;
  * the installed package, as the children's interpreter finds it: an
    editable install points back at the tree it was installed from, and a
    plain install copies that tree's code into site-packages, which the user
    must read to import torch;
  * the grader's working folder, when it holds a package;
  * every checks folder (tests/exercises, with the keys) of those trees.

The grader's own process and environment are out of reach already: the
children run as another user, in a fresh interpreter with an environment of
four variables, and only root may read a process of root's. What stays in reach
is any other file the user can read: a copy of the reference left elsewhere on
the machine is the instructor's to keep off the image.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .regions import Exercise, ExerciseError, PACKAGE, parse_regions
from .access import unreadable_for

EXERCISE_TESTS = "tests/exercises"


def installed_packages() -> list[Path]:
    """The `minillm` package folders the children's interpreter (`python -I`, started from /) would import: where
    importlib finds it (an editable install's mapping included), and any on its sys.path."""
    probe = ("import importlib.util, json, os, sys\n"
             "spec = importlib.util.find_spec('minillm')\n"
             "found = list(spec.submodule_search_locations or []) if spec else []\n"
             "found += [os.path.join(p, 'minillm') for p in sys.path if p and os.path.isdir(os.path.join(p, 'minillm'))]\n"
             "print(json.dumps(found))\n")
    proc = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd="/", timeout=120)
    if proc.returncode != 0:
        raise ExerciseError(f"{sys.executable} -I could not start ({proc.stderr.strip()[-300:]}), so the children "
                            f"could not either; grade with an interpreter that starts")
    return sorted({Path(p).resolve() for p in json.loads(proc.stdout)})


def solutions_in(tree: Path, exercises: list[Exercise]) -> list[str]:
    """The graded exercises whose region in `tree` (a project, or site-packages) holds code, not the stub."""
    found = []
    for ex in exercises:
        path = tree / ex.file
        try:
            regions = parse_regions(path.read_text(encoding="utf-8"), ex.file)
        except (OSError, UnicodeDecodeError, ExerciseError):
            continue
        if any(r.id == ex.id and not r.is_stub for r in regions):
            found.append(ex.id)
    return found


def check_out_of_reach(user: str, root: Path, exercises: list[Exercise]) -> None:
    """Refuse to grade, saying what to do instead, when `user` could read a graded region's solution or the checks
    and their answer keys: in the tree graded from, the installed package's tree, or the working folder."""
    root = Path(root).resolve()
    installed = {package.parent for package in installed_packages()}
    trees = {root: "the tree you grade from"}
    for tree in sorted(installed):
        trees.setdefault(tree, "the installed package's tree")
    cwd = Path.cwd().resolve()
    if (cwd / PACKAGE).is_dir():
        trees.setdefault(cwd, "the grader's working folder")
    problems = []
    for tree, what in trees.items():
        solved = solutions_in(tree, exercises)
        if solved and not unreadable_for(user, [str(tree)]):
            fix = ("grade in a copy made with `python -m minillm.classroom make DIR --for-grading`, whose regions "
                   "are stubs" + (", and install that copy, not this tree (pip install -e DIR)" if tree in installed
                                  else ""))
            problems.append(f"{what}, {tree}, holds the solution of {', '.join(solved)}, and {user} can read it (its "
                            f"files, its .git and its caches alike): {fix}; or keep {tree} where {user} cannot reach "
                            f"it (chmod 700 {tree})")
        checks = tree / EXERCISE_TESTS
        if checks.is_dir() and not unreadable_for(user, [str(checks)]):
            problems.append(f"{user} can read the checks and their answer keys in {checks}: make them private "
                            f"first: chmod -R go-rwx {checks}")
    if problems:
        raise ExerciseError(f"--user {user} could read the answers while its code runs, so a grade could be copied, "
                            f"not earned: " + "; ".join(problems))
