"""The GPU check: one budgeted run, most valuable stage first, that keeps every result it reaches.

    python gpu_check.py               # on a lent GPU: stops starting stages once --budget (540 s) is spent
    python gpu_check.py --dry-run     # anywhere: the same flow on the CPU with `tiny`, CUDA-only stages skipped

The stages, in order of value, each with its estimate for an H200 (estimates
from reading the code, not yet measured; the first run's `seconds` replace them):

    correctness        pytest -m gpu tests/test_gpu_paths.py: CUDA events, memory
                       statistics, bf16/fp16 against fp32, the engine with and
                       without graphs against per-request generation        45 s
    targets gpt2-xl    batch-1 bf16 decode, graphs and eager, against the
    targets gpt2       weight-read floor and transformers' generate (eager;
                       static cache with its compilation turned off)         50 s, 20 s
    pytest -m gpu      every other gpu test                                  60 s
    bench gpt2-xl/gpt2 `python -m minillm bench ... --dtype bf16 --batch 1`  20 s, 10 s
    lessons gpt2       every lesson with --quick, one stage each             12 s each (12: 45 s)
                       (but 13: its workers need a GPU each, NCCL, and this check has one)
    compiled gpt2-xl   transformers' static-cache generate under torch.compile,
                       compiled outside the timed part, own limit            120 s
    lessons gpt2-xl    every lesson with --quick, while time remains         25 s each

A stage starts only if its estimate fits in what is left of the budget, and
runs under a limit of twice its estimate (at most what is left): an `Alarm`
(minillm/alarm.py), a BaseException that no `except Exception` swallows and
that is never raised inside a CUDA graph capture. Skipped gpt2-xl lessons are
expected; any other stage skipped, failed or stopped makes the check fail.

Everything but the pytest stages runs in this one process, and each random
model is built once: the lessons and bench get the check's model cache in
place of `random_model` (no weights are on the GPU machine).

Results go to `<out>/<gpu-name>/` (default lessons/results/reference/):
`gpu_check.json`, rewritten atomically before and after every stage, each
lesson's JSON as soon as it ends, bench's JSON and pytest's junit XML. When
the environment variable OUT is set, the same files are packed into
`$OUT/gpu_check.tar.gz` after every stage, so a kill at any point leaves
everything before it. Exit status: 0 when every stage that had to run passed,
1 otherwise, 2 without CUDA (except --dry-run).

The targets are provisional until measured; from reading the code, gpt2 is
expected at about 10–14× its floor (target 3×) and gpt2-xl at 3–4× (target 1.5×).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "lessons")]

from minillm.bench.gpu_targets import check_targets, compiled_reference, judge  # noqa: E402
from minillm.bench.alarm import Alarm, time_limit  # noqa: E402
from run_all import discover  # noqa: E402  (lessons/run_all.py: lessons by file name)

BUDGET_S = 540  # 15 lessons on gpt2 and the compiled reference, within one 10-minute command
# Packages a lesson needs beyond the GPU machine's, by the topic in its file name (`NN_<topic>.py`): where one is
# missing, the lesson is skipped and says why (lesson 12 serves over HTTP: the [serve] extra).
LESSON_NEEDS = {"goodput": ["fastapi", "uvicorn", "httpx"]}
CORRECTNESS_TESTS = "tests/test_gpu_paths.py"


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu`-marked tests. The rest need packages this machine lacks (the downloader's
    huggingface_hub 2, the server's FastAPI), so `pytest -m gpu` is given these files, never the whole folder."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]


@dataclass
class Stage:
    name: str
    estimate_s: float      # on an H200: what the budget plans with
    run: Callable[[], dict]  # the stage's result, with "ok"
    cuda_only: bool = False
    required: bool = True  # skipped for lack of time counts as a failure
    missing: tuple = ()    # packages it needs that this machine lacks: skipped, not failed


def safe_name(gpu_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gpu_name).strip("_")


def write_atomically(path: Path, text: str) -> None:
    """Write a whole new file, then rename it over the old one: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pack(results: Path, out: Path) -> Path:
    """Every result file under `results` (no plots) in one tar.gz in `out`, replaced atomically."""
    out.mkdir(parents=True, exist_ok=True)
    dest, tmp = out / "gpu_check.tar.gz", out / ".gpu_check.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(results.rglob("*")):
            if f.is_file() and f.suffix in (".json", ".xml") and not f.name.startswith("."):
                tar.add(f, arcname=str(f.relative_to(results.parent)))
    os.replace(tmp, dest)
    return dest


