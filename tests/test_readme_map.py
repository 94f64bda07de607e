"""The README's module table follows the course: its rows are in the order of the lessons, each lesson
they name exists in lessons/, and every module of minillm/ is on it. (The picture below it is in import
order, which tests/test_project.py holds.)"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LESSONS = {int(p.name[:2]) for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")}


def table() -> list[tuple[list[str], list[int]]]:
    """(modules, lessons) per row of the module table, lessons expanded from '05, 07–10'."""
    rows = []
    for line in README.splitlines():
        m = re.match(r"\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|$", line)
        if not m:
            continue
        modules = re.findall(r"`(\w+)\.py`", m.group(1))
        lessons = []
        for a, b in re.findall(r"(\d\d)(?:–(\d\d))?", m.group(2)):
            lessons.extend(range(int(a), int(b or a) + 1))
        rows.append((modules, lessons))
    return rows


def test_the_table_is_in_lesson_order_and_names_only_lessons_that_exist():
    taught = [(modules, lessons) for modules, lessons in table() if lessons]
    firsts = [lessons[0] for _, lessons in taught]
    assert firsts == sorted(firsts), f"the module table is not in lesson order: {taught}"
    for modules, lessons in taught:
        assert set(lessons) <= LESSONS, f"{modules} name lessons {sorted(set(lessons) - LESSONS)} that lessons/ lacks"


def test_every_module_is_on_the_map():
    on_map = {m for modules, _ in table() for m in modules}
    files = {p.stem for p in (ROOT / "minillm").glob("*.py")} - {"__init__", "__main__", "bench", "metrics", "cli_flags"}
    assert files <= on_map, f"modules missing from the README's table: {sorted(files - on_map)}"
