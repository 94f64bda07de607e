"""Judging: the instructor's checks, the cases drawn from the seed, and the verdict on what each child sent.

Everything here runs in the grader. A child's output is decoded and judged
inside a guard of its own exercise: whatever it sent can cost that exercise
its points, never another's, and never the results file.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import sys
import textwrap
from pathlib import Path

from .answers import literal_answer
from .regions import ExerciseError, Exercise, STUB_MESSAGE
from .runner import ChildRun
from .wire import from_wire

EXERCISE_TESTS = "tests/exercises"
# No region may reach these; a name ending in "_" is a prefix (test_ex_sampling, key_sampling, wrong_sampling).
FORBIDDEN_EVERYWHERE = ("transformers", "vllm", "exercise_checks", "test_ex_", "key_", "wrong_")


def load_checks(root: Path) -> dict:
    """Every Check in the instructor's tests/exercises/, by exercise id."""
    folder = Path(root) / EXERCISE_TESTS
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    checks: dict = {}
    for path in sorted(folder.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ExerciseError(f"{path} cannot be imported: {type(e).__name__}: {e}") from None
        base = sys.modules["exercise_checks"].Check if "exercise_checks" in sys.modules else None
        for value in vars(module).values():
            if base is not None and isinstance(value, base):
                if value.exercise in checks and checks[value.exercise] is not value:
                    raise ExerciseError(f"two checks claim exercise {value.exercise}: "
                                        f"{type(checks[value.exercise]).__name__} and {type(value).__name__}")
                checks[value.exercise] = value
    return checks


EDGE = "edge: "         # how a held-out edge's name starts (exercise_checks.Check.held_out)
NO_ANSWER = object()   # a case whose answer the grader works out here, with the check's key (`verify`)


@dataclasses.dataclass
class Case:
    name: str
    inputs: dict
    held_out: bool
    answer: object = NO_ANSWER   # a student copy's literal answer (answers.py), judged with the check's `judge`


def cases_of(check, seed: int | None, answers: dict | None = None) -> list[Case]:
    """The visible cases and the held-out ones drawn from `seed`; with a copy's literal `answers` (seed None),
    the visible cases alone, each with its answer: the held-out checks need the key, which the copy lacks."""
    if answers is None:
        return ([Case(name, inputs, False) for name, inputs in check.visible().items()]
                + [Case(name, inputs, True) for name, inputs in check.held_out(seed).items()])
    return [Case(name, inputs, False, literal_answer(answers, check, name)) for name, inputs in check.visible().items()]


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


@dataclasses.dataclass
class CaseResult:
    name: str
    held_out: bool
    passed: bool
    message: str = ""


@dataclasses.dataclass
class Score:
    exercise: Exercise
    results: list[CaseResult]
    ended: str = ""
    printed: str = ""
    floor: float = 0.5   # the check's: no points unless at least this share of the held-out edges pass

    def of(self, held_out: bool) -> list[CaseResult]:
        return [r for r in self.results if r.held_out == held_out]

    @property
    def score(self) -> float:
        """The exercise's points times the share of held-out checks passed, or nothing when more than `floor` of
        its edges fail: a one-line non-solution passes some drawn cases by chance, never the edges; the visible
        cases are feedback."""
        held = self.of(True)
        if not held or not self.edges_held():
            return 0.0
        return round(self.exercise.points * sum(r.passed for r in held) / len(held), 2)

    def edges_held(self) -> bool:
        """At least `floor` of the held-out edges pass (true when there are none)."""
        edges = [r for r in self.of(True) if r.name.startswith(EDGE)]
        return not edges or sum(r.passed for r in edges) >= self.floor * len(edges)


def failed_all(ex: Exercise, cases: list[Case], why: str) -> Score:
    return Score(ex, [CaseResult(c.name, c.held_out, False, why) for c in cases], why)


def judge(ex: Exercise, check, cases: list[Case], run: ChildRun) -> Score:
    """Compare what the child sent with the expected values, case by case; the child's own words count for nothing.
    Nothing the child sent can raise out of here: the worst it can do is fail its own cases."""
    try:
        return _judge(ex, check, cases, run)
    except Exception as e:
        return failed_all(ex, cases, f"the grader could not judge what this exercise's run sent back "
                                     f"({type(e).__name__}); it counts as failed")


def _judge(ex: Exercise, check, cases: list[Case], run: ChildRun) -> Score:
    answers: dict[int, list[dict]] = {}
    stray = run.stray
    for m in run.messages:
        if "case" in m and type(m["case"]) is int and 0 <= m["case"] < len(cases):
            answers.setdefault(m["case"], []).append(m)
        elif "start" not in m:
            stray += 1
    results = []
    for i, case in enumerate(cases):
        got = answers.get(i, [])
        if not got:
            message = "never came back: the run ended early (see above)" if run.ended else "never came back"
        elif len(got) > 1:
            message = (f"came back {len(got)} times: something in the submission wrote to the grader's channel, "
                       f"so this case counts as failed")
        elif "raised" in got[0]:
            message = _raised_message(ex, got[0]["raised"])
        elif got[0].get("changed"):
            message = changed_message(check, got[0]["changed"])
        else:
            message = _verify(check, case, got[0].get("output"))
        results.append(CaseResult(case.name, case.held_out, message == "", message))
    ended = run.ended + (f"; {stray} line(s) on the grader's channel were not its messages" if stray else "")
    return Score(ex, results, ended, run.printed, check.floor)


def changed_message(check, names) -> str:
    """What a student reads when the code changed inputs it was only given to read."""
    names = [str(n)[:100] for n in names] if isinstance(names, list) else [str(names)[:100]]
    return (f"{check.where.split(', ')[-1]} changed its input{'s' * (len(names) > 1)} {', '.join(names)} in place; "
            f"the caller keeps using {'them' if len(names) > 1 else 'it'} (the engine reuses what it passes), so "
            f"leave the inputs as they were and return new values. Look at {check.where}.")


def _verify(check, case: Case, wire) -> str:
    try:
        output = from_wire(wire)
    except Exception as e:   # an out-of-range tensor raises RuntimeError in torch: any failure is the child's
        return f"the child sent data the grader cannot read ({type(e).__name__}: {str(e)[:200]})"
    try:
        if case.answer is NO_ANSWER:
            check.verify(case.inputs, output)
        else:
            check.judge(case.inputs, output, case.answer)
    except AssertionError as e:
        return str(e) or "wrong"
    except Exception as e:
        return f"the output could not be checked ({type(e).__name__}: {e}); the code returned {output!r:.300}"
    return ""


def _raised_message(ex: Exercise, raised: dict) -> str:
    if not isinstance(raised, dict):
        return "failed"
    kind, text, where = str(raised.get("type"))[:100], str(raised.get("message")), str(raised.get("where") or "")[:200]
    stub = STUB_MESSAGE.match(text) if kind == "NotImplementedError" else None
    if stub and stub["id"] == ex.id:
        return "not written yet: the stub raises NotImplementedError"
    if stub:
        return f"needs exercise {stub['id']}, still a stub (this check should not reach it: tell your instructor)"
    if kind == "SystemExit":
        return (f"the code called sys.exit({str(raised.get('exit_code'))[:50]}): a function returns its result, it "
                f"does not end the program" + (f" (at {where})" if where else ""))
    return f"{kind}: {text[:3000]}" + (f" (raised at {where})" if where else "")