class ModelCache:
    """`weights.random_model`, memoised on (config, device, dtype, seed, quantization): each random model is built once per
    process, however many lessons ask for it. Its models are never modified (lessons only read them)."""

    def __init__(self, build):
        self.build, self.models, self.builds = build, {}, 0

    def __call__(self, config, device="auto", dtype="auto", seed=0, quantization=None):
        from minillm.device import resolve_device, resolve_dtype
        device = resolve_device(device)
        key = (repr(config), str(device), str(resolve_dtype(dtype, device)), seed, quantization)
        if key not in self.models:
            self.models[key] = self.build(config, device, dtype, seed, quantization)
            self.builds += 1
        return self.models[key]


@contextlib.contextmanager
def model_cache():
    """Route every random build (weights.load_model's, lessons/common.py's and lesson 03's, bench's) through
    one ModelCache for as long as the block runs."""
    import common  # lessons/common.py
    from minillm.checkpoints import load as weights
    cache, saved = ModelCache(weights.random_model), (weights.random_model, common.random_model)
    weights.random_model = common.random_model = cache  # a lesson's own `from minillm.checkpoints.load import` sees it too
    try:
        yield cache
    finally:
        weights.random_model, common.random_model = saved


def free_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def in_process(fn: Callable[[], object]) -> dict:
    """Call fn() with its output captured: ok when it returns None, 0 or a dict; the output's tail kept."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = fn()
        rc = 0 if rc is None or isinstance(rc, dict) else int(rc)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except Exception:
        rc = 1
        out.write(traceback.format_exc())
    except Alarm as e:  # not an Exception: it goes on up to the runner, with the output so far
        e.output_tail = out.getvalue()[-2000:]
        raise
    return {"ok": rc == 0, "rc": rc, "output_tail": out.getvalue()[-2000:]}


def pytest_stage(argv: list[str], junit: Path) -> dict:
    """`python -m pytest` in a process of its own (a CUDA error there cannot poison this one), with its counts."""
    proc = subprocess.run([sys.executable, "-m", "pytest", *argv, f"--junitxml={junit}", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)
    result = {"ok": proc.returncode == 0, "rc": proc.returncode, "command": " ".join(["python -m pytest", *argv]),
              "output_tail": (proc.stdout + proc.stderr)[-2000:]}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    return result


def load_lesson(path: Path):
    spec = importlib.util.spec_from_file_location(f"lesson_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lesson_stage(path: Path, argv: list[str], scratch: Path, dest: Path) -> dict:
    """One lesson in this process; its JSON copied to `dest` the moment it ends (its plot left behind)."""
    result = in_process(lambda: load_lesson(path).main([*argv, "--out", str(scratch)]))
    for f in scratch.glob(f"{path.stem}*.json"):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest / f".{f.name}.tmp")
        os.replace(dest / f".{f.name}.tmp", dest / f.name)
    return result


def missing_packages(lesson: Path) -> tuple:
    topic = lesson.stem.split("_", 1)[-1]
    return tuple(m for m in LESSON_NEEDS.get(topic, []) if importlib.util.find_spec(m) is None)


NEEDS_TWO_GPUS = {"15_disaggregation"}  # a prefill and a decode worker, a GPU each (NCCL)
SLOWER_QUICK = {"12_goodput": 45}  # its arrivals start below unchunked's predicted knee: seconds a point, 5 sweeps


def plan(device: str, models: list[str], lessons: list[Path], results: Path, scratch: Path) -> list[Stage]:
    """The stages in order of value (see the docstring for each one's estimate)."""
    import torch
    from minillm.bench import offline as bench
    from minillm.checkpoints.load import load_model
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 matmuls are emulated on a CPU: slow
    dname = "bf16" if device == "cuda" else "fp32"
    big, small = models[0], models[-1]
    small_only = ["--prompt-len", "32", "--context-len", "64"] if device != "cuda" else []  # tiny's n_ctx is 128
    stages = [Stage("correctness", 45, lambda: pytest_stage(["-m", "gpu", CORRECTNESS_TESTS],
                                                            results / "pytest_correctness.xml"))]
    sizes = ((big, 1), (small, 0)) if big != small else ((big, 1),)  # (model, which estimate)
    stages += [Stage(f"targets {m}", (20, 50)[i], lambda m=m: check_targets(m, device, dtype)) for m, i in sizes]
    stages.append(Stage("pytest -m gpu", 60, lambda: pytest_stage(
        ["-m", "gpu", *(f for f in gpu_test_files() if f != CORRECTNESS_TESTS)],
                                                                  results / "pytest_gpu.xml")))

    def run_bench(m):
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        args = parser.parse_args(["--model", m, "--device", device, "--dtype", dname, "--batch", "1",
                                  "--json", str(results / f"bench_{m}_{dname}.json"), *small_only])
        return in_process(lambda: bench.run(args))
    stages += [Stage(f"bench {m} {dname}", (10, 20)[i], lambda m=m: run_bench(m)) for m, i in sizes]

    lessons = [p for p in lessons if p.stem not in NEEDS_TWO_GPUS]

    def lessons_on(m, estimate, required):
        argv = ["--device", device, "--model", m, "--quick"]
        return [Stage(f"{p.stem} {m}", max(estimate, SLOWER_QUICK.get(p.stem, 0)),
                      lambda p=p: lesson_stage(p, argv, scratch / m, results / m),
                      required=required, missing=missing_packages(p)) for p in lessons]
    stages += lessons_on(small, 12, True)
    stages.append(Stage(f"compiled reference {big}", 120, cuda_only=True,
                        run=lambda: compiled_reference(load_model(big, device, dtype))))
    if big != small:
        stages += lessons_on(big, 25, False)
    return stages


def run_stages(stages: list[Stage], budget_s: float, on_cuda: bool, report: dict, save: Callable[[], None]) -> None:
    """Run each stage that fits in the budget under its limit, saving the report before and after each."""
    started = time.monotonic()
    for stage in stages:
        left = budget_s - (time.monotonic() - started)
        entry = {"estimate_s": stage.estimate_s, "required": stage.required}
        if stage.cuda_only and not on_cuda:
            entry.update(status="skipped", why="needs CUDA", excused=True)
        elif stage.missing:
            entry.update(status="skipped", why=f"needs {', '.join(stage.missing)}, not installed here", excused=True)
        elif left < stage.estimate_s:
            entry.update(status="skipped", why=f"time budget: needs about {stage.estimate_s:.0f} s, {left:.0f} s left")
        else:
            report["running"] = stage.name
            save()
            t0 = time.monotonic()
            limit = min(2 * stage.estimate_s, left)
            try:
                with time_limit(limit, f"stopped at its limit of {limit:.0f} s (2 × its estimate, within the budget)"):
                    result = stage.run()
                entry.update(result, status="ok" if result.get("ok", True) else "failed")
            except Alarm as e:
                entry.update(status="stopped", why=str(e), output_tail=getattr(e, "output_tail", ""))
            except Exception as e:  # record it and go on: one broken path must not hide the others
                entry.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            entry["seconds"] = round(time.monotonic() - t0, 2)
            free_memory()
        report.pop("running", None)
        report["stages"][stage.name] = entry
        save()
        print(f"[{entry['status']}] {stage.name}" + (f" ({entry['seconds']:.1f} s)" if "seconds" in entry else
                                                     f": {entry['why']}"), flush=True)


def passed(report: dict) -> bool:
    return all(s["status"] == "ok" or (s["status"] == "skipped" and (not s["required"] or s.get("excused")))
               for s in report["stages"].values())


def models_of(args) -> list[str]:
    names = [m.strip() for m in (args.models or ("tiny" if args.dry_run else "gpt2-xl,gpt2")).split(",")]
    return list(dict.fromkeys(m for m in names if m))


def print_plan(stages: list[Stage], budget_s: float) -> int:
    """Each stage with its estimate and where the budget ends, as a run that keeps to its estimates would go."""
    total = 0.0
    for stage in stages:
        fits = total + stage.estimate_s <= budget_s
        total += stage.estimate_s if fits else 0
        print(f"{stage.name}: ~{stage.estimate_s:.0f} s" + ("" if fits else "  (past the budget: skipped)")
              + (" (CUDA only)" if stage.cuda_only else ""))
    print(f"about {total:.0f} s of {budget_s:.0f} s planned; estimates for an H200, not yet measured")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="list the stages, their estimates and what the budget "
                        "fits, and run nothing")
    parser.add_argument("--dry-run", action="store_true",
                        help="the whole flow on the CPU with the tiny model; CUDA-only stages are skipped")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds of stages to start (default {BUDGET_S})")
    parser.add_argument("--models", default=None, help="comma-separated, largest first (default gpt2-xl,gpt2; "
                        "tiny with --dry-run)")
    parser.add_argument("--out", default=None, help="results folder (default lessons/results/reference, "
                        "lessons/results/dry-run with --dry-run)")
    args = parser.parse_args(argv)
    import torch
    on_cuda = torch.cuda.is_available() and not args.dry_run
    if args.plan:
        return print_plan(plan("cuda" if not args.dry_run else "cpu", models_of(args), discover(), Path("."), Path(".")),
                          args.budget)
    if not on_cuda and not args.dry_run:
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "This check needs an NVIDIA GPU; `python gpu_check.py --dry-run` runs its flow on the CPU.",
              file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the pytest stages too: a dry run is the CPU's, wherever it runs
    models = models_of(args)
    out = Path(args.out or ROOT / "lessons" / "results" / ("dry-run" if args.dry_run else "reference"))
    name = safe_name(torch.cuda.get_device_name(0)) if on_cuda else "cpu"
    results = out / name
    results.mkdir(parents=True, exist_ok=True)
    from minillm.bench.timing import environment
    report = {"gpu": name, "dry_run": args.dry_run, "budget_s": args.budget, "models": models,
              "environment": environment("cuda" if on_cuda else "cpu", torch.float32), "stages": {}}
    packed = os.environ.get("OUT")

    def save():
        write_atomically(results / "gpu_check.json", json.dumps(report, indent=2, default=str) + "\n")
        if packed:
            pack(results, Path(packed))

    started = time.monotonic()
    with model_cache() as cache, tempfile.TemporaryDirectory() as scratch:
        stages = plan("cuda" if on_cuda else "cpu", models, discover(), results, Path(scratch))
        report["plan"] = [{"stage": s.name, "estimate_s": s.estimate_s} for s in stages]
        run_stages(stages, args.budget, on_cuda, report, save)
        report["random_models_built"] = cache.builds
    report["targets"] = judge({m: report["stages"].get(f"targets {m}", {}) for m in models},
                              report["stages"].get(f"compiled reference {models[0]}", {}))
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["ok"] = passed(report)
    save()
    for label, t in report["targets"].items():
        met = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"{label}: {t['value']}" + ("" if t["bound"] is None else
              f" ({t['kind']} {t['bound']}, provisional" + (f"; estimated {t['estimate']}" if t["estimate"] else "")
              + f"): {met}"))
    print(f"\n{'PASSED' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s; results in {results}"
          + (f", packed in {packed}/gpu_check.tar.gz" if packed else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
