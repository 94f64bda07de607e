"""The grade catches the wrong, not only the absent: each plausible wrong version of a region in
tests/exercises/wrong_<concept>.py scores below full marks on every one of 200 held-out draws, and a one-line
non-solution earns nothing: an exercise earns its share of points only when at least its check's `floor` (half)
of its held-out edges pass, and the non-solutions below pass fewer on every seed, though some drawn cases pass.

One process per exercise: it splices each wrong version into the reference module in turn, and judges each
seed's held-out cases with the check's own run and verify until one fails, a case whose inputs came back
changed failing as in the grader (the grader's child would send the same data: the outputs go through the same
encoding). Instructor only: `make` leaves this file out.
"""
import importlib
import json
import subprocess
import sys

import pytest

from minillm.classroom.manifest import MANIFEST
from minillm.classroom.regions import ROOT, find_exercises

sys.path.insert(0, str(ROOT / "tests" / "exercises"))


def catalogue() -> dict[str, dict[str, str]]:
    """Every exercise's wrong versions, gathered from tests/exercises/wrong_*.py."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted((ROOT / "tests" / "exercises").glob("wrong_*.py")):
        for ex_id, versions in importlib.import_module(path.stem).WRONG.items():
            assert ex_id not in found, f"{path.name}: {ex_id} is catalogued twice"
            found[ex_id] = versions
    return found


WRONG = catalogue()

SEEDS = 200
FLOOR_SEEDS = 40
pytestmark = pytest.mark.skipif((ROOT / MANIFEST).exists(), reason="a copy: the catalogue is the instructor's")

SCRIPT = r'''
import copy, importlib, json, sys, textwrap
sys.path[:0] = [ROOT, ROOT + "/tests/exercises"]
import torch
torch.set_num_threads(1)
from minillm.classroom.judge import load_checks
from minillm.classroom.regions import find_exercises, replace_region
from minillm.classroom.wire import changed_inputs, over_the_wire, to_wire
from pathlib import Path
WRONG = importlib.import_module(MODULE).WRONG
ex = next(e for e in find_exercises(Path(ROOT)) if e.id == EX)
check = load_checks(Path(ROOT))[EX]
module = importlib.import_module(ex.file[:-3].replace("/", "."))
original = (Path(ROOT) / ex.file).read_text()

def full_marks(seed):
    for inputs in check.held_out(seed).values():
        try:
            given = copy.deepcopy(inputs)
            check.verify(inputs, over_the_wire(check.run(given)))
        except Exception:
            return False
        if changed_inputs(to_wire(inputs), given):   # the grader fails a case whose inputs came back changed
            return False
    return True

found = {"reference": [s for s in range(5) if not full_marks(s)]}
for name, body in WRONG[EX].items():
    lines = [ex.indent + line if line else "" for line in textwrap.dedent(body).strip("\n").splitlines()]
    exec(compile(replace_region(original, ex.file, EX, lines), ex.file, "exec"), module.__dict__)
    found[name] = [s for s in range(SEEDS) if full_marks(s)]
print(json.dumps(found))
'''


@pytest.mark.parametrize("ex_id", sorted(WRONG))
def test_every_wrong_version_scores_below_full_marks_on_every_seed(ex_id):
    assert ex_id in {ex.id for ex in find_exercises(ROOT)}
    assert len(WRONG[ex_id]) >= 3, f"{ex_id}: the catalogue needs at least three plausible mistakes"
    module = next(p.stem for p in (ROOT / "tests" / "exercises").glob("wrong_*.py")
                  if ex_id in importlib.import_module(p.stem).WRONG)
    code = f"ROOT = {str(ROOT)!r}\nEX = {ex_id!r}\nSEEDS = {SEEDS}\nMODULE = {module!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found.pop("reference") == [], f"{ex_id}: the reference itself misses full marks"
    lucky = {name: seeds for name, seeds in found.items() if seeds}
    assert not lucky, f"{ex_id}: wrong versions with full marks on some of {SEEDS} seeds: {lucky}"


def test_every_exercise_has_a_catalogue_of_mistakes():
    missing = sorted({ex.id for ex in find_exercises(ROOT)} - set(WRONG))
    assert not missing, f"exercises with no wrong versions in tests/exercises/wrong_*.py: {missing}"


def test_no_held_out_case_is_the_same_on_two_seeds():
    """A table of answers built offline for one seed (MINILLM_GRADE_SEED fixed once) must answer no case of
    another seed's grade: every held-out case, edges included, draws its values from the seed."""
    from minillm.classroom.judge import load_checks
    from minillm.classroom.wire import to_wire

    def cases(check, seed):
        return {json.dumps(to_wire(inputs), sort_keys=True): name for name, inputs in check.held_out(seed).items()}

    repeated = {}
    for ex_id, check in load_checks(ROOT).items():
        a, b = cases(check, 1), cases(check, 2)
        same = sorted(a[key] for key in a.keys() & b.keys())
        if same:
            repeated[ex_id] = same
    assert not repeated, f"held-out cases that seeds 1 and 2 share, so a table of answers would pass them: {repeated}"


