"""What the lesson tests share: the lessons' folder on sys.path, and a lesson loaded from its file name.

Lessons import their shared modules (`common`, `measure`, `workloads`) by name, as a script run from
`lessons/` would, and a file name that starts with a digit is no module name, so a test loads a lesson
from its path: `lesson = load_lesson("07_stutter")`, then calls `lesson.main([...])` or its helpers.
"""
import importlib.util
import sys
from pathlib import Path

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
