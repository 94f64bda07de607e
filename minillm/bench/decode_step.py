"""What the engine's decode step is made of, at batch 8, 16 and 32 (docs/serving.md quotes it).

    python -m minillm.bench.decode_step --threads 2 [--gather-bytes N]
    python -m minillm.bench.decode_step --threads 1 --turns 16777216,4194304 --rounds 9
    python -m minillm.bench.decode_step --threads 2 --checks

For each batch, B random prompts of 128 tokens go through a fresh `LLMEngine` on gpt2's shape (random init,
fp32, the loader's CPU layout); once all are prefilled, the 64 decode steps (contexts 129-192) are timed
unprofiled, then the same run again under torch.profiler, whose self CPU time per op is summed into the parts
below (ms per step, and their share of the profiled step). "Outside any op" is the profiled step less every
op's self time: Python, dispatch, and the profiler's own cost.

`--turns A,B` instead times one fixed decode step (B rows at 150 cached tokens, `engine.decoder.run`) under
the two gather bounds in turns, each turn one warm step then two timed, and prints the per-round ratios'
median and quartiles, B ÷ A; on one thread it asserts every turn's logits equal to the first (same bits).

`--checks` times, on gpt2's shape and random data, what the docs weigh against the gather: its copy speed
beside a contiguous copy of the same bytes (B=32 rows of 10 blocks, 12 layers, in groups of 16 rows); whether
the fused attention kernel gives the same bits when a batch is split into calls of fewer rows; and attention
written out (two batched matmuls and a softmax) against the fused kernel.
"""
import argparse
import os
import statistics
import time

import minillm  # noqa: F401  before torch: OpenMP's passive wait, as the engine's processes take it
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from minillm.bench.replay import greedy
from minillm.bench.threads import apply_threads, choose_threads
from minillm.checkpoints.load import load_model
from minillm.engine import LLMEngine
from minillm.kv_cache import Segment
from minillm.scheduler import SchedulerConfig

PARTS = {"projections (oneDNN)": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"),
         "attention kernel (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
         "paged gather (index_select)": ("aten::index_select",),
         "sampling (argmax)": ("aten::max", "aten::argmax"),
         "KV write (stack, index_copy_)": ("aten::cat", "aten::index_copy_")}

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--threads", type=int, default=None)
p.add_argument("--gather-bytes", type=int, default=None, help="the paged cache's bound (default: its own)")
p.add_argument("--turns", default=None, help="two bounds, A,B: the fixed step under each, in turns")
p.add_argument("--rounds", type=int, default=9)
p.add_argument("--checks", action="store_true", help="the gather's copy speed and the attention kernel's bits")
args = p.parse_args()
threads = apply_threads(choose_threads(args.threads)).threads
model = load_model("gpt2", "auto", "auto")


def engine(batch: int, prompt_len: int = 128, output_len: int = 64) -> LLMEngine:
    eng = LLMEngine(model, SchedulerConfig(max_num_seqs=32), record_timeline=False)
    if args.gather_bytes is not None:
        eng.cache.gather_bytes = args.gather_bytes
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        eng.add_request(torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist(),
                        greedy(output_len))
    while eng.scheduler.waiting or any(s.num_computed_tokens < prompt_len for s in eng.scheduler.running):
        eng.step()
    return eng


