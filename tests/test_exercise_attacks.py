"""Attacks on the grader, each held as a test: what a submission tries, and what it must score."""
from __future__ import annotations

import json

from minillm.classroom import answers, judge as judging, wire
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import find_exercises

from exercise_tool_support import reference  # noqa: F401  (fixtures)
from exercise_tool_support import (REGION, ROOT, only_sampling_top_k_stubbed, parse, pytest_in, reference_only,
                                    region_lines, restore, results_by_exercise, run_tool)


@reference_only
def test_tampering_with_a_copys_answers_changes_no_grade(tmp_path):
    copy = only_sampling_top_k_stubbed(tmp_path)
    (ex,) = [e for e in find_exercises(copy) if e.id == "sampling-top-k"]
    restore(copy, ex, ["return logits"])                   # keeps every token...
    path = copy / answers.ANSWERS
    data = json.loads(path.read_text())
    for case, inputs in judging.load_checks(ROOT)["sampling-top-k"].visible().items():
        rows, vocab = inputs["logits"].shape                # ...and the copy's answers now say that is right
        data["exercises"]["sampling-top-k"][case] = wire.to_wire({"keep": [list(range(vocab))] * rows})
    path.write_text(json.dumps(data))
    fooled = pytest_in(copy, "tests/exercises/test_ex_sampling.py")
    assert fooled.returncode == 0 and fooled.stdout.count("PASSED") == 11, fooled.stdout[-3000:]
    proc = run_tool(ROOT, "grade", str(copy), "--only", "sampling-top-k", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")["sampling-top-k"]
    assert results["held-out checks"]["score"] == 0 and results["visible cases"]["status"] == "failed", results

def test_off_limits_names_are_found_in_the_code_not_in_its_comments():
    (ex,) = parse(REGION.replace("# hint: pop from the end", "# hint: pop from the end. Off limits: heapq, sorted."))
    assert ex.off_limits == ("heapq", "sorted")
    assert judging.forbidden_calls(ex, ["# sorted and heapq are banned", "x = 'heapq'", "return 1"]) == []
    assert judging.forbidden_calls(ex, ["import heapq", "return sorted(self.free)"]) == ["heapq", "sorted"]
    assert judging.forbidden_calls(ex, ["from transformers import TopKLogitsWarper", "return 1"]) == ["transformers"]
    assert judging.forbidden_calls(ex, ["import test_ex_pool", "return 1"]) == ["test_ex_pool"]

def test_no_region_may_import_the_answer_keys_or_the_catalogue():
    (ex,) = parse(REGION)
    assert judging.forbidden_calls(ex, ["import key_sampling", "from wrong_sampling import WRONG", "return 1"]) == \
        ["key_sampling", "wrong_sampling"]
    assert judging.forbidden_calls(ex, ["import importlib", "return importlib.import_module('key_model').f"]) == \
        ["key_model"]
    assert judging.forbidden_calls(ex, ["key_states = self.free", "wrong_way = 1", "return key_states"]) == [], \
        "a name of one's own that starts like a key module is no offence"

LINGERER = """\
import os as _os, time as _time
if _os.fork() == 0:                 # outlive the child, and forge the results once they are written
    for _ in range(300):
        _time.sleep(0.1)
        if _os.path.exists({path!r}):
            _time.sleep(0.5)
            with open({path!r}, "w") as f:
                f.write('{{"score": 25.0, "output": "forged", "tests": []}}')
            break
    _os._exit(0)
"""

@reference_only
def test_what_the_graded_code_leaves_running_is_killed_with_its_child(tmp_path, reference):
    copy = tmp_path / "lingering"
    make_copy(copy, only="sampling-top-k", keys=True)
    (ex,) = [e for e in find_exercises(copy) if e.id == "sampling-top-k"]
    results = tmp_path / "results.json"
    body = region_lines(ex, *LINGERER.format(path=str(results)).splitlines())
    restore(copy, ex, [line[len(ex.indent):] for line in body] + [line[len(ex.indent):] for line in
                                                                    next(r for r in reference if r.id == ex.id).body])
    proc = run_tool(copy, "grade", "--json", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import time
    time.sleep(2)
    assert json.loads(results.read_text())["score"] == 1.0, results.read_text()
