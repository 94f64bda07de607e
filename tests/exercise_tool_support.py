"""What the classroom tool's tests share: the synthetic regions, the tiny git project, runs of the real tool,
and the cheats a submission tries against the grader."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from minillm.classroom import judge as judging, manifest as manifests, regions, results as report, runner
from minillm.classroom.copies import make_copy
from minillm.classroom.regions import find_exercises, parse_regions, replace_region

ROOT = regions.ROOT
IN_STUDENT_COPY = (ROOT / manifests.MANIFEST).exists()
reference_only = pytest.mark.skipif(IN_STUDENT_COPY, reason="a student copy: the tool's guarantees are checked "
                                                            "in the reference project")

REGION = '''\
class Pool:
    def take(self, n):
        """Take n blocks."""
        # >>> exercise pool-take (lesson 07, 2 pts): take n blocks off the free list
        # hint: pop from the end
        taken = self.free[-n:]
        del self.free[-n:]
        return taken
        # <<< exercise
'''


def parse(text: str) -> list[regions.Exercise]:
    return parse_regions(text, "minillm/pool.py")


TWO_REGIONS = REGION + '''
    def give(self, blocks):
        # >>> exercise pool-give (lesson 07, 1 pts): give blocks back
        # hint: the free list grows at its end
        for block in blocks:
            self.free.append(block)
        # <<< exercise
'''


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def tiny_project(tmp_path):
    """A git project: tracked files, and beside them the strays that once carried solutions into copies."""
    root = tmp_path / "ref"
    tracked = {"minillm/__init__.py": "", "minillm/pool.py": TWO_REGIONS, "tests/test_pool.py": "x = 1\n",
               "lessons/01_x.py": "print(1)\n", "README.md": "# hi\n", "pyproject.toml": "[project]\n"}
    strays = {"venv/lib/minillm/pool.py": TWO_REGIONS, "minillm/pool.py~": TWO_REGIONS, "htmlcov/pool.html": TWO_REGIONS,
              "lessons/results/run.json": "{}", "weights/gpt2/model.safetensors": "w", ".venv/bin/python": "p",
              "minillm/__pycache__/pool.pyc": "c", "notes/scratch.py": "y = 2\n"}
    for rel, text in {**tracked, **strays}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    git(root, "add", *tracked)
    return root


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


CHECK_OF_POOL = '''\
from pathlib import Path
import importlib.util
from exercise_checks import Check


class Take(Check):
    exercise = "pool-take"
    where = "minillm/pool.py, Pool.take"

    def visible(self):
        return {f"take {n} of 5": {"free": [1, 2, 3, 4, 5], "n": n} for n in (1, 2, 3)}

    def situations(self):
        return {"take some": lambda d: {"free": list(range(d.int(3, 9))), "n": d.int(1, 3)}}

    def run(self, inputs):
        path = Path(__file__).resolve().parents[2] / "minillm" / "pool.py"
        spec = importlib.util.spec_from_file_location("tiny_pool", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pool = module.Pool()
        pool.free = list(inputs["free"])
        return {"taken": pool.take(inputs["n"]), "left": pool.free}

    def expect(self, inputs):
        from key_pool import take
        return take(inputs["free"], inputs["n"])

    def judge(self, inputs, output, expected):
        assert output == expected["want"], f"expected {expected['want']}, got {output}"


TAKE = Take()
test_take = TAKE.pytest_test()
'''
KEY_OF_POOL = ("def take(free, n):\n    return {'want': {'taken': free[len(free) - n:], 'left': free[:len(free) - n]},\n"
               "            'mistakes': {'took from the front': free[:n]}}\n")


@pytest.fixture
def tiny_with_checks(tiny_project, monkeypatch):
    """The tiny project with a check of pool-take judged by expect and judge, its key in key_pool.py."""
    folder = tiny_project / "tests" / "exercises"
    folder.mkdir()
    shutil.copy(ROOT / judging.EXERCISE_TESTS / "exercise_checks.py", folder)
    (folder / "test_ex_pool.py").write_text(CHECK_OF_POOL)
    (folder / "key_pool.py").write_text(KEY_OF_POOL)
    (folder / "wrong_pool.py").write_text("WRONG = {}\n")
    git(tiny_project, "add", "tests/exercises")
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tiny_project
    for name in ("exercise_checks", "test_ex_pool", "key_pool"):   # the real checks' modules of these names return
        sys.modules.pop(name, None)


class OneCheck:
    """verify: the output must equal the input's "want"."""

    floor = 0.5

    def verify(self, inputs, output):
        assert output == inputs["want"], f"expected {inputs['want']}, got {output}"


