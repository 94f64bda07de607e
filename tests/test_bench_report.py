"""bench's report: the load and the thread choice first, and its aims against ceilings it measured."""
import torch

from minillm import PRESETS
from minillm.bench import offline as bench
from minillm.checkpoints.load import random_model


def test_bench_reports_its_threads_load_and_aims_against_named_measured_ceilings(monkeypatch):
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    r = bench.bench(model, prompt_len=16, context_len=16, batch=1, warmup=1, repeats=2)
    r["threads"] = {"reason": "1 thread: 2 CPUs in this process's affinity, other processes kept 1.0 of them busy"}
    r["load"] = {"text": "load average 1.10 → 1.20 on 2 CPUs", "busy_cores": 1.0}
    lines = bench.report(r, on_gpu=False)
    assert lines[0].startswith("threads  1 thread") and lines[1].startswith("load     load average 1.10")
    aims = "\n".join(line for line in lines if line.startswith(("aims", "         prefill")))
    matvec = bench.si(r["kernel_limits"]["matvec_bytes_per_s"], "B/s")
    assert f"matrix-vector product streams on this device ({matvec}, measured above)" in aims
    assert f"matmul ceiling measured here ({bench.si(r['ceilings']['matmul_flops'], 'FLOP/s')})" in aims
    assert "other processes kept 1.0 cores busy" in "\n".join(lines)
    gpu = "\n".join(bench.report(r, on_gpu=True))
    assert "within 2× the weight-read floor" in gpu and bench.si(r["ceilings"]["bandwidth"], "B/s") in gpu
    for line in lines:  # a share over 100% is flagged, never shown as if it were a share
        if "% of bw" in line and "context" in line:
            for part in line.split("(")[1:]:
                if "% of bw" in part and int(part.split("%")[0]) > 100:
                    assert "faster than the copy" in part
