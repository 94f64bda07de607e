"""The project's text keeps its rooms: the READMEs say what minillm is and how to run it, measurements live
under docs/ (each with its command and machine), and the book's docstrings carry the idea, the cost and the
invariant, never a machine, a date or an issue number.

    README.md ≤ 300 lines, lessons/README.md ≤ 200
    no "issue <n>" in the project's text; no CPU model or date in a docstring of minillm/ or lessons/
    every .py file in minillm/ and lessons/ ≤ 320 lines
    every link from README.md into docs/ names a file that exists, and every page of docs/ is linked
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX, LESSONS_README_MAX, PY_MAX = 300, 200, 320

# The word for a tracker's entry followed by its number, with or without "#" (the cases are spelled out in
# test_the_rules_catch_what_they_are_for); not a word that merely contains it, nor a link to an upstream bug
# (".../issues/NNN/"), which cites its source.
ISSUE = re.compile(r"\b(?:issues?|pull requests?|PRs?)\s*#?\s*\d+\b", re.I)
CPU_MODEL = re.compile(r"\b(?:EPYC|Xeon|Zen ?\d|Sapphire Rapids|Ryzen|Core i\d)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
TEXT = {".py", ".md", ".html", ".js", ".css", ".txt", ".toml", ".json", ".cfg", ".sh", ".jinja", ".j2"}
SKIP = {"__pycache__", "results", ".venv", ".git", "weights"}


def project_text_files() -> list[Path]:
    """README.md, docs/, minillm/, lessons/, tests/, gpu_check.py and weights_download.py: the project's own text."""
    files = [ROOT / "README.md", ROOT / "gpu_check.py", ROOT / "weights_download.py"]
    for folder in ("docs", "minillm", "lessons", "tests"):
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in TEXT and not SKIP & set(p.relative_to(ROOT).parts)]
    return sorted(files)


def py_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")
                  if not SKIP & set(p.relative_to(ROOT).parts))


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's docstring and of every class's and function's in it."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def readme_links_into_docs() -> list[str]:
    """Every path under docs/ that README.md links ([text](docs/x.md#part)) or names (`docs/x.md`)."""
    text = (ROOT / "README.md").read_text()
    linked = re.findall(r"\]\((docs/[^)#\s]*)(?:#[^)]*)?\)", text)
    named = re.findall(r"(?<![\w/])(docs/[\w./-]*\w)", text)
    return sorted(set(linked) | set(named))


def test_the_rules_catch_what_they_are_for():
    issue, pr, number = "iss" + "ue", "P" + "R", "3" + "4"   # spelled in parts, so that this file passes its own scan
    for bad in (f"{issue} {number}", f"{issue.title()}s #{number}", f"{issue}#{number}", f"{pr} #{number}",
                f"pull request {number}"):
        assert ISSUE.search(bad), bad
    for fine in ("tissue 3", f"{issue}d 2 warnings", f"https://github.com/pytorch/pytorch/{issue}s/193402",
                 f"the {issue} is the 2 threads"):
        assert not ISSUE.search(fine), fine
    assert CPU_MODEL.search("on the 2-core AMD EPYC") and CPU_MODEL.search("Zen 4") and CPU_MODEL.search("Core i7")
    assert not CPU_MODEL.search("zero-copy Xenial frozen") and DATE.search("(2026-12-04, 18:55 UTC)")
    assert len(project_text_files()) > 100 and ROOT / "tests" / "test_docs.py" in project_text_files()


def test_the_readmes_are_short():
    over = {f"{path.relative_to(ROOT)}: {n} lines, over {limit}"
            for path, limit in ((ROOT / "README.md", README_MAX), (ROOT / "lessons" / "README.md", LESSONS_README_MAX))
            if (n := len(path.read_text().splitlines())) > limit}
    assert not over, (f"{sorted(over)}: move measurements to docs/ (with their command and machine), and "
                      "reference prose to a page there")


def test_no_issue_numbers_in_the_projects_text():
    hits = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in project_text_files()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) for m in ISSUE.finditer(line)]
    assert not hits, ("issue numbers in the project's text (say what the aim is, not which ticket asked for it):\n"
                      + "\n".join(hits))


def test_no_docstring_of_the_book_or_the_lessons_names_a_machine_or_a_date():
    hits = sorted({f"{p.relative_to(ROOT)}:{line}: {m.group(0)!r}" for p in py_files("minillm", "lessons")
                   for line, doc in docstrings(p) for rx in (CPU_MODEL, DATE) for m in rx.finditer(doc)})
    assert not hits, ("docstrings that name a CPU model or a date (a measurement belongs in docs/, with its "
                      "command and machine; a docstring keeps the idea, the cost and the invariant):\n"
                      + "\n".join(hits))


@pytest.mark.parametrize("folder", ["minillm", "lessons"])
def test_every_python_file_is_at_most_320_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in py_files(folder) if (n := len(p.read_text().splitlines())) > PY_MAX}
    assert not long, f"files over {PY_MAX} lines (split them by role): {long}"


def test_every_link_from_the_readme_into_docs_resolves_and_every_page_is_linked():
    links = readme_links_into_docs()
    assert links, "README.md links nothing under docs/, where the measurements live"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README.md links into docs/ to files that do not exist: {missing}"
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    unlinked = sorted(pages - set(links))
    assert not unlinked, f"pages of docs/ that README.md never links, so no reader finds them: {unlinked}"


def test_every_relative_link_in_docs_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in sorted((ROOT / "docs").rglob("*.md"))
              for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, f"links in docs/ to files that do not exist: {broken}"
