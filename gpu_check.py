"""The GPU check: one command that exercises every CUDA-specific path and records reference results.

    python gpu_check.py              # on a machine with an NVIDIA GPU; stops itself after BUDGET_S
    python gpu_check.py --dry-run    # anywhere: print the plan, run nothing

Everything runs in this one process, so CUDA starts once and each model is
built once (a random init of gpt2-xl takes a while); only `pytest -m gpu`
runs in a process of its own. In order:

1. CUDA events and memory statistics: `metrics.time_fn` and `Stopwatch` time
   with events; the allocator's delta for a tensor and a `KVCache` equals their bytes.
2. bf16 and fp16: a gpt2-shaped model's logits in each agree with fp32 within
   the dtype's tolerance; the measured ceilings in every dtype.
3. The engine (gpt2 shape, fp32): with CUDA graphs and with enforce_eager,
   prefill-first and chunked, every request gets the greedy tokens of
   `kv_cache.generate`; two engines sized from gpu_memory_utilization one after
   the other both get their pool (the failure of the first GPU run), and
   `close()` hands the memory back.
4. The targets of the GPU path, per model (gpt2, gpt2-xl), bf16, batch 1: the
   time per decoded token with CUDA graphs and eager, against the weight-read
   floor (weight bytes ÷ measured bandwidth), and against transformers'
   `GPT2LMHeadModel.generate` on the same weights and prompt, eager and with its
   static cache; ops dispatched per step. Targets: gpt2-xl with graphs within
   1.5× of the floor, gpt2 within 3×; gpt2-xl with graphs ≥ 3× faster than the
   reference's eager generate and not slower than its static cache.
5. `python -m pytest -m gpu` (a subprocess).
6. `bench` for each model in bf16 at batch 1.
7. Every lesson (found by file name, `lessons/NN_*.py`) with `--device cuda`,
   on each model's shape (random init: time and memory do not depend on values).

Results are small JSON files under `lessons/results/reference/<gpu-name>/`
(plots are left out), and `gpu_check.json` with every check, every run and
the targets, each with its measured value and whether it was met. A run still
going when the budget ends is stopped, and runs not yet started are skipped;
both count as failures. Exit status 0 when every check passed, every run
finished and every target was met; 1 otherwise; 2 when there is no CUDA device.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lessons"))

from run_all import discover  # noqa: E402  (lessons/run_all.py: lessons by file name)

MODELS = ["gpt2", "gpt2-xl"]
BUDGET_S = 7.5 * 60        # the whole check ends by then: nothing starts after it, and no run's limit reaches past it
RUN_TIMEOUT_S = 150        # one lesson, one bench, the gpu tests
# Extra flags for a lesson, by the topic in its file name (`NN_<topic>.py`), e.g. {"fragmentation": ["--requests", "64"]}.
LESSON_ARGS: dict[str, list[str]] = {}
TARGETS = {  # (model, figure): (bound, "max" if the figure must stay at or below it, "min" if at or above)
    ("gpt2-xl", "graph_times_floor"): (1.5, "max"),
    ("gpt2", "graph_times_floor"): (3.0, "max"),
    ("gpt2-xl", "speedup_vs_reference_eager"): (3.0, "min"),
    ("gpt2-xl", "speedup_vs_reference_static"): (1.0, "min"),
}
PROMPT_LEN, SHORT, LONG = 32, 16, 144  # decode time per token = (time(LONG) − time(SHORT)) / (LONG − SHORT)


def safe_name(gpu_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gpu_name).strip("_")


def topic(lesson: Path) -> str:
    return lesson.stem.split("_", 1)[1] if "_" in lesson.stem else lesson.stem


def plan(lessons: list[Path], models: list[str], quick: bool) -> list[tuple[str, str, list[str]]]:
    """(label, kind, argv) of every run after the in-process checks, in order, model by model (so each model
    is built once); kind is bench, pytest or a lesson's path."""
    steps = [("pytest -m gpu", "pytest", ["-m", "gpu", "-q"])]
    for model in models:
        steps.append((f"bench {model} bf16", "bench",
                      ["--model", model, "--device", "cuda", "--dtype", "bf16", "--batch", "1"]))
        for path in lessons:
            argv = ["--device", "cuda", "--model", model, *LESSON_ARGS.get(topic(path), [])]
            steps.append((f"{path.stem} {model}", str(path), argv + (["--quick"] if quick else [])))
    return steps


