"""Attacks on the grader, each held as a test: what a submission tries, and what it must score."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from minillm.classroom import answers, judge as judging, off_limits, wire
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import find_exercises

from exercise_tool_support import reference  # noqa: F401  (fixtures)
from exercise_tool_support import (REGION, ROOT, only_sampling_top_k_stubbed, parse, pytest_in, reference_only,
                                    restore, results_by_exercise, run_tool)


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
    assert off_limits.forbidden_calls(ex, ["# sorted and heapq are banned", "x = 'heapq'", "return 1"]) == []
    assert off_limits.forbidden_calls(ex, ["import heapq", "return sorted(self.free)"]) == ["heapq", "sorted"]
    assert off_limits.forbidden_calls(ex, ["from transformers import TopKLogitsWarper", "return 1"]) == ["transformers"]
    assert off_limits.forbidden_calls(ex, ["import test_ex_pool", "return 1"]) == ["test_ex_pool"]


def test_no_region_may_import_the_answer_keys_or_the_catalogue():
    (ex,) = parse(REGION)
    assert off_limits.forbidden_calls(ex, ["import key_sampling", "from wrong_sampling import WRONG", "return 1"]) == \
        ["key_sampling", "wrong_sampling"]
    assert off_limits.forbidden_calls(ex, ["import importlib", "return importlib.import_module('key_model').f"]) == \
        ["key_model"]
    assert off_limits.forbidden_calls(ex, ["key_states = self.free", "wrong_way = 1", "return key_states"]) == [], \
        "a name of one's own that starts like a key module is no offence"

ESCAPES = {  # what the region does before its first fork, and what the middle process does before the second
    "sampling-top-k": ("pass", "_os.setsid()         # a session of its own"),
    "sampling-top-p": ("pass", "_os.setpgid(0, 0)    # a process group of its own"),
    "paged-slot-mapping": ("import ctypes as _c; _c.CDLL(None).prctl(36, 0, 0, 0, 0)   # no longer a subreaper",
                           "_os.setsid()"),
}
LINGERER = """\
import os as _os, time as _time
_seen = len(_os.listdir({pids!r}))
{before}
_middle = _os.fork()
if _middle == 0:
    {escape}
    if _os.fork() == 0:             # the grandchild: outlive the exercise, and forge the results once written
        open(_os.path.join({pids!r}, str(_os.getpid())), "w").close()
        for _ in range(600):
            _time.sleep(0.1)
            if _os.path.exists({path!r}):
                with open({path!r}, "w") as _f:
                    _f.write('{{"score": 30.0, "output": "forged", "tests": []}}')
                break
        _os._exit(0)
    _os._exit(0)
_os.waitpid(_middle, 0)
for _ in range(200):                # the grandchild is under way before the case goes on
    if len(_os.listdir({pids!r})) > _seen:
        break
    _time.sleep(0.01)
