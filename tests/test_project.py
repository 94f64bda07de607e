"""The project's own promises: CI runs exactly the README's test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = next(c for c in readme_commands() if "pytest" in c)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f".ci/run must run the README's test command verbatim: {test_cmd!r}"


def test_results_and_weights_are_ignored():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "weights/" in ignored and "lessons/results/*" in ignored


# ---- the book and its wings ----------------------------------------------------------------

WINGS = ("serving", "bench", "checkpoints", "classroom")
DOORS = ("__init__", "__main__", "cli")  # the ways in: they may open any wing
TORCH_FREE = ("sampling_params", "sequence", "block_manager", "scheduler", "chunked_prefill", "cached_blocks",
              "prefix_caching", "parallel_sampling")


def book() -> list[str]:
    """The concept files: every module directly in minillm/ but the doors."""
    return sorted(p.stem for p in (ROOT / "minillm").glob("*.py") if p.stem not in DOORS)


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(minillm modules as dotted names below `minillm`, other top-level packages) that the file at `path` imports,
    at its top or inside a function, outside TYPE_CHECKING."""
    import ast
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    package = path.relative_to(ROOT).parent.parts  # ("minillm",) or ("minillm", "bench"), ...
    ours, others = set(), set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ()))
            else:
                base = node.module or ""
            if base == "minillm" or base.startswith("minillm."):
                below = base.removeprefix("minillm").lstrip(".")
                ours |= {below} if below else {a.name for a in node.names}
            else:
                others.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("minillm."):
                    ours.add(a.name.removeprefix("minillm."))
                else:
                    others.add(a.name.split(".")[0])
    return ours, others


def test_minillm_holds_the_book_four_wings_and_its_doors():
    entries = {p.name for p in (ROOT / "minillm").iterdir() if p.name != "__pycache__"}
    folders = {name for name in entries if (ROOT / "minillm" / name).is_dir()}
    assert folders == set(WINGS), f"minillm/ holds the book and the wings {WINGS}, not {sorted(folders)}"
    assert entries - folders == {f"{m}.py" for m in book() + list(DOORS)}


def test_no_book_file_imports_a_wing():
    for module in book():
        ours, _ = imports_of(ROOT / "minillm" / f"{module}.py")
        wings = {m for m in ours if m.split(".")[0] in WINGS}
        assert not wings, f"minillm/{module}.py imports {sorted(wings)}: the book never imports a wing"


def test_the_book_has_no_import_cycle_and_the_model_knows_only_its_config():
    graph = {m: {i.split(".")[0] for i in imports_of(ROOT / "minillm" / f"{m}.py")[0]} & set(book()) for m in book()}
    done, path = set(), []

    def visit(m):
        assert m not in path, f"an import cycle in the book: {' → '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)
    for m in book():
        visit(m)
    assert graph["model"] == {"config"}, "the model must learn nothing about caches, blocks or steps"
    assert graph["cpu_layout"] <= {"model", "config", "device"}, "a layout swaps modules: it knows no cache or step"
    assert graph["quantize"] <= {"model", "config"}, "int8 weights are modules swapped in: the model and its config"


def test_the_scheduler_side_needs_no_torch_all_the_way_down():
    """A torch-free file imports only torch-free files: followed through every import, not one level."""
    for start in TORCH_FREE:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            ours, others = imports_of(ROOT / "minillm" / f"{module}.py")
            assert not {"torch", "numpy"} & others, f"minillm/{start}.py reaches torch or numpy through {module}.py"
            todo += [m.split(".")[0] for m in ours]


def test_readme_installs_the_cpu_build_of_torch_first_and_ci_never_pulls_the_cuda_build():
    text = "\n".join(readme_commands())
    cpu_step = text.index("download.pytorch.org/whl/cpu")
    first_install = min(text.index(s) for s in ("pip install -e .", "pip install -q -e") if s in text)
    assert cpu_step < first_install, "the CPU-torch step must come before the first `pip install -e .`"
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("pip install -q torch==") < ci.index("pip install -q -e"), "CI installs the CPU torch first"