def command_line(kind: str, argv: list[str]) -> str:
    """The shell command a run is equivalent to (the check itself runs lessons and bench in-process)."""
    if kind == "pytest":
        return " ".join(["python -m pytest", *argv])
    if kind == "bench":
        return " ".join(["python -m minillm bench", *argv])
    return " ".join(["python", str(Path(kind).relative_to(ROOT)), *argv])


# ---- one process: models built once, runs bounded by an alarm -------------------------------------


class ModelCache:
    """load_model, memoised on (name, device, dtype), holding one model at a time: a lesson after another on
    the same shape reuses it, and a new shape frees the old one first."""

    def __init__(self, load_model):
        self.load_model, self.key, self.model = load_model, None, None

    def __call__(self, name, device="auto", dtype="auto", *args, **kwargs):
        from minillm.weights import resolve_device, resolve_dtype
        device = resolve_device(device)
        key = (str(name), str(device), str(resolve_dtype(dtype, device)),  # the defaults (None) do not tell calls apart
               tuple(a for a in args if a is not None), tuple(sorted(i for i in kwargs.items() if i[1] is not None)))
        if key != self.key:
            self.model = self.key = None
            free_memory()
            self.model, self.key = self.load_model(name, device, dtype, *args, **kwargs), key
        return self.model


def free_memory() -> None:
    import torch
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in this (main) thread after `seconds`."""
    def stop(signum, frame):
        raise TimeoutError(f"stopped after {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_in_process(fn, timeout: float) -> tuple[int, str]:
    """Call fn() with its output captured; (0, output) on success, (124, ...) past the limit, (1, ...) on error."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), time_limit(timeout):
            rc = fn()
        rc = 0 if rc in (None, 0) or isinstance(rc, dict) else int(rc)
    except TimeoutError as e:
        rc = 124
        out.write(f"\n{e} (limits: {RUN_TIMEOUT_S} s per run, {BUDGET_S:.0f} s for the check; see gpu_check.py)")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except Exception:
        rc = 1
        out.write(traceback.format_exc())
    free_memory()
    return rc, out.getvalue()


