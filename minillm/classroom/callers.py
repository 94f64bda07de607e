"""The code a child runs: a check's `run`, cut out of its test file with the definitions it uses, and no more.

A Check's `verify`, its oracles and the seed stay in the grader. The child gets
this source as text, with the inputs as plain data: it never imports the
tests, so a region cannot import an oracle or call `verify`, and on the grading
image tests/exercises/ can be unreadable to the student's user.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from .regions import ExerciseError

ORACLE_WORDS = ("oracle", "attend_one_query", "softmax_weights", "verify", "expected")


def _top_level(path: Path) -> tuple[list[str], dict[str, tuple[int, ast.AST]], list[ast.AST], ast.Module]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    defs: dict[str, tuple[int, ast.AST]] = {}
    imports = []
    for order, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = (order, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defs[target.id] = (order, node)
    return text.splitlines(), defs, imports, tree


def _segment(lines: list[str], node: ast.AST) -> str:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[first - 1:node.end_lineno])


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def imports_of(parsed) -> list[ast.AST]:
    return [node for _, _, imports, _ in parsed for node in imports]


def _keyed_imports(nodes: list[ast.AST]) -> set[str]:
    """The key_ and wrong_ modules (the answer keys, the catalogue of mistakes) that these definitions import."""
    found = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                found.update(alias.name for alias in n.names)
            elif isinstance(n, ast.ImportFrom):
                found.add(n.module or "")
    return {name for name in found if name.startswith(("key_", "wrong_"))}


def caller_source(check) -> str:
    """`check.run` as a module of its own: `CALLER.run(inputs)` calls the student's function and returns data.

    Refused when `run` reaches an oracle, so that no working solution ever runs beside the student's code."""
    cls = type(check)
    module = sys.modules[cls.__module__]
    test_file = Path(module.__file__)
    files = [test_file.with_name("exercise_checks.py"), test_file]
    parsed = [_top_level(f) for f in files]
    run = next((n for n in ast.walk(parsed[1][3]) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    method = next((n for n in (run.body if run else []) if isinstance(n, ast.FunctionDef) and n.name == "run"), None)
    if method is None:
        raise ExerciseError(f"{test_file.name}: {cls.__name__} has no run(inputs) of its own for the child to call")
    wanted, todo = set(), list(_names(method))
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        for _, defs, _, _ in parsed:
            if name in defs and name != "Check":
                wanted.add(name)
                todo += list(_names(defs[name][1]))
    oracles = sorted(n for n in wanted if any(w in n.lower() for w in ORACLE_WORDS))
    used = [method, *imports_of(parsed), *(defs[name][1] for _, defs, _, _ in parsed for name in wanted if name in defs)]
    oracles += sorted(_keyed_imports(used))
    if oracles:
        raise ExerciseError(f"{test_file.name}: {cls.__name__}.run uses {', '.join(oracles)}; the child that runs "
                            f"the student's code must hold no oracle: record what the code hands on instead")
    out = ["from __future__ import annotations"]
    for lines, defs, imports, _ in parsed:
        out += [_segment(lines, node) for node in imports
                if not (isinstance(node, ast.ImportFrom) and (node.module == "exercise_checks" or node.module == "__future__"))]
    for lines, defs, _, _ in parsed:
        nodes = sorted({id(node): (order, node) for name, (order, node) in defs.items() if name in wanted}.values(),
                       key=lambda x: x[0])
        out += [_segment(lines, node) for _, node in nodes]
    method_lines = parsed[1][0][method.lineno - 1 - len(method.decorator_list):method.end_lineno]
    indent = len(method_lines[0]) - len(method_lines[0].lstrip())
    out.append(f"class Caller:\n    exercise = {check.exercise!r}\n    where = {check.where!r}\n")
    out.append("\n".join("    " + line[indent:] if line.strip() else "" for line in method_lines))
    out.append("CALLER = Caller()")
    return "\n\n".join(out) + "\n"