"""


@reference_only
def test_nothing_the_graded_code_starts_outlives_its_exercise(tmp_path, reference):
    """A region that forks twice, the middle process leaving its session or its process group, leaves a
    grandchild the process-group kill cannot reach, one per case, that rewrites the results once they appear; one
    region first stops its process being a subreaper, so its orphans go up to the grader. Every one of them is gone
    when grade returns, and the results file is the grader's."""
    copy = tmp_path / "lingering"
    make_copy(copy, only=",".join(ESCAPES), keys=True)
    results, pids = tmp_path / "results.json", {}
    for ex in [e for e in find_exercises(copy) if e.id in ESCAPES]:
        pids[ex.id] = tmp_path / f"pids-{ex.id}"
        pids[ex.id].mkdir()
        before, escape = ESCAPES[ex.id]
        trick = LINGERER.format(pids=str(pids[ex.id]), before=before, escape=escape, path=str(results)).splitlines()
        restore(copy, ex, trick + [line[len(ex.indent):] for line in next(r for r in reference if r.id == ex.id).body])
    proc = run_tool(copy, "grade", "--json", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    started = {ex_id: [int(p.name) for p in folder.iterdir()] for ex_id, folder in pids.items()}
    alive = [pid for found in started.values() for pid in found if Path(f"/proc/{pid}").exists()]
    assert all(started.values()) and not alive, f"started {started}; alive after the grade: {alive}"
    graded = json.loads(results.read_text())
    assert graded["score"] == sum(ex.points for ex in reference if ex.id in ESCAPES), graded


@pytest.mark.parametrize("lines, named", [
    (["import importlib", "w = importlib.import_module('transformers').TopPLogitsWarper", "return w(p)(None, logits)"],
     ["transformers"]),
    (["from importlib import import_module", "return import_module('transformers.generation').x"], ["transformers"]),
    (["w = __import__('transformers')", "return w"], ["transformers"]),
    (["import sys", "return sys.modules['transformers'].TopPLogitsWarper"], ["transformers"]),
    (["import importlib.util", "return importlib.util.find_spec('key_sampling')"], ["key_sampling"]),
    (["import torch", "return getattr(torch, 'sorted')(self.free)"], ["sorted"]),
    (["import builtins", "return getattr(builtins, 'sorted')(self.free)"], ["sorted"]),
])
def test_a_name_given_as_a_string_is_checked_like_one_in_the_code(lines, named):
    """Importing or looking up an off-limits name by a constant string is using it: the name check reads the
    strings given to import_module, __import__, find_spec, sys.modules[...] and getattr."""
    (ex,) = parse(REGION.replace("# hint: pop from the end", "# hint: pop from the end. Off limits: sorted."))
    assert off_limits.forbidden_calls(ex, lines) == named


def test_a_string_that_only_mentions_a_name_is_no_offence():
    (ex,) = parse(REGION.replace("# hint: pop from the end", "# hint: pop from the end. Off limits: sorted."))
    assert off_limits.forbidden_calls(ex, ["message = 'not sorted, and transformers are not used'",
                                        "print('transformers')", "return getattr(self, 'free')"]) == []


IN_PLACE = {"sampling-top-k": "apply_top_k", "sampling-top-p": "apply_top_p"}


@reference_only
def test_a_region_that_masks_the_callers_logits_in_place_fails_and_is_told_so(tmp_path, reference):
    """Top-k and top-p that return the right tensor but mask the logits they were given: the engine reuses those,
    so the judge fails every case that masked anything, naming the input, and the visible cases say it too."""
    copy = tmp_path / "in-place"
    make_copy(copy, only=",".join(IN_PLACE), keys=True)
    for ex in [e for e in find_exercises(copy) if e.id in IN_PLACE]:
        body = next(r for r in reference if r.id == ex.id).body   # the reference, masking in place
        restore(copy, ex, [line[len(ex.indent):].replace("logits.masked_fill(", "logits.masked_fill_(") for line in body])
    proc = run_tool(copy, "grade", "--json", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = results_by_exercise(tmp_path / "results.json")
    for ex_id, function in IN_PLACE.items():
        held = results[ex_id]["held-out checks"]
        assert held["score"] == 0, held
        assert f"{function} changed its input logits in place" in held["output"], held["output"]
        assert "changed its input logits in place" in results[ex_id]["visible cases"]["output"]


DOORS = {   # exercise -> lines that hand its work to code it did not write, and the name each must be refused for
    "model-causal-attention": [
        (["return decode_attention(q, k, v, mask)"], "decode_attention"),
        (["return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True)[0]"],
         "_scaled_dot_product_attention_math"),
        (["return getattr(torch.ops.aten, '_scaled_dot_product_flash_attention')(q, k, v)[0]"],
         "_scaled_dot_product_flash_attention"),
        (["from minillm.kv_cache import KVCache", "return KVCache.read(stand_in, 0, q, k, v)"], "KVCache.read"),
        (["return getattr(KVCache, 'read')(stand_in, 0, q, k, v)"], "KVCache.read"),
        (["return CausalSelfAttention.forward(marked, q)"], "CausalSelfAttention.forward"),
        # (after reading the fix) torch's other attention kernels, and the same names looked up by a literal
        (["from torch.nn.attention.flex_attention import flex_attention", "return flex_attention(q, k, v)"],
         "flex_attention"),
        (["return torch._native_multi_head_attention(q, k, v, 8, 1, w, b, w2, b2)[0]"],
         "_native_multi_head_attention"),
        (["m = torch.nn.MultiheadAttention(8, 1)", "return m(q, k, v)[0]"], "MultiheadAttention"),
        (["from torch.nn.attention.varlen import varlen_attn", "return varlen_attn(q, k, v, c, c, T, T)"],
         "varlen_attn"),   # CUDA only, as is the next
        (["return torch._triton_scaled_dot_attention(q, k, v)"], "_triton_scaled_dot_attention"),
        (["return vars(F)['scaled_dot_product_attention'](q, k, v, is_causal=True)"],
         "scaled_dot_product_attention"),
        (["return F.__dict__.get('scaled_dot_product_attention')(q, k, v, is_causal=True)"],
         "scaled_dot_product_attention"),
        (["import inspect", "return inspect.getattr_static(F, 'causal_attention')(q, k, v)"], "causal_attention"),
        (["return object.__getattribute__(torch.ops.aten, '_scaled_dot_product_attention_math')(q, k, v)[0]"],
         "_scaled_dot_product_attention_math"),
        (["return vars(KVCache)['read'](stand_in, 0, q, k, v)"], "KVCache.read"),
        # a door in another file of the package: it calls the fused kernel for q of several queries
        (["from minillm.cpu_layout import attention_with_decode_by_hand as a", "return a(q, k, v, mask)"],
         "attention_with_decode_by_hand"),
        (["return PagedKVCache.attend(stand_in, 0, q, k, v)"], "PagedKVCache.attend"),
    ],
    "model-heads": [   # a door planted here, for another region to call
        (["if getattr(x, 'marked', False):", "    return F.scaled_dot_product_attention(x.q, x.k, x.v)"],
         "scaled_dot_product_attention"),
    ],
    "kv-cache-read": [(["return attention_by_hand(q, keys, values, mask)"], "attention_by_hand")],
}


@pytest.mark.parametrize("ex_id", sorted(DOORS))
def test_a_region_may_not_reach_attention_written_elsewhere_nor_another_regions_function(ex_id, reference):
    """Off limits beyond the hint: decode_attention (the check's own list), every fused attention op by any of its
    names, any function of the graded file that reaches an off-limits name, and the function holding another
    graded region (scheduler-budget-fill may call scheduler-preempt's _reserve: its check says so)."""
    checks = judging.load_checks(ROOT)
    ex = next(r for r in reference if r.id == ex_id)
    banned = off_limits.off_limits_of(ex, checks[ex_id], reference, ROOT)
    for lines, name in DOORS[ex_id]:
        assert name in off_limits.forbidden_calls(ex, lines, banned), (ex_id, lines)
    assert off_limits.forbidden_calls(ex, ["text = open('notes').read()", "return text"], banned) == [], \
        "a method's name on any object is no offence: only through the class of another region's method"
    for honest in reference:                               # and every reference region still passes
        allowed = off_limits.off_limits_of(honest, checks[honest.id], reference, ROOT)
        assert off_limits.forbidden_calls(honest, list(honest.body), allowed) == [], honest.id


def test_the_user_whose_processes_the_grader_kills_is_never_root_nor_its_own(capsys):
    """`--user root` (or the grader's own user) would have the end of the grade kill every process of root: refused
    before anything runs."""
    from minillm.classroom.cli import main
    assert main(["grade", "--user", "root"]) == 2
    assert "the grader's own or root's" in capsys.readouterr().err
