"""The project's own promises: CI runs exactly the README's test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = next(c for c in readme_commands() if "pytest" in c)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f".ci/run must run the README's test command verbatim: {test_cmd!r}"


def test_results_and_weights_are_ignored():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "weights/" in ignored and "lessons/results/*" in ignored
