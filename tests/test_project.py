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


# ---- the picture of the code ---------------------------------------------------------------

TORCH_FREE = ("sequence", "block_manager", "scheduler", "chunked_prefill", "cached_blocks", "prefix_caching")


def reading_order() -> list[str]:
    """The module chain drawn in the README, bottom first."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("The picture of the code"):].split("\n\n")[1]
    return [name.strip() for name in block.replace("\n", " ").split("→")]


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(minillm modules, other top-level packages) that `module` imports, lazily or not, outside TYPE_CHECKING."""
    import ast
    tree = ast.parse((ROOT / "minillm" / f"{module}.py").read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    ours, others = set(), set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1 or name.startswith("minillm"):
                target = name.removeprefix("minillm").lstrip(".").split(".")[0]
                ours |= {target} if target else {a.name for a in node.names}
            else:
                others.add(name.split(".")[0])
        elif isinstance(node, ast.Import):
            others |= {a.name.split(".")[0] for a in node.names}
    return ours, others


def test_every_concept_file_imports_only_files_before_it():
    order = reading_order()
    assert order[0] == "config" and order[-1] == "engine" and len(order) == len(set(order))
    assert all((ROOT / "minillm" / f"{m}.py").exists() for m in order), order
    for i, module in enumerate(order):
        ours, _ = imports_of(module)
        later = ours & set(order[i:])
        assert not later, f"minillm/{module}.py imports {sorted(later)}, which the reading order puts after it"
    assert imports_of("model")[0] == {"config"}, "the model must learn nothing about caches, blocks or steps"


def test_the_scheduler_files_need_no_torch():
    for module in TORCH_FREE:
        _, others = imports_of(module)
        assert "torch" not in others, f"minillm/{module}.py imports torch"


def test_readme_installs_the_cpu_build_of_torch_first_and_ci_never_pulls_the_cuda_build():
    commands = readme_commands()
    cpu_step = next(i for i, c in enumerate(commands) if "download.pytorch.org/whl/cpu" in c)
    first_install = next(i for i, c in enumerate(commands) if "pip install -e ." in c or "pip install -q -e" in c)
    assert cpu_step < first_install, "the CPU-torch step must come before the first `pip install -e .`"
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("pip install -q torch==") < ci.index("pip install -q -e"), "CI installs the CPU torch first"