NON_SOLUTIONS = {   # exercise -> (what it is, the region's code)
    "scheduler-budget-fill": ("the parent class's policy", "return super()._plan(out)"),
    "sampling-top-p": ("greedy as top-p: only the largest logit kept",
                       "return logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values, float('-inf'))"),
    "speculative-accept": ("accept every guess",
                           "return list(draft_token_ids) + [int(torch.multinomial(target_probs[len(draft_token_ids)], "
                           "1, generator=generator))]"),
    "prefix-match": ("no block is ever cached", "return []"),
    "quantize-per-channel": ("one scale for the whole tensor",
                             "scales = (w.abs().max() / 127).expand(w.shape[0]).clone(); "
                             "q = torch.round(w / scales[:, None]).to(torch.int8)"),
}

FLOOR_SCRIPT = r'''
import copy, importlib, json, sys
sys.path[:0] = [ROOT, ROOT + "/tests/exercises"]
import torch
torch.set_num_threads(1)
from minillm.classroom.judge import load_checks
from minillm.classroom.regions import find_exercises, replace_region
from minillm.classroom.wire import changed_inputs, over_the_wire, to_wire
from pathlib import Path
ex = next(e for e in find_exercises(Path(ROOT)) if e.id == EX)
check = load_checks(Path(ROOT))[EX]
module = importlib.import_module(ex.file[:-3].replace("/", "."))
original = (Path(ROOT) / ex.file).read_text()
exec(compile(replace_region(original, ex.file, EX, [ex.indent + BODY]), ex.file, "exec"), module.__dict__)

def shares(seed):
    """The share of the held-out checks passed, and of the edges."""
    passed = {}
    for name, inputs in check.held_out(seed).items():
        try:
            given = copy.deepcopy(inputs)
            check.verify(inputs, over_the_wire(check.run(given)))
            passed[name] = not changed_inputs(to_wire(inputs), given)
        except Exception:
            passed[name] = False
    edges = [ok for name, ok in passed.items() if name.startswith("edge: ")]
    return sum(passed.values()) / len(passed), sum(edges) / len(edges)

print(json.dumps([shares(s) for s in range(SEEDS)]))
'''


@pytest.mark.parametrize("ex_id", sorted(NON_SOLUTIONS))
def test_a_one_line_non_solution_scores_nothing_on_any_seed(ex_id):
    from minillm.classroom.judge import load_checks
    what, body = NON_SOLUTIONS[ex_id]
    floor = load_checks(ROOT)[ex_id].floor
    code = f"ROOT = {str(ROOT)!r}\nEX = {ex_id!r}\nSEEDS = {FLOOR_SEEDS}\nBODY = {body!r}\n" + FLOOR_SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = json.loads(proc.stdout.splitlines()[-1])
    assert max(share for share, _ in shares) > 0, f"{ex_id} ({what}) passes no case: it shows nothing of the floor"
    over = {seed: edges for seed, (_, edges) in enumerate(shares) if edges >= floor}
    assert not over, f"{ex_id} ({what}) passes {floor:.0%} of its held-out edges or more on seeds {over}"
