"""What the lesson tests share: the lessons' folder on sys.path, a lesson loaded from its file name, and its
quick run checked.

Lessons import their scaffold (`common`) by name, as a script run from `lessons/` would, and a file name that
starts with a digit is no module name, so a test loads a lesson from its path:
`lesson = load_lesson("10_stutter")`, then calls `lesson.main([...])` or its helpers, or `run_quick(lesson, ...)`.
"""
import importlib.util
import json
import sys
from pathlib import Path

from lesson_checks import assert_lesson_results

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
if str(LESSONS) not in sys.path:
    sys.path.insert(0, str(LESSONS))


def load_lesson(stem: str):
    """Import `lessons/<stem>.py` as the module `lesson_<stem>`."""
    spec = importlib.util.spec_from_file_location(f"lesson_{stem}", LESSONS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def run_quick(module, tmp_path, capsys) -> dict:
    """Run the lesson with --quick on the tiny model and the CPU; check what every lesson's run must show (its
    plot, its documented JSON, one verdict, printed after its prediction); return its results file."""
    module.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{module.NAME}.json").read_text())
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 1000
    assert doc["lesson"] == module.NAME and doc["model"] == "tiny" and doc["quick"] is True
    assert doc["weights_source"].startswith("random-init") and doc["wall_s"] > 0
    assert doc["environment"]["torch"] and doc["environment"]["dtype"] == "float32"
    v = doc["verdict"]
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE") and v["claim"] and v["checks"]
    assert v["holds"] == (v["outcome"] == "HOLDS") and "share" in v["load"]
    out = capsys.readouterr().out
    assert out.count("Verdict:") == 1  # exactly one verdict per lesson
    assert_lesson_results(doc)
    assert doc["predictions"] and out.index("prediction:") < out.index("Verdict:")
    return doc
