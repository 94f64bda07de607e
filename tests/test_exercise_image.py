"""The grading image: the README's run_autograder, run as written, as root, with `--user nobody`.

`--user nobody` works only where nobody can read Python and its packages, as on
Gradescope's image (the system Python, and setup.sh's pip install into it). So
this module builds such an interpreter, the same way on every machine: a venv
of the system Python, /usr/bin/python3, in a world-readable temporary folder,
holding copies of the packages this environment installed for the project (its
dependencies, pytest, pip and setuptools), and the copy for grading installed into it
as setup.sh does (`pip install -e`). Then it runs the README's run_autograder
as it is written, with /autograder moved into that folder. Where the machine
cannot do this (not root; no /usr/bin/python3 of this Python's version; a
temporary folder nobody cannot reach) each test fails, saying why in one line:
none skips, and none grades another way.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from minillm.classroom import access, runner
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import find_exercises

from exercise_tool_support import reference  # noqa: F401  (fixtures)
from exercise_tool_support import (HONEST, ROOT, THIEF, cheat, reference_only, restore,
                                    results_by_exercise, sign_in_folder, world_readable)

SYSTEM_PYTHON = Path("/usr/bin/python3")
PROJECT = "minillm-course"


def needs(condition: bool, why: str) -> None:
    """Fail, in one line, where the machine cannot do what the test needs."""
    if not condition:
        pytest.fail(why, pytrace=False)


def run_autograder_script() -> str:
    """The run_autograder that the README's instructor section gives, as it would be saved."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## For instructors"):], re.S).group(1)
    return "\n".join(line.removeprefix("  ") for line in block.splitlines()) + "\n"


def distributions_for(project: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions `project` needs (the dependencies its pyproject.toml names, with theirs, no
    extras: the project itself need not be installed), pytest (the checks are pytest tests, and the grader loads
    them), and pip and setuptools for the editable install."""
    import tomllib

    from packaging.requirements import Requirement
    found: dict[str, importlib.metadata.Distribution] = {}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert declared["name"] == project, declared["name"]
    needed = [Requirement(r) for r in declared.get("dependencies", [])]
    todo = [r.name for r in needed if r.marker is None or r.marker.evaluate({"extra": ""})] + ["pytest", "pip",
                                                                                               "setuptools"]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name}, which {project} needs, is not installed in this environment, so the image's "
                        f"interpreter cannot copy it; install the project's dependencies first (pip install -e .)",
                        pytrace=False)
        for r in found[name].requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


@dataclasses.dataclass
class Image:
    base: Path          # world-readable; holds everything below
    python: Path        # the venv of the system Python: its bin/python3 is what run_autograder calls
    autograder: Path    # base/autograder: source (the copy for grading, installed), submission, results

    def env(self) -> dict[str, str]:
        """A plain environment, as on the image: the venv's python3 first on PATH, nothing of this process's."""
        return {"PATH": f"{self.python / 'bin'}:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
                "MINILLM_GRADE_TIMEOUT": "120"}

    def run_autograder(self, *extra: str) -> subprocess.CompletedProcess:
        """The README's run_autograder, as written, with /autograder moved here (and `extra` grade arguments)."""
        script = run_autograder_script().replace("/autograder", str(self.autograder))
        script = script.replace(" --user nobody", " ".join(("",) + extra) + " --user nobody", 1)
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, env=self.env())

    def grade(self, tree: Path, *args: str) -> subprocess.CompletedProcess:
        """`python3 -m minillm.classroom grade ARGS`, run in `tree` with the image's interpreter."""
        return subprocess.run(["python3", "-m", "minillm.classroom", "grade", *args], cwd=tree, capture_output=True,
                              text=True, timeout=900, env=self.env())

    def install(self, tree: Path) -> None:
        """setup.sh's `pip install -e`, of `tree`, into the image's interpreter (offline: its packages are here)."""
        proc = subprocess.run([str(self.python / "bin" / "python3"), "-m", "pip", "install", "-q", "--no-deps",
                               "--no-build-isolation", "--no-index", "-e", str(tree)], capture_output=True, text=True,
                              timeout=600, env=self.env())
        needs(proc.returncode == 0, f"pip install -e {tree} failed in the image's interpreter: {proc.stderr[-500:]}")

    def results(self) -> Path:
        return self.autograder / "results" / "results.json"