def judged(messages, ended="", stray=0, names=None):
    (ex,) = parse(REGION)
    cases = [judging.Case(name, {"want": i}, held_out=i >= 2) for i, name in enumerate(names or [f"c{i}" for i in range(6)])]
    return judging.judge(ex, OneCheck(), cases, runner.ChildRun(messages, stray, ended, "printed this"))


def run_tool(tree: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The one command, in its documented form, `python -m minillm.classroom`, run in `tree`."""
    return subprocess.run([sys.executable, "-m", "minillm.classroom", *args], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
                          capture_output=True, text=True, timeout=900)


def restore(copy: Path, ex: regions.Exercise, body: list[str] | None = None) -> None:
    """Put a region's reference code back in a copy (or `body`, lines at the region's indentation)."""
    path = copy / ex.file
    lines = list(ex.body) if body is None else [ex.indent + line for line in body]
    path.write_text(replace_region(path.read_text(encoding="utf-8"), ex.file, ex.id, lines), encoding="utf-8")


def results_by_exercise(path: Path) -> dict[str, dict]:
    results = json.loads(path.read_text())
    assert report.results_problems(results) == [], report.results_problems(results)
    out: dict[str, dict] = {}
    for t in results["tests"]:
        ex_id, part = t["name"].split(" ")[0], t["name"].rsplit(": ", 1)[1]
        out.setdefault(ex_id, {})[part] = t
    return out


@pytest.fixture(scope="module")
def reference():
    return find_exercises(ROOT)


@pytest.fixture(scope="module")
def stubbed_copy(tmp_path_factory, reference):
    copy = tmp_path_factory.mktemp("student") / "all_stubbed"   # with the keys: grade runs in it
    assert [ex.id for ex in make_copy(copy, keys=True)] == [ex.id for ex in reference]
    return copy


def only_sampling_top_k_stubbed(tmp_path: Path) -> Path:
    copy = tmp_path / "student"
    assert [ex.id for ex in make_copy(copy, only="sampling-top-k")] == ["sampling-top-k"]
    return copy


def pytest_in(copy: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args], cwd=copy,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"})


FORGERY = """
# --- a forgery outside every region: if any process imported the package from here, it would forge the verdicts
import atexit as _atexit, json as _json, os as _os


def _forge(*_):
    try:
        with open({path!r}, "w") as f:
            _json.dump({{"score": 30.0, "output": "forged", "tests": []}}, f)
    except Exception:
        pass

_forge()
_atexit.register(_forge)
"""


THIEF = """\
import importlib.util as _util, os as _os, re as _re, sys as _sys
_places = list({places!r})                               # where the instructor's trees were once seen
_spec = _util.find_spec("minillm")                       # the graded folder, and what the installed package maps to
_places += [_os.path.dirname(p) for p in (_spec.submodule_search_locations or [])]
for _entry in [p for p in _sys.path if _os.path.isdir(p)]:
    _places.append(_entry)
    for _name in _os.listdir(_entry):                    # an editable install's finder names the tree it points at
        if _name.startswith("__editable__") and _name.endswith("finder.py"):
            _places += _re.findall(r"'minillm': '([^']+)/minillm'", open(_os.path.join(_entry, _name)).read())
for _root, _dirs, _files in _os.walk(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))):
    if "sampling.py" in _files and _root.endswith("minillm"):   # the tree it runs in
        _places.append(_os.path.dirname(_root))
for _place in _places:
    try:
        _text = open(_os.path.join(_place, "minillm", "sampling.py")).read()
    except OSError:
        continue
    _body = _text.split("# >>> exercise sampling-top-k")[1].split("# <<< exercise")[0].split(chr(10), 2)[2]
    if "NotImplementedError" in _body or "_places" in _body:
        continue
    _ns = dict(globals())
    exec("def _stolen(logits, k):" + chr(10) + _body, _ns)
    return _ns["_stolen"](logits, k)