def run_bench(bench_module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench_module.add_arguments(parser)
    return bench_module.run(parser.parse_args(argv))


def load_lesson(path: Path):
    spec = importlib.util.spec_from_file_location(f"lesson_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- in-process checks ------------------------------------------------------------


def check_events(torch, metrics) -> dict:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = metrics.time_fn(lambda: a @ a, "cuda", warmup=2, repeats=5)
    watch = metrics.Stopwatch("cuda")
    watch.start()
    for _ in range(3):
        a @ a
        watch.lap()
    laps = watch.laps_s()
    ok = t.method == "cuda-events" and t.median_s > 0 and len(laps) == 3 and all(x > 0 for x in laps)
    return {"ok": ok, "matmul_median_s": t.median_s, "method": t.method, "laps_s": laps}


def check_memory(torch, metrics) -> dict:
    from minillm.config import PRESETS
    from minillm.kv_cache import KVCache
    torch.cuda.synchronize()
    metrics.reset_peak_memory("cuda")
    before = torch.cuda.memory_allocated()
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
    delta_tensor = torch.cuda.memory_allocated() - before
    y = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    del y
    peak = metrics.cuda_memory("cuda")["peak_allocated"] - before
    del x
    cfg = PRESETS["gpt2-xl"]
    before = torch.cuda.memory_allocated()
    cache = KVCache(cfg, 2, 1024, "cuda", torch.bfloat16)
    delta_cache = torch.cuda.memory_allocated() - before
    formula = 2 * 1024 * cfg.kv_bytes_per_token(torch.bfloat16)
    ok = delta_tensor == 64 << 20 and peak >= 96 << 20 and delta_cache == cache.nbytes == formula
    del cache
    return {"ok": ok, "tensor_delta": delta_tensor, "peak_delta": peak, "kv_cache_delta": delta_cache,
            "kv_cache_formula": formula}


def check_dtypes(torch, metrics, models) -> dict:
    from minillm import kv_cache, naive_decode
    from minillm.sampling import SamplingParams
    ids = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        ref_logits = models("gpt2", "cuda", torch.float32)(ids)[0, -1].float()
    out = {"ok": True}
    prompt = ids[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for name, dtype, tol in (("bf16", torch.bfloat16, 5e-2), ("fp16", torch.float16, 5e-2)):
        model = models("gpt2", "cuda", dtype)
        with torch.inference_mode():
            logits = model(ids)[0, -1].float()
        err = (logits - ref_logits).abs().max().item()
        scale = max(1.0, ref_logits.abs().max().item())
        cached = kv_cache.generate(model, [prompt], params)[0]
        naive = naive_decode.generate(model, prompt, params)
        same = sum(a == b for a, b in zip(cached, naive))
        ceil = metrics.measure_ceilings("cuda", dtype)
        ok = err <= tol * scale and bool(torch.isfinite(logits).all())
        out[name] = {"ok": ok, "max_abs_logit_err_vs_fp32": err, "tolerance": tol * scale,
                     "greedy_tokens_identical_to_naive": f"{same}/{len(naive)}", "ceilings": ceil.as_dict()}
        out["ok"] &= ok
    out["fp32_ceilings"] = metrics.measure_ceilings("cuda", torch.float32).as_dict()
    return out


def check_engine(torch) -> dict:
    """LLMEngine on CUDA, graphs and eager: greedy tokens equal per-request generation; two engines sized from
    gpu_memory_utilization in a row both get their pool; close() gives the memory back."""
    from minillm import kv_cache
    from minillm.config import PRESETS
    from minillm.engine import LLMEngine
    from minillm.sampling import SamplingParams
    from minillm.scheduler import SchedulerConfig
    from minillm.weights import random_model
    cfg = PRESETS["gpt2"]
    # fp32, and the init of the tests' context model (std 0.3): tokens that depend on their context.
    model = random_model(cfg, "cuda", torch.float32)
    model.init_weights(0, std=0.3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 16, 17, 100, 300, 700)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (24, 3, 40, 9, 17, 30)]
    want = [kv_cache.generate(model, [p], sp)[0] for p, sp in zip(prompts, params)]
    out = {"ok": True}
    for label, config, eager in (("prefill-first graphs", SchedulerConfig(2048, 8, enable_chunked_prefill=False), False),
                                 ("chunked-64 graphs", SchedulerConfig(64, 8), False),
                                 ("chunked-64 eager", SchedulerConfig(64, 8), True)):
        t0 = time.perf_counter()
        with LLMEngine(model, config, gpu_memory_utilization=0.4, enforce_eager=eager) as engine:
            built = time.perf_counter() - t0
            got = [o.output_token_ids for o in engine.generate(prompts, params)]
            engine.check_invariants()
            ok = got == want and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            out[label] = {"ok": ok, "num_blocks": engine.block_manager.num_blocks, "steps": len(engine.timeline),
                          "graphs": len(engine.decoder.graphs), "build_s": built, "memory": engine.memory,
                          "identical_requests": f"{sum(a == b for a, b in zip(got, want))}/{len(want)}"}
        out["ok"] &= ok
    blocks = [out[k]["num_blocks"] for k in out if k != "ok"]
    out["pools_in_a_row_within_10pct"] = max(blocks) <= 1.1 * min(blocks)
    reserved = torch.cuda.memory_reserved()
    out["reserved_after_close_bytes"] = reserved
    out["ok"] &= out["pools_in_a_row_within_10pct"]
    return out


def decode_time_per_token(generate, sync, short: int = SHORT, long: int = LONG, repeats: int = 3) -> float:
    """Seconds per decoded token: the median time to generate `long` tokens, less that of `short`, over the
    difference, so the prefill and the setup cancel out."""
    def timed(n):
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            generate(n)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    generate(short)  # warm-up
    return (timed(long) - timed(short)) / (long - short)


def check_targets(torch, metrics, models, name: str, device: str = "cuda", dtype=None,
                  short: int = SHORT, long: int = LONG) -> dict:
    """Batch-1 decode of `name` (bf16 on CUDA): minillm with graphs and eager against the weight-read floor, and
    against transformers' generate (eager and static cache) on the same weights and prompt. Off CUDA (the
    tests) the "graph" engine decodes eagerly and the op count uses the static step instead of a replay."""
    from minillm.cuda_graphs import DecodeRunner
    from minillm.engine import LLMEngine
    from minillm.kv_cache import KVCache, Segment
    from minillm.sampling import SamplingParams
    from minillm.scheduler import SchedulerConfig
    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    model = models(name, device, dtype)  # GPT-2's own init: time does not depend on the values
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    sync = lambda: metrics.synchronize(device)  # noqa: E731
    bandwidth = metrics.measure_ceilings(device, dtype, quick=device.type != "cuda").bandwidth
    floor = metrics.weight_read_floor(cfg, dtype, bandwidth)
    result = {"dtype": str(dtype), "prompt_len": PROMPT_LEN, "tokens": [short, long], "bandwidth": bandwidth,
              "weight_read_floor_s": floor}
    tokens = {}
    for label, eager in (("graph", False), ("eager", True)):
        with LLMEngine(model, SchedulerConfig(2048, 8), kv_cache_memory_bytes=1 << 30, enforce_eager=eager) as engine:
            result[label] = {"decode_mode": engine.decoder.mode}

            def generate(n, label=label, engine=engine):
                out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
                tokens[label] = out.output_token_ids
                return out
            per_token = decode_time_per_token(generate, sync, short, long)
            itl = statistics.median(generate(long).metrics.itls)
        result[label].update(s_per_token=per_token, median_itl_s=itl, times_floor=per_token / floor)
    result["graph_tokens_equal_eager"] = tokens["graph"] == tokens["eager"]
    result["graph_times_floor"] = result["graph"]["times_floor"]
    # Ops dispatched by one decode step: eager (new metadata each step), and the host's part of a graph replay.
    cache = KVCache(cfg, 1, PROMPT_LEN + 1, device, dtype)
    step = [Segment(0, PROMPT_LEN, 1, True)]
    runner = DecodeRunner(model, cache, 1, "graph" if device.type == "cuda" else "static")
    with torch.inference_mode():
        ids = torch.tensor([[prompt[0]]], device=device)
        result["ops_per_step"] = {
            "eager": metrics.count_ops(lambda: model(ids, cache.prepare(step).positions, cache=cache)).as_dict(),
            runner.mode: metrics.count_ops(lambda: runner.run(step, [prompt[0]])).as_dict()}
    del runner, cache
    result.update(reference_generate(torch, model, prompt, sync, result["graph"]["s_per_token"], short, long))
    return result


def reference_generate(torch, model, prompt, sync, ours_s_per_token: float, short: int = SHORT,
                       long: int = LONG) -> dict:
    """transformers' GPT2LMHeadModel on our weights: its logits must match ours, then its greedy generate is timed
    per token, eager and with its static cache."""
    try:
        import transformers
    except ImportError as e:
        return {"reference": {"error": f"transformers is not installed: {e}"}}
    from minillm.weights import config_to_hf
    out = {"transformers": transformers.__version__}
    try:
        with torch.device(model.device):  # the random init it starts from is replaced below: build it where it runs
            hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config_to_hf(model.config)))
        hf = hf.to(model.dtype).eval()
        missing, unexpected = hf.transformer.load_state_dict(model.state_dict(), strict=False)
        if [k for k in missing if not k.endswith(("attn.bias", "masked_bias"))] or unexpected:
            raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            err = (hf(ids).logits.float() - model(ids).float()).abs().max().item()
        out["max_abs_logit_diff_vs_minillm"] = err
    except Exception as e:
        return {"reference": {"error": f"{type(e).__name__}: {e}"}}
    for label, extra in (("reference_eager", {}), ("reference_static", {"cache_implementation": "static"})):
        def generate(n, extra=extra):
            with torch.inference_mode():
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=model.config.eos_token_id or 0, **extra)
        try:
            per_token = decode_time_per_token(generate, sync, short, long)
            out[label] = {"s_per_token": per_token}
            out[f"speedup_vs_{label}"] = per_token / ours_s_per_token
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"}
    del hf
    return out