@pytest.fixture(scope="module")
def image():
    """The grading image, built as the module docstring says; removed at the end."""
    needs(os.geteuid() == 0, f"needs root (uid {os.geteuid()}): run_autograder runs as root, to hand the student's "
                             f"code to nobody; run the tests as root, as CI does")
    needs(SYSTEM_PYTHON.is_file(), f"{SYSTEM_PYTHON} is missing: the image's interpreter is a venv of the system "
                                   f"Python; install python3 (and python3-venv)")
    version = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.split()
    ours = [str(n) for n in sys.version_info[:2]]
    needs(version == ours, f"{SYSTEM_PYTHON} is Python {'.'.join(version) or '?'}, this environment's packages are "
                           f"built for {'.'.join(ours)}: run the tests in a venv of {SYSTEM_PYTHON}")
    base = Path(tempfile.mkdtemp(prefix="minillm-image-"))
    try:
        base.chmod(0o755)
        needs(not access.unreadable_for("nobody", [str(base)]), f"nobody cannot reach {base}: the temporary folder "
                                                                f"{tempfile.gettempdir()} must be world-readable")
        python = base / "python"
        made = subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(python)], capture_output=True,
                              text=True)
        needs(made.returncode == 0, f"{SYSTEM_PYTHON} -m venv failed: {made.stderr.strip()[-300:]}; install python3-venv")
        site = Path(subprocess.run([str(python / "bin" / "python3"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True).stdout.strip())
        ours_site = Path(sysconfig.get_paths()["purelib"])
        tops = sorted({f.parts[0] for d in distributions_for(PROJECT) for f in d.files or []
                       if f.parts[0] not in ("..", "__pycache__") and (ours_site / f.parts[0]).exists()})
        copied = subprocess.run(["cp", "-a", "--reflink=auto", *[str(ours_site / t) for t in tops], str(site)],
                                capture_output=True, text=True)
        needs(copied.returncode == 0, f"copying the packages into the image failed: {copied.stderr[-300:]}")
        autograder = base / "autograder"
        image = Image(base, python, autograder)
        make_copy(autograder / "source", keys=True)       # what the instructor uploads: make --for-grading
        image.install(autograder / "source")
        (autograder / "results").mkdir()
        world_readable(base)
        yield image
    finally:
        shutil.rmtree(base, ignore_errors=True)


def student_copy(image: Image) -> Path:
    """A fresh student's copy, every region a stub, as the submission."""
    submission = image.autograder / "submission"
    shutil.rmtree(submission, ignore_errors=True)
    make_copy(submission)
    return submission


@reference_only
def test_run_autograder_as_written_gives_an_honest_complete_submission_full_marks(image, reference):
    """Run exactly as the README writes it, as root, with a Python nobody can read: every exercise in full."""
    submission = student_copy(image)
    for ex in find_exercises(submission):
        restore(submission, next(r for r in reference if r.id == ex.id))
    world_readable(submission)
    proc = image.run_autograder()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(next(line for line in proc.stdout.splitlines() if line.startswith("graded in")))
    results = results_by_exercise(image.results())
    short = {ex_id: t["held-out checks"]["output"][:500] for ex_id, t in results.items()
             if any(part["status"] != "passed" for part in t.values())}
    assert not short, json.dumps(short, indent=1)
    assert json.loads(image.results().read_text())["score"] == sum(ex.points for ex in reference)
    assert "without --user" not in proc.stderr + image.results().read_text()


@reference_only
def test_run_autograder_grades_only_the_regions_and_no_attack_scores(image, reference):
    """The instructor's copy as the source, a student's tree as the submission: every attack scores 0 on its own
    exercise and costs no other exercise a point; the honest ones, one with a lazy import of the standard library,
    score in full. Nothing the graded code started is alive when run_autograder returns."""
    submission = student_copy(image)
    pids = sign_in_folder()                              # nobody's lingering processes sign in here
    try:
        attacks = cheat(submission, reference, image.autograder / "source", image.results(), pids)
        assert set(attacks) | HONEST == {ex.id for ex in reference}
        world_readable(submission)
        proc = image.run_autograder("--held-out-visibility", "after_due_date")
        signed = list(pids.iterdir())
        lingering = [p.name for p in signed if Path(f"/proc/{p.name}").exists()]
    finally:
        shutil.rmtree(pids)
    raw = image.results().read_bytes()
    assert all(b < 128 for b in raw), "the results file must be ASCII"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert signed and not lingering, f"alive after the grade: {lingering}"
    results = results_by_exercise(image.results())
    for ex in reference:
        held = results[ex.id]["held-out checks"]
        want = ex.points if ex.id in HONEST else 0
        assert held["score"] == want, (f"{ex.id} ({attacks.get(ex.id, 'honest')}) scored {held['score']} of "
                                       f"{ex.points}, expected {want}:\n{held['output']}")
    outputs = {ex_id: results[ex_id]["held-out checks"]["output"] for ex_id in attacks}
    assert "transformers" in outputs["sampling-top-p"] and "off limits" in outputs["sampling-top-p"]
    assert "transformers" in outputs["prefix-match"] and "off limits" in outputs["prefix-match"]
    assert "nothing to steal" in outputs["sampling-top-k"], outputs["sampling-top-k"]
    assert "killed by signal 40" in outputs["paged-gather"]
    assert "cannot read" in outputs["kv-cache-read"]           # the forged tensors were judged, alone
    assert "the stub, after leaving a process behind" in outputs["model-heads"]
    assert "No module named 'test_ex_block_manager'" in outputs["paged-allocate"], outputs["paged-allocate"]
    visible = json.dumps([t for t in json.loads(raw)["tests"] if t["visibility"] == "visible"])
    assert "LEAKED" not in visible and "LEAKED" not in json.loads(raw)["output"]
    assert "LEAKED-FROM-A-RUN" in outputs["scheduler-preempt"]   # the instructor still sees it, after the due date
    assert json.loads(raw)["score"] == sum(ex.points for ex in reference if ex.id in HONEST)


@reference_only
def test_grading_from_the_reference_tree_refuses_or_keeps_the_answer_out_of_reach(image, reference):
    """A region that looks for the reference's own sampling.py (where the reference tree was seen, through the
    installed package, in the tree it runs in) and runs its body. Graded from a reference tree nobody can read,
    `grade` refuses, saying what to do instead; from one nobody cannot reach, the thief finds nothing; with the
    reference installed as the package, `grade` refuses again. Without --user the thief wins: that is why such a
    grade says it is only an instructor's local check."""
    ref = image.base / "reference"                      # the instructor's tree, as git tracks it
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True)
    for rel in [f for f in listed.stdout.split("\0") if f and (ROOT / f).is_file()]:
        (ref / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ref / rel)
    thief = image.base / "thief"
    make_copy(thief, only="sampling-top-k")
    (ex,) = [e for e in find_exercises(thief) if e.id == "sampling-top-k"]
    restore(thief, ex, THIEF.format(places=[str(ref), str(image.autograder / "source")]).splitlines())
    world_readable(ref)
    world_readable(thief)
    for checks in (ref / "tests" / "exercises", image.autograder / "source" / "tests" / "exercises"):
        checks.chmod(0o700)                              # private, as the README's run_autograder makes them
    results = image.base / "thief-results.json"
    args = (str(thief), "--only", "sampling-top-k", "--json", str(results))
    try:
        alone = image.grade(ref, *args)                  # without --user: a local check, and the thief wins
        assert alone.returncode == 0 and "only an instructor's local check" in alone.stderr, alone.stderr
        assert json.loads(results.read_text())["score"] == 1.0, "the thief must be able to steal where it can read"

        refused = image.grade(ref, *args, "--user", "nobody")
        said = json.loads(results.read_text())["output"]
        assert refused.returncode == 2 and f"the tree you grade from, {ref}, holds the solution of sampling-top-k" \
            in said and "--for-grading" in said and f"chmod 700 {ref}" in said, refused.stderr
        assert "without --user" not in said

        ref.chmod(0o700)                                 # out of nobody's reach: grading from it is safe
        private = image.grade(ref, *args, "--user", "nobody")
        assert private.returncode == 0, private.stdout + private.stderr
        held = results_by_exercise(results)["sampling-top-k"]["held-out checks"]
        assert held["score"] == 0 and "nothing to steal" in held["output"], held["output"]

        ref.chmod(0o755)                                 # the reference installed as the package, graded from source
        image.install(ref)
        installed = image.grade(image.autograder / "source", *args, "--user", "nobody")
        said = json.loads(results.read_text())["output"]
        assert installed.returncode == 2 and f"the installed package's tree, {ref}, holds the solution" in said, said
        assert "install that copy, not this tree" in said
    finally:
        ref.chmod(0o755)
        image.install(image.autograder / "source")
