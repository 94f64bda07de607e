"""The GPU check: one command that exercises every CUDA-specific path and records reference results.

    python gpu_check.py              # on a machine with an NVIDIA GPU; stops itself at 7.5 minutes
    python gpu_check.py --dry-run    # anywhere: print the plan, run nothing

What it runs, in order:
1. CUDA events: `metrics.time_fn` and `metrics.Stopwatch` time real work with events.
2. CUDA memory statistics: the allocator's delta for a tensor and for a `KVCache`
   equals their bytes, and the peak counter sees a transient allocation.
3. bf16 and fp16: a gpt2-shaped model's logits in each agree with fp32 within
   the dtype's tolerance, and the KV cache's greedy tokens are compared with
   naive decode's; the measured ceilings are recorded in every dtype.
4. The engine: `LLMEngine` on CUDA with its pool sized by `gpu_memory_utilization`,
   prefill-first and chunked, gives every request the greedy tokens that
   `kv_cache.generate` gives it alone, and frees every block.
5. `python -m minillm bench` for gpt2 and gpt2-xl in bf16 at batch 1: how far
   decode is from the weight-read floor (the target: within 2× for gpt2-xl).
6. Every lesson (found by glob, `lessons/NN_*.py`, so new lessons join
   automatically) with `--device cuda`, on the gpt2 and gpt2-xl shapes
   (random init is fine: timing and memory do not depend on weight values).

Results are small JSON files under `lessons/results/reference/<gpu-name>/`
(plots are left out), plus `gpu_check.json` with every check's outcome.
A run still going when the 7.5-minute budget ends is stopped, and runs not yet
started are skipped; both count as failures. Exit status 0 when every check
passed and every lesson ran; 1 otherwise;
2 when there is no CUDA device at all.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lessons"))

from run_all import discover  # noqa: E402  (lessons/run_all.py)

MODELS = ["gpt2", "gpt2-xl"]
BUDGET_S = 7.5 * 60        # the whole check ends by then: no run starts after it, and no run's timeout reaches past it
LESSON_TIMEOUT_S = 150
# Extra flags for a lesson, by its number, when the common flags are not enough (e.g. {"05": ["--requests", "64"]}).
LESSON_ARGS: dict[str, list[str]] = {}


def safe_name(gpu_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gpu_name).strip("_")


def plan(lessons: list[Path], models: list[str], quick: bool) -> list[tuple[str, list[str]]]:
    """(label, command) for every subprocess the check runs, in order."""
    steps = []
    for model in models:
        steps.append((f"bench {model} bf16", [sys.executable, "-m", "minillm", "bench", "--model", model,
                                              "--device", "cuda", "--dtype", "bf16", "--batch", "1"]))
    for model in models:
        for path in lessons:
            extra = LESSON_ARGS.get(path.name[:2], [])
            cmd = [sys.executable, str(path), "--device", "cuda", "--model", model, *extra]
            steps.append((f"{path.stem} {model}", cmd + (["--quick"] if quick else [])))
    return steps


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


def check_memory(torch, metrics, KVCache, PRESETS) -> dict:
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


def check_dtypes(torch, metrics, PRESETS, random_model, kv_cache, naive_decode, SamplingParams) -> dict:
    cfg = PRESETS["gpt2"]
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).cuda()
    ref = random_model(cfg, "cuda", torch.float32)
    with torch.inference_mode():
        ref_logits = ref(ids)[0, -1].float()
    del ref
    out = {"ok": True}
    prompt = ids[0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for name, dtype, tol in (("bf16", torch.bfloat16, 5e-2), ("fp16", torch.float16, 5e-2)):
        model = random_model(cfg, "cuda", dtype)
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
        del model
    out["fp32_ceilings"] = metrics.measure_ceilings("cuda", torch.float32).as_dict()
    return out


def check_engine(torch, PRESETS, random_model, kv_cache, SamplingParams) -> dict:
    """LLMEngine on CUDA: the pool sized by gpu_memory_utilization, greedy tokens equal per-request generation."""
    from minillm.engine import LLMEngine
    from minillm.scheduler import SchedulerConfig
    cfg = PRESETS["gpt2"]
    model = random_model(cfg, "cuda", torch.float32)  # fp32: paged and contiguous attention agree to rounding
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 16, 17, 100, 300, 700)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [kv_cache.generate(model, [p], params)[0] for p in prompts]
    out = {"ok": True}
    for label, config in (("prefill-first", SchedulerConfig(2048, 8, enable_chunked_prefill=False)),
                          ("chunked-64", SchedulerConfig(64, 8))):
        engine = LLMEngine(model, config, gpu_memory_utilization=0.5)
        got = [o.output_token_ids for o in engine.generate(prompts, params)]
        engine.check_invariants()
        ok = got == want and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        out[label] = {"ok": ok, "num_blocks": engine.block_manager.num_blocks, "steps": len(engine.timeline),
                      "identical_requests": f"{sum(a == b for a, b in zip(got, want))}/{len(want)}"}
        out["ok"] &= ok
        del engine
    del model
    return out


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
              "engine (pool from gpu_memory_utilization, greedy tokens vs kv_cache.generate)")
        for label, cmd in steps:
            print(f"{label}:  {' '.join(cmd)}")
        print(f"results → {args.out}/<gpu-name>/ (JSON only)")
        return 0

    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "This check exercises the CUDA paths and needs an NVIDIA GPU; run it on one, or use "
              "`python gpu_check.py --dry-run` to see what it would run.", file=sys.stderr)
        return 2

    from minillm import metrics, naive_decode, kv_cache
    from minillm.config import PRESETS
    from minillm.kv_cache import KVCache
    from minillm.sampling import SamplingParams
    from minillm.weights import random_model

    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0)
    ref_dir = Path(args.out) / safe_name(gpu)
    ref_dir.mkdir(parents=True, exist_ok=True)
    report = {"gpu": gpu, "environment": metrics.environment("cuda", torch.bfloat16), "checks": {}, "runs": []}

    for name, fn in (("cuda-events", lambda: check_events(torch, metrics)),
                     ("cuda-memory", lambda: check_memory(torch, metrics, KVCache, PRESETS)),
                     ("dtypes", lambda: check_dtypes(torch, metrics, PRESETS, random_model, kv_cache,
                                                     naive_decode, SamplingParams)),
                     ("engine", lambda: check_engine(torch, PRESETS, random_model, kv_cache, SamplingParams))):
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # record and go on: one broken path must not hide the others
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.perf_counter() - t0
        report["checks"][name] = result
        print(f"[{'ok' if result['ok'] else 'FAIL'}] {name} ({result['seconds']:.1f} s)", flush=True)
    torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as tmp:
        for label, cmd in steps:
            remaining = BUDGET_S - (time.perf_counter() - started)
            if remaining < 1:
                report["runs"].append({"label": label, "rc": None, "skipped": "time budget spent"})
                print(f"[skip] {label}: time budget spent", flush=True)
                continue
            model = cmd[cmd.index("--model") + 1]
            if cmd[1:3] == ["-m", "minillm"]:
                cmd = cmd + ["--json", str(ref_dir / f"bench_{model}_bf16.json")]
            else:
                cmd = cmd + ["--out", str(Path(tmp) / model)]
            t0 = time.perf_counter()
            timeout = min(LESSON_TIMEOUT_S, remaining)
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
            except subprocess.TimeoutExpired:
                rc, tail = 124, (f"timed out after {timeout:.0f} s (limits: {LESSON_TIMEOUT_S} s per run, "
                                 f"{BUDGET_S:.0f} s for the whole check; raise them in gpu_check.py)")
            run = {"label": label, "command": " ".join(cmd), "rc": rc, "seconds": time.perf_counter() - t0}
            if rc != 0:
                run["output_tail"] = tail
            report["runs"].append(run)
            print(f"[{'ok' if rc == 0 else 'FAIL'}] {label} ({run['seconds']:.1f} s)", flush=True)
            if rc != 0:
                print(tail, file=sys.stderr)
        for model in models:  # keep the JSON, leave the plots
            for f in sorted((Path(tmp) / model).glob("*.json")):
                dest = ref_dir / model
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, dest / f.name)

    report["wall_s"] = time.perf_counter() - started
    ok = all(c["ok"] for c in report["checks"].values()) and all(r["rc"] == 0 for r in report["runs"])
    report["ok"] = ok
    (ref_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{'PASSED' if ok else 'FAILED'} in {report['wall_s']:.0f} s; results in {ref_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