def judge(targets_in: dict) -> dict:
    """Each target with its measured value and whether it was met (None when it could not be measured)."""
    judged = {}
    for (model, figure), (bound, kind) in TARGETS.items():
        value = targets_in.get(model, {}).get(figure)
        met = None if value is None else (value <= bound if kind == "max" else value >= bound)
        judged[f"{model} {figure}"] = {"value": value, "bound": bound, "kind": kind, "met": met}
    return judged


# ---- the check ----------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would run; needs no GPU")
    parser.add_argument("--quick", action="store_true", help="lessons with --quick (a fast smoke test)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default {','.join(MODELS)})")
    parser.add_argument("--out", default=str(ROOT / "lessons" / "results" / "reference"))
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    steps = plan(discover(), models, args.quick)

    if args.dry_run:
        print("in-process checks: cuda-events, cuda-memory, bf16+fp16 (logits vs fp32, greedy vs naive, ceilings), "
              "engine (graphs and eager, greedy tokens vs kv_cache.generate, two pools in a row, close)")
        for model in models:
            print(f"targets {model}: bf16 batch-1 decode, graphs and eager, against the weight-read floor and "
                  "transformers' generate (eager, static cache)")
        for label, kind, argv_ in steps:
            print(f"{label}:  {command_line(kind, argv_)}")
        print(f"everything in one process except pytest; budget {BUDGET_S:.0f} s; "
              f"results → {args.out}/<gpu-name>/ (JSON only)")
        return 0

    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "This check exercises the CUDA paths and needs an NVIDIA GPU; run it on one, or use "
              "`python gpu_check.py --dry-run` to see what it would run.", file=sys.stderr)
        return 2

    import common  # lessons/common.py
    from minillm import bench as bench_module
    from minillm import metrics, weights

    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    ref_dir = Path(args.out) / safe_name(gpu)
    ref_dir.mkdir(parents=True, exist_ok=True)
    report = {"gpu": gpu, "environment": metrics.environment("cuda", torch.bfloat16), "checks": {}, "runs": []}
    cached = ModelCache(weights.load_model)
    common.load_model = bench_module.load_model = cached  # lessons and bench build each model once, here

    def left() -> float:
        return BUDGET_S - (time.perf_counter() - started)

    checks = [("cuda-events", lambda: check_events(torch, metrics)),
              ("cuda-memory", lambda: check_memory(torch, metrics)),
              ("dtypes", lambda: check_dtypes(torch, metrics, cached)),
              ("engine", lambda: check_engine(torch))]
    checks += [(f"targets {m}", lambda m=m: check_targets(torch, metrics, cached, m)) for m in models]
    for name, fn in checks:
        t0 = time.perf_counter()
        if left() < 1:
            result = {"ok": False, "skipped": "time budget spent"}
        else:
            try:
                with time_limit(min(RUN_TIMEOUT_S, left())):
                    result = fn()
                result.setdefault("ok", "error" not in result)
            except Exception as e:  # record and go on: one broken path must not hide the others
                result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        free_memory()
        result["seconds"] = time.perf_counter() - t0
        report["checks"][name] = result
        print(f"[{'ok' if result['ok'] else 'FAIL'}] {name} ({result['seconds']:.1f} s)", flush=True)
    report["targets"] = judge({m: report["checks"].get(f"targets {m}", {}) for m in models})
    for label, target in report["targets"].items():
        print(f"target {label}: {target['value']} ({target['kind']} {target['bound']}): "
              f"{'met' if target['met'] else 'NOT MET' if target['met'] is False else 'not measured'}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for label, kind, argv_ in steps:
            if left() < 1:
                report["runs"].append({"label": label, "rc": None, "skipped": "time budget spent"})
                print(f"[skip] {label}: time budget spent", flush=True)
                continue
            t0 = time.perf_counter()
            timeout = min(RUN_TIMEOUT_S, left())
            if kind == "pytest":
                try:
                    proc = subprocess.run([sys.executable, "-m", "pytest", *argv_], cwd=ROOT, capture_output=True,
                                          text=True, timeout=timeout)
                    rc, output = proc.returncode, proc.stdout + proc.stderr
                except subprocess.TimeoutExpired:
                    rc, output = 124, f"timed out after {timeout:.0f} s"
            elif kind == "bench":
                model = argv_[argv_.index("--model") + 1]
                bench_argv = argv_ + ["--json", str(ref_dir / f"bench_{model}_bf16.json")]
                rc, output = run_in_process(lambda: run_bench(bench_module, bench_argv), timeout)
            else:
                model = argv_[argv_.index("--model") + 1]
                lesson_argv = argv_ + ["--out", str(Path(tmp) / model)]
                rc, output = run_in_process(lambda: load_lesson(Path(kind)).main(lesson_argv), timeout)
            run = {"label": label, "command": command_line(kind, argv_), "rc": rc, "seconds": time.perf_counter() - t0}
            if rc != 0:
                run["output_tail"] = output[-3000:]
            report["runs"].append(run)
            print(f"[{'ok' if rc == 0 else 'FAIL'}] {label} ({run['seconds']:.1f} s)", flush=True)
            if rc != 0:
                print(output[-3000:], file=sys.stderr)
        for model in models:  # keep the JSON, leave the plots
            for f in sorted((Path(tmp) / model).glob("*.json")):
                dest = ref_dir / model
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, dest / f.name)

    report["wall_s"] = time.perf_counter() - started
    ok = (all(c["ok"] for c in report["checks"].values()) and all(r["rc"] == 0 for r in report["runs"])
          and all(t["met"] for t in report["targets"].values()))
    report["ok"] = ok
    (ref_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{'PASSED' if ok else 'FAILED'} in {report['wall_s']:.0f} s; results in {ref_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
