"""The README's map of the book follows the course: its rows are in the order of the lessons, each lesson
they name exists in lessons/, every concept file of minillm/ is on it, and every wing has its line."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LESSONS = {int(p.name[:2]) for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")}
DOORS = {"__init__", "__main__", "cli"}


def book_table() -> list[tuple[list[int], list[str]]]:
    """(lessons, files) per row of the book's table, lessons expanded from '05, 07–10'."""
    rows = []
    for line in README.splitlines():
        m = re.match(r"\| ([\d–, ]+) \| (`[^|]+`) \| [^|]+ \|$", line)
        if m:
            lessons = [n for a, b in re.findall(r"(\d\d)(?:–(\d\d))?", m.group(1))
                       for n in range(int(a), int(b or a) + 1)]
            rows.append((lessons, re.findall(r"`(\w+)\.py`", m.group(2))))
    return rows


def test_the_book_is_in_lesson_order_and_names_only_lessons_that_exist():
    rows = book_table()
    assert rows, "the README has no table of the book (| lesson | file | the idea |)"
    firsts = [lessons[0] for lessons, _ in rows]
    assert firsts == sorted(firsts), f"the book's table is not in lesson order: {rows}"
    for lessons, files in rows:
        assert set(lessons) <= LESSONS, f"{files} name lessons {sorted(set(lessons) - LESSONS)} that lessons/ lacks"


def test_every_concept_file_and_every_wing_is_on_the_map():
    on_map = {f for _, files in book_table() for f in files}
    concepts = {p.stem for p in (ROOT / "minillm").glob("*.py")} - DOORS
    assert concepts <= on_map, f"concept files missing from the README's table: {sorted(concepts - on_map)}"
    assert on_map <= concepts, f"the README's table names files that are not in minillm/: {sorted(on_map - concepts)}"
    wings = {p.name for p in (ROOT / "minillm").iterdir() if p.is_dir() and p.name != "__pycache__"}
    for wing in wings:
        assert re.search(rf"^\| `{wing}/` \|", README, re.M), f"the README's wings table lacks a line for {wing}/"
