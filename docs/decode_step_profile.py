"""What the engine's decode step is made of, at batch 8, 16 and 32 (docs/serving.md quotes it).

    PYTHONPATH=$PWD python docs/decode_step_profile.py --threads 2 [--gather-bytes N]

For each batch, B random prompts of 128 tokens go through a fresh `LLMEngine` on gpt2's shape (random init,
fp32, the loader's CPU layout); once all are prefilled, the 64 decode steps (contexts 129-192) are timed
unprofiled, then the same run again under torch.profiler, whose self CPU time per op is summed into the parts
below (ms per step, and their share of the profiled step). "Outside any op" is the profiled step less every
op's self time: Python, dispatch, and the profiler's own cost.
"""
import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.replay import greedy
from minillm.bench.threads import apply_threads, choose_threads
from minillm.checkpoints.load import load_model
from minillm.engine import LLMEngine
from minillm.scheduler import SchedulerConfig

PARTS = {"projections (oneDNN)": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"),
         "attention kernel (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
         "paged gather (index_select)": ("aten::index_select",),
         "sampling (argmax)": ("aten::max", "aten::argmax"),
         "KV write (stack, index_copy_)": ("aten::cat", "aten::index_copy_")}

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--threads", type=int, default=None)
p.add_argument("--gather-bytes", type=int, default=None, help="the paged cache's bound (default: its own)")
args = p.parse_args()
threads = apply_threads(choose_threads(args.threads)).threads
model = load_model("gpt2", "auto", "auto")


def engine(batch: int) -> LLMEngine:
    eng = LLMEngine(model, SchedulerConfig(max_num_seqs=32), record_timeline=False)
    if args.gather_bytes is not None:
        eng.cache.gather_bytes = args.gather_bytes
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        eng.add_request(torch.randint(0, model.config.vocab_size, (128,), generator=g).tolist(), greedy(64))
    while eng.scheduler.waiting or any(s.num_computed_tokens < 128 for s in eng.scheduler.running):
        eng.step()
    return eng


for batch in (8, 16, 32):
    eng, walls = engine(batch), []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    eng, n = engine(batch), 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        profiled = (time.perf_counter() - t0) * 1e3 / n
    ops = {e.key: e.self_cpu_time_total / 1e3 / n for e in prof.key_averages()}  # ms a step
    parts = {part: sum(ops.get(k, 0.0) for k in keys) for part, keys in PARTS.items()}
    parts["other ops (gelu, layer norm, add, views)"] = sum(ops.values()) - sum(parts.values())
    parts["outside any op (Python, dispatch, profiler)"] = profiled - sum(ops.values())
    print(f"batch {batch}, {threads} thread(s), gather_bytes {eng.cache.gather_bytes}: decode step "
          f"{1e3 * statistics.median(walls):.1f} ms (median of {len(walls)}, unprofiled); profiled {profiled:.1f} ms:")
    for part, ms in parts.items():
        print(f"  {part:46s} {ms:6.1f} ms {ms / profiled:6.1%}")
    print(" ", os.popen("uptime").read().strip(), flush=True)