@torch.inference_mode()
def turns(batch: int, bounds: list[int], rounds: int) -> None:
    eng = engine(batch, 128, 256)
    while min(s.num_computed_tokens for s in eng.scheduler.running) < 150:  # then each row decodes its 151st
        eng.step()                                                          # token, again and again
    segments = [Segment(s.seq_id, s.num_computed_tokens, 1, True) for s in eng.scheduler.running]
    tokens = [s.output_token_ids[-1] for s in eng.scheduler.running]
    kept = {}
    for bound in bounds:
        eng.cache.gather_bytes = bound
        kept[bound] = eng.cache.gather_bytes, eng.cache.scratch
    first, times = None, {bound: [] for bound in bounds}
    for r in range(rounds):
        for bound in bounds if r % 2 == 0 else bounds[::-1]:
            eng.cache._gather_bytes, eng.cache.scratch = kept[bound]
            eng.decoder.run(segments, tokens)
            t0 = time.perf_counter()
            for _ in range(2):
                logits = eng.decoder.run(segments, tokens)
            times[bound].append((time.perf_counter() - t0) / 2)
            first = logits.clone() if first is None else first
            assert threads > 1 or torch.equal(logits, first), "one thread: the groups changed a bit"
    ratios = [b / a for a, b in zip(times[bounds[0]], times[bounds[1]])]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    print(f"batch {batch}, {threads} thread(s): step {1e3 * statistics.median(times[bounds[0]]):.1f} ms at "
          f"{bounds[0]} B, {1e3 * statistics.median(times[bounds[1]]):.1f} at {bounds[1]}; ratio {q2:.3f} "
          f"({q1:.3f}-{q3:.3f}, {rounds} rounds)", os.popen("uptime").read().strip(), flush=True)


def median_s(fn, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def checks() -> None:
    H, D, bs, width, rows = 12, 64, 16, 10, 32
    pool = torch.randn(12, 2400, bs, 2, H, D)  # 12 layers' blocks: (block, slot, K|V, head, head_dim)
    tables = torch.randperm(2400)[:rows * width].view(2, rows // 2 * width)  # two groups of 16 rows
    scratch = torch.empty(rows // 2 * width, bs, 2, H, D)
    turns = [(median_s(lambda: [torch.index_select(pool[i], 0, t, out=scratch) for i in range(12) for t in tables],
                       1), median_s(lambda: [scratch.copy_(pool[i, :len(scratch)]) for i in range(12) for _ in tables],
                                    1)) for _ in range(15)]  # in turns
    gb = 12 * rows * width * bs * 2 * H * D * 4 / 1e9
    gather, copy = (statistics.median(t[j] for t in turns) for j in (0, 1))
    print(f"gather {gb / gather:.1f} GB/s, a contiguous copy of as many bytes {gb / copy:.1f} GB/s; per turn, "
          f"gather ÷ copy {statistics.median(g / c for g, c in turns):.2f} (15 turns)")
    differ = cases = 0
    for batch in (16, 32):
        for keys in range(129, 160):
            q, k, v = torch.randn(batch, H, 1, D), torch.randn(batch, H, keys, D), torch.randn(batch, H, keys, D)
            whole = F.scaled_dot_product_attention(q, k, v)
            for g in (1, 4):
                split = torch.cat([F.scaled_dot_product_attention(q[i:i + g], k[i:i + g], v[i:i + g])
                                   for i in range(0, batch, g)])
                cases, differ = cases + 1, differ + (not torch.equal(whole, split))
    print(f"a batch split into calls of 1 or 4 rows: {differ} of {cases} cases differ in some bit")
    q = torch.randn(rows, H, 1, D)
    k, v = torch.randn(rows, width * bs, 2, H, D)[:, :151].permute(2, 0, 3, 1, 4).unbind(0)  # as gathered
    for layout, (k, v) in (("the gathered views", (k, v)), ("head-major copies", (k.contiguous(), v.contiguous()))):
        fused = median_s(lambda: [F.scaled_dot_product_attention(q, k, v) for _ in range(12)])
        by_hand = median_s(lambda: [((q @ k.transpose(-2, -1)) * D ** -0.5).softmax(-1) @ v for _ in range(12)])
        print(f"attention written out ÷ the fused kernel, {rows} rows of 151 keys, over {layout}: "
              f"{by_hand / fused:.2f}")
    print(" ", os.popen("uptime").read().strip(), flush=True)


if args.checks:
    checks()
for batch in (8, 16, 32) if args.turns else ():
    turns(batch, [int(b) for b in args.turns.split(",")], args.rounds)
for batch in () if args.turns or args.checks else (8, 16, 32):
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
