"""Off limits: what a region may not call, read from its syntax tree before it runs.

A region is graded on code the student wrote, so the check refuses, by name, what would do the exercise for it:
the names its hint and its check list, torch's fused attention kernels under any of their names, the functions of
the package that reach one of those, and another region's function. A name written as a string and handed to
something that imports or looks up by name counts as a use. What it cannot see is a name computed at run time or a
call reached through an object: the README says so, and a reader must look.
"""
from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

from .regions import Exercise

# No region may reach these; a name ending in "_" is a prefix (test_ex_sampling, key_sampling, wrong_sampling).
FORBIDDEN_EVERYWHERE = ("transformers", "vllm", "exercise_checks", "test_ex_", "key_", "wrong_")


# Attention kernels no region writes by calling: torch's fused attention under any of its names
# (F.scaled_dot_product_attention, torch.ops.aten._scaled_dot_product_flash_attention, ...), flex and varlen attention,
# torch's multi-head attention ops and the modules built on them (nn.MultiheadAttention, nn.Transformer*); a name
# holding one of these is off limits in every region.
KERNELS = ("scaled_dot_product", "scaled_dot_attention", "flash_attention", "efficient_attention", "cudnn_attention",
           "flex_attention", "varlen_attn", "multi_head_attention", "MultiheadAttention", "Transformer",
           "transformer_encoder")


def off_limits_of(ex: Exercise, check, graded: list[Exercise], root: Path) -> set[str]:
    """The names region `ex` may not use beyond what no region may: its hint's "Off limits", its check's
    `off_limits`, every function of its file that reaches one of those or a kernel (by name, within the file: a
    door planted elsewhere in the file is closed too), and the function holding every other graded region, but
    those its check's `calls` names: a region may not hand its work to another exercise's."""
    banned = set(ex.off_limits) | set(getattr(check, "off_limits", ()))
    uses: dict[str, set[str]] = {}
    try:
        tree = ast.parse((Path(root) / ex.file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            uses.setdefault(node.name, set()).update(_names_in(node))
    own = ex.function.split(".")[-1]
    reach = _reaching(uses, own, lambda n: n in banned or any(k in n for k in KERNELS))
    # a door in another file of the package: a function (a method as Class.method) that reaches this region's
    # own off-limits names (cpu_layout's attention_with_decode_by_hand); the fused kernel alone is no offence
    # there, as kv-cache-read may call model.causal_attention
    reach |= _reaching(_package_functions(Path(root)), own, lambda n: n in banned or n in reach)
    allowed = set(getattr(check, "calls", ()))   # a method as Class.method, so that `f.read()` is no offence
    others = {e.function.split(".", e.function.count(".") - 1)[-1] for e in graded
              if e.id != ex.id and e.id not in allowed}
    return banned | reach | (others - {ex.function, "<module>"})


def _reaching(uses: dict[str, set[str]], own: str, bad) -> set[str]:
    """The functions of `uses` (but `own`) that name a `bad` name, or a function that does, and so on."""
    reach: set[str] = set()
    while True:
        more = {f for f, names in uses.items() if f != own and f not in reach and any(
            bad(n) or n in reach for n in names)}
        if not more:
            return reach
        reach |= more


@functools.lru_cache(maxsize=4)
def _package_functions(root: Path) -> dict[str, set[str]]:
    """The names each module-level function of the package's files uses (cpu_layout's
    `attention_with_decode_by_hand` reaches the fused kernel), and each method's under `Class.method`: a bare
    method name (`read`, `forward`) is shared by every class."""
    uses: dict[str, set[str]] = {}
    for path in sorted((root / "minillm").rglob("*.py")):
        if "classroom" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                uses.setdefault(node.name, set()).update(_names_in(node))
            elif isinstance(node, ast.ClassDef):   # a method only as Class.method: PagedKVCache.attend(stand_in, ...)
                for method in node.body:
                    if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        uses.setdefault(f"{node.name}.{method.name}", set()).update(_names_in(method))
    return uses


def _names_in(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


IMPORTERS = ("import_module", "__import__", "find_spec", "spec_from_file_location", "import_from_path")
GETTERS = ("getattr", "hasattr", "attrgetter")


def _constant_strings(node: ast.Call) -> list[str]:
    return [a.value for a in [*node.args, *(k.value for k in node.keywords)]
            if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def forbidden_calls(ex: Exercise, body: list[str], banned: set[str] | None = None) -> list[str]:
    """The off-limits names a region's code uses: its hint's "Off limits: ..." and what no region may reach.
    Checked on the code's syntax tree, so a comment or a docstring that names one is no offence, but a name given
    as a constant string to what imports or looks up by name is: `importlib.import_module("transformers")`,
    `__import__("key_model")`, `sys.modules["transformers"]`, `getattr(torch, "topk")`, and an off-limits
    name as a string given to any call or as a subscript (`vars(F)["scaled_dot_product_attention"]`). A name
    computed at run time ("trans" + "formers") still slips through: that is for a reader of the code to catch."""
    try:
        tree = ast.parse(textwrap.dedent("\n".join(body)))
    except (SyntaxError, MemoryError, RecursionError, ValueError):   # splice.py refused it already
        return []
    used, imported, strings, keys = set(), set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
            if isinstance(node.value, ast.Name):   # KVCache.read: another region's method, reached by its class
                used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in IMPORTERS:
                imported.update(part for name in _constant_strings(node) for part in name.split("."))
            elif called in GETTERS:
                used.update(name for name in _constant_strings(node) if name.isidentifier())
                if node.args and isinstance(node.args[0], ast.Name):
                    used.update(f"{node.args[0].id}.{name}" for name in _constant_strings(node) if name.isidentifier())
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules"
              and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            imported.update(node.slice.value.split("."))
        elif isinstance(node, ast.Import):
            imported.update(part for alias in node.names for part in alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            imported.update((node.module or "").split(".") + [alias.name for alias in node.names])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            strings.add(node.value)   # importlib.import_module("key_sampling") names a module too
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):   # vars(F)["..."]
            keys.add(node.slice.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") != "print":   # F.__dict__.get("...")
            keys.update(_constant_strings(node))
    banned = set(ex.off_limits) if banned is None else banned
    # A prefix bans every module it starts (key_sampling); a name of one's own (key_states) is no offence, so
    # the answer keys' and the catalogue's prefixes are matched on what is imported, or named in a string.
    dotted = {n for n in used if "." in n}   # Class.method: matched against another region's method alone
    used -= dotted
    found = sorted(dotted & banned)
    found += sorted(n for n in used | imported if n in banned or n in FORBIDDEN_EVERYWHERE
                    or any(k in n for k in KERNELS)
                    or any(f.endswith("_") and n.startswith(f) and (n in imported or f == "test_ex_")
                           for f in FORBIDDEN_EVERYWHERE))
    found += sorted(n for n in strings - set(found) if any(f.endswith("_") and n.startswith(f)
                                                           for f in FORBIDDEN_EVERYWHERE))
    # A string that is an off-limits name, given to a call or as a subscript, looks it up, whatever does the
    # looking: vars(F)["..."], F.__dict__.get("..."), inspect.getattr_static, __getattribute__,
    # vars(KVCache)["read"] (with KVCache named); a string that only mentions one (x = "heapq") is no offence.
    keys &= strings
    found += sorted(n for n in keys - set(found) if n in banned or any(k in n for k in KERNELS))
    found += sorted(d for d in banned if "." in d and d not in found
                    and d.rsplit(".", 1)[1] in keys and d.rsplit(".", 1)[0] in used)
    return found


