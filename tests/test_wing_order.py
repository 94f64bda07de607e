"""The wings stand in order, checkpoints < bench < serving: a wing imports the book and the wings below it, never
one above (loading knows nothing of measuring, measuring nothing of serving). The classroom stands apart: it imports
the book and checkpoints only. Imports are read from the source, at a file's top and inside its functions."""
from pathlib import Path

from test_project import ROOT, imports_of

ORDER = ("checkpoints", "bench", "serving")  # each may import those before it
MAY_IMPORT = {wing: set(ORDER[:i + 1]) for i, wing in enumerate(ORDER)} | {"classroom": {"checkpoints", "classroom"}}


def wing_of(path: Path) -> str:
    return path.relative_to(ROOT / "minillm").parts[0]


def upward(wing: str, module: str) -> bool:
    """Whether `wing` importing `module` (dotted, below `minillm`) reaches a wing it may not import."""
    target = module.split(".")[0]
    return target in MAY_IMPORT and target not in MAY_IMPORT[wing]


def test_the_rule_names_an_upward_import_and_lets_the_book_and_lower_wings_through():
    assert upward("bench", "serving.live") and upward("checkpoints", "bench.threads")
    assert upward("classroom", "bench.verdict") and upward("bench", "classroom.regions")
    assert not upward("serving", "bench.cost") and not upward("bench", "checkpoints.load")
    assert not upward("classroom", "checkpoints.load") and not upward("checkpoints", "engine")


def test_no_wing_imports_a_wing_above_it():
    files = [p for wing in MAY_IMPORT for p in sorted((ROOT / "minillm" / wing).rglob("*.py"))]
    assert {wing_of(p) for p in files} == set(MAY_IMPORT), "a wing's folder is missing"
    found = [f"{p.relative_to(ROOT)} imports minillm.{m} (a {wing_of(p)} file may import the book and "
             f"{', '.join(sorted(MAY_IMPORT[wing_of(p)]))})"
             for p in files for m in sorted(imports_of(p)[0]) if upward(wing_of(p), m)]
    assert not found, ("wings import upward (order: " + " < ".join(ORDER) + "; classroom: book and checkpoints); "
                       "move what they share down, or the file up to the wing it serves:\n" + "\n".join(found))