raise RuntimeError("nothing to steal")
"""

LINGERER = """\
import os as _os, time as _time
_seen = len(_os.listdir({pids!r}))
_middle = _os.fork()
if _middle == 0:
    _os.setsid()                    # a session of its own, then a second fork: out of the grader's process group
    if _os.fork() == 0:
        open(_os.path.join({pids!r}, str(_os.getpid())), "w").close()
        _time.sleep(120)
        _os._exit(0)
    _os._exit(0)
_os.waitpid(_middle, 0)
for _ in range(200):                # the grandchild is under way before the case goes on
    if len(_os.listdir({pids!r})) > _seen:
        break
    _time.sleep(0.01)
"""


def region_lines(ex: regions.Exercise, *lines: str) -> list[str]:
    return [ex.indent + line for line in lines]


def cheat(student: Path, reference: list[regions.Exercise], source: Path, results_path: Path,
          pids: Path) -> dict[str, str]:
    """Every known attack, each against its own exercise of the student's copy; returns {exercise: the attack}.
    The copy's other exercises are left for the caller to restore honestly. The lingering processes write their
    pids into the folder `pids`."""
    by_id = {ex.id: ex for ex in find_exercises(student)}
    ref = {ex.id: ex for ex in reference}

    def put(ex_id: str, lines: list[str]) -> None:
        ex = by_id[ex_id]
        path = student / ex.file
        path.write_text(replace_region(path.read_text(), ex.file, ex_id, lines))

    init = student / "minillm" / "__init__.py"           # the -m form run as root, and module-level rebinding
    init.write_text(init.read_text() + FORGERY.format(path=str(results_path)))
    reference_prefix_match = (ROOT / "minillm" / "prefix_caching.py").read_text()
    block = reference_prefix_match[reference_prefix_match.index("def prefix_match("):]
    block = block[:block.index("\n\n\n")] if "\n\n\n" in block else block
    block = "\n".join(line for line in block.splitlines() if "# >>>" not in line and "# <<<" not in line
                      and "# hint:" not in line)
    caching = student / "minillm" / "prefix_caching.py"
    caching.write_text(caching.read_text() + "\n\n# rebinding the stub, outside its region\n" + block + "\n")
    tests = student / "tests" / "exercises" / "test_ex_sampling.py"   # the student's own judging, changed
    tests.write_text(tests.read_text() + "\nTopK.verify = lambda self, inputs, output: None\n")
    put("sampling-top-k", region_lines(by_id["sampling-top-k"], *THIEF.format(places=[str(source)]).splitlines()))
    put("model-heads", region_lines(by_id["model-heads"], *LINGERER.format(pids=str(pids)).splitlines(),
                                    "raise NotImplementedError('the stub, after leaving a process behind')"))
    put("prefix-match", region_lines(by_id["prefix-match"], "import importlib",
                                     "return importlib.import_module('transformers').prefix_match(token_ids, block_size, cached)"))
    put("sampling-top-p", region_lines(by_id["sampling-top-p"], "from transformers import TopPLogitsWarper",
                                       "return TopPLogitsWarper(p)(None, logits)"))
    put("kv-cache-write", region_lines(by_id["kv-cache-write"], 'raise ValueError("\\\\udcff")'))
    forged = '{"case": %d, "output": {"tensor": {"dtype": "int8", "shape": [1], "data": [100000]}}}\n'
    put("kv-cache-read", region_lines(by_id["kv-cache-read"], "import os",
                                      "for fd in range(3, 64):",
                                      "    try:",
                                      f"        os.write(fd, b''.join({forged!r}.encode() % i for i in range(100)))",
                                      "    except OSError:",
                                      "        pass",
                                      "os._exit(0)"))
    put("paged-allocate", region_lines(by_id["paged-allocate"], "import importlib, sys",
                                       f"sys.path.insert(0, {str(source / 'tests' / 'exercises')!r})",
                                       "oracle = importlib.import_module('test_' + 'ex_block_manager')",
                                       "return oracle.ALLOCATE.verify"))
    put("paged-free", region_lines(by_id["paged-free"], "import gc, sys",
                                   "checks = [o for o in gc.get_objects() if hasattr(type(o), 'verify')]",
                                   "frames, f = [], sys._getframe()",
                                   "while f is not None:",
                                   "    frames += [v for v in f.f_locals.values() if hasattr(type(v), 'verify')]",
                                   "    f = f.f_back",
                                   "(checks + frames)[0].verify({}, None)"))
    table = visible_and_seeded_slots(1234)
    put("paged-slot-mapping", region_lines(by_id["paged-slot-mapping"],
                                           f"return {table!r}[(tuple(block_table), start, num_tokens, block_size)]"))
    put("paged-gather", region_lines(by_id["paged-gather"], "import os", "os.kill(os.getpid(), 40)"))
    put("scheduler-preempt", region_lines(by_id["scheduler-preempt"], "print('LEAKED-FROM-A-RUN', seq.request_id, num_tokens)",
                                          "raise RuntimeError('no room')"))
    put("speculative-accept", region_lines(by_id["speculative-accept"], "import importlib.util, sys",
                                           f"sys.path.insert(0, {str(source / 'tests')!r})",
                                           f"spec = importlib.util.spec_from_file_location('t', {str(source / 'tests' / 'test_speculative.py')!r})",
                                           "t = importlib.util.module_from_spec(spec)",
                                           "spec.loader.exec_module(t)",
                                           "return t.resample_from_p(draft_token_ids, draft_probs, target_probs, generator)"))
    honest = by_id["scheduler-budget-fill"]
    put("scheduler-budget-fill", region_lines(honest, "import statistics  # a lazy import of the standard library",
                                              "assert statistics.mean([1, 3]) == 2") + list(ref[honest.id].body))
    put("model-causal-attention", list(ref["model-causal-attention"].body))
    for honest_id in ("quantize-per-channel", "scheduler-admit", "scheduler-finish"):
        put(honest_id, list(ref[honest_id].body))
    return {"model-heads": "a forged results file from the package's __init__ (the -m form, as root), and a "
                           "process that leaves its session and outlives the grade",
            "sampling-top-k": "the student's own tests/exercises changed to pass anything, and the reference's body "
                              "looked for through the installed package and the tree it runs in",
            "prefix-match": "the function rebound to a working one outside the region, and a module named by a "
                            "string: importlib.import_module('transformers')",
            "sampling-top-p": "transformers' TopPLogitsWarper", "kv-cache-write": "an exception whose message is a lone surrogate",
            "kv-cache-read": "forged channel lines holding out-of-range tensors, then os._exit",
            "paged-allocate": "importing the instructor's checks, oracles included",
            "paged-free": "looking for a Check's verify in its own process",
            "paged-slot-mapping": "a table of answers for seed 1234", "paged-gather": "os.kill with signal 40",
            "scheduler-preempt": "printing during held-out runs, hidden until the due date",
            "speculative-accept": "the acceptance rule spliced from tests/test_speculative.py"}


HONEST = {"model-causal-attention", "scheduler-budget-fill", "quantize-per-channel", "scheduler-admit",
          "scheduler-finish"}


def visible_and_seeded_slots(seed: int) -> dict:
    """slot_mapping's answers on the visible cases and seed `seed`'s held-out inputs: a table built offline."""
    from minillm.paged_attention import slot_mapping
    check = judging.load_checks(ROOT)["paged-slot-mapping"]
    cases = {**check.visible(), **check.held_out(seed)}
    return {(tuple(c["table"]), c["start"], c["num_tokens"], c["block_size"]):
            slot_mapping(list(c["table"]), c["start"], c["num_tokens"], c["block_size"]) for c in cases.values()}


def sign_in_folder() -> Path:
    """A folder that nobody may write, outside the folders the grader cleans (/run): the attacks leave their
    pids and what they saw there, for the test to read after the grade."""
    assert Path("/run").is_dir(), "/run is missing: the attacks sign in there, outside /tmp, /var/tmp and /dev/shm"
    folder = Path(tempfile.mkdtemp(dir="/run", prefix="minillm-kernel-"))
    folder.chmod(0o777)
    return folder


def world_readable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXGRP | stat.S_IXOTH if p.is_dir() else 0))


def run_autograder_script() -> str:
    """The run_autograder that the README's instructor section gives, as it would be saved."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## For instructors"):], re.S).group(1)
    return "\n".join(line.removeprefix("  ") for line in block.splitlines()) + "\n"


SUBMITTED = TWO_REGIONS.replace("        taken = self.free[-n:]\n        del self.free[-n:]\n        return taken\n",
                                "        return [self.free.pop() for _ in range(n)]\n")


