"""The grading image: the README's run_autograder, run as written, as root, with `--user nobody`."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from minillm.classroom.copies import make_copy

from exercise_tool_support import reference  # noqa: F401  (fixtures)
from exercise_tool_support import (HONEST, cheat, nobody_cannot_run_python, reference_only, results_by_exercise,
                                    run_autograder_script, run_script, world_readable)


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
