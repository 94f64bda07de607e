"""Lesson 03: KV-cache memory. The cache, not the model, is what fills memory.

The claim
---------
Every token in flight keeps a key and a value per layer:

    KV bytes per token = 2 · n_layer · n_embd · bytes per element

gpt2 in fp32: 2 · 12 · 768 · 4 = 72 KiB per token; gpt2-xl in bf16: 300 KiB.
That is small per token and large per deployment: memory left after the
weights, divided by it, is how many tokens of context can be in flight at once,
summed over every running sequence. And each decode step must *read* all of it:

    bytes read per decode step ≈ weight bytes  +  context · batch · KV bytes per token

so once context × batch passes weight bytes ÷ KV bytes per token, the cache,
not the model, dominates the memory traffic of every step.

What this lesson measures
-------------------------
- a real `KVCache` for every GPT-2 size that fits, its bytes against the formula
  (on CUDA: the allocator's `memory_allocated` delta; on the CPU: the bytes its
  tensors own, *accounted*, plus the process's resident-memory delta, *measured*
  by the OS but blurred by the allocator's reuse of freed pages);
- how many tokens of context fit after the weights, per size, in this device's
  memory (on the CPU the budget is the machine's total RAM, a stated budget);
- bytes read per decode step, split into weights and KV, as context grows, and
  the context × batch at which KV reads overtake weight reads.

The verdict is computed: every measured cache must match the formula, and the
crossover is reported as the numbers give it.

Predict before you run: for gpt2 in fp32, at what context does one sequence's
KV read cost as much as reading the weights? Does it fit in gpt2's 1,024?
"""
from __future__ import annotations

import math

from common import make_parser, plt, print_table, print_verdict, save_plot, si, start, write_results

import torch

from minillm.config import HF_CHECKPOINTS, PRESETS
from minillm.kv_cache import KVCache
from minillm.metrics import decode_cost, memory_budget, synchronize, tensor_bytes

NAME = "03_kv_memory"
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's knob: the share of device memory the engine may use
MEASURE_SHARE = 0.25          # measure a size only if its cache takes under this share of free memory


def rss_bytes() -> int | None:
    """This process's resident memory, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, IndexError, ValueError):
        return None


def measure_cache(config, tokens: int, device, dtype) -> dict:
    """Allocate a real one-sequence KVCache of `tokens` slots; report its bytes."""
    synchronize(device)
    on_gpu = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated(device) if on_gpu else rss_bytes()
    cache = KVCache(config, 1, tokens, device, dtype)
    synchronize(device)
    after = torch.cuda.memory_allocated(device) if on_gpu else rss_bytes()
    row = {"accounted_bytes": cache.nbytes}
    if on_gpu:
        row.update(measured_bytes=after - before, measured_by="torch.cuda.memory_allocated delta")
    else:
        row.update(measured_bytes=cache.nbytes, measured_by="accounted: tensor nbytes (no allocator to ask on CPU)",
                   rss_delta_bytes=(after - before) if before is not None else None)
    del cache
    return row


def tokens_that_fit(budget_bytes: float, weight_bytes: int, kv_per_token: int) -> int:
    """Tokens of context (summed over all sequences) that fit beside the weights; 0 if the weights do not fit."""
    return max(0, int((budget_bytes - weight_bytes) // kv_per_token))


def crossover_tokens(weight_bytes: int, kv_per_token: int) -> float:
    """Context × batch at which one decode step reads as many KV bytes as weight bytes."""
    return weight_bytes / kv_per_token


def memory_verdict(rows: list[dict], crossover: float, n_ctx: int, rel_tol: float, abs_tol: int) -> dict:
    """Do the measured caches match 2·L·C·b per token? Pure: rows of formula/measured bytes in.

    A row matches when |measured − formula| ≤ abs_tol + rel_tol · formula (the
    CUDA allocator rounds blocks up; the tolerance says by how much we allow).
    """
    measured = [r for r in rows if r.get("measured_bytes") is not None]
    bad = [r for r in measured
           if abs(r["measured_bytes"] - r["formula_bytes"]) > abs_tol + rel_tol * r["formula_bytes"]]
    # On the CPU the "measured" bytes are the cache's tensor bytes: say so, the check is weaker than an allocator's.
    accounted = any(str(r.get("measured_by", "")).startswith("accounted") for r in measured)
    kind = "accounted (tensor bytes; no allocator to ask)" if accounted else "measured"
    reasons = [f"{len(measured) - len(bad)} of {len(measured)} {kind} caches match the formula "
               f"2·n_layer·n_embd·bytes per token (tolerance {rel_tol:.0%} + {si(abs_tol, 'B')})"]
    for r in bad:
        reasons.append(f"the data contradicts the formula for {r['model']}: measured {si(r['measured_bytes'], 'B')}, "
                       f"formula {si(r['formula_bytes'], 'B')}")
    min_batch = math.ceil(crossover / n_ctx)
    reasons.append(f"KV reads overtake weight reads at context × batch = {crossover:,.0f} tokens: "
                   + (f"within one sequence's context n_ctx={n_ctx}" if crossover <= n_ctx else
                      f"beyond one sequence's n_ctx={n_ctx}, so at full context from batch {min_batch} up"))
    return {"holds": bool(measured) and not bad, "mismatches": [r["model"] for r in bad],
            "crossover_tokens": crossover, "crossover_min_batch_at_full_context": min_batch, "reasons": reasons}


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    model, cfg, device, dtype = lesson.model, lesson.config, lesson.device, lesson.dtype
    budget = memory_budget(device)
    free = budget["free_bytes"] if budget["free_bytes"] is not None else budget["bytes"]
    usable = GPU_MEMORY_UTILIZATION * budget["bytes"]

    names = list(HF_CHECKPOINTS) + ([args.model] if args.model not in HF_CHECKPOINTS and args.model in PRESETS else [])
    configs = {n: PRESETS[n] for n in names}
    if args.model not in PRESETS:
        configs[args.model] = cfg  # a checkpoint folder: its own shape
    rows = []
    for name, c in configs.items():
        tokens = min(c.n_ctx, 64 if args.quick else 1024)
        per_token = c.kv_bytes_per_token(dtype)
        row = {"model": name, "tokens": tokens, "kv_bytes_per_token": per_token,
               "formula_bytes": per_token * tokens, "weight_bytes": c.weight_bytes(dtype),
               "tokens_that_fit": tokens_that_fit(usable, c.weight_bytes(dtype), per_token),
               "n_ctx": c.n_ctx}
        row["full_sequences_that_fit"] = row["tokens_that_fit"] // c.n_ctx
        if row["formula_bytes"] <= MEASURE_SHARE * free:
            row.update(measure_cache(c, tokens, device, dtype))
        else:
            row.update(measured_bytes=None, measured_by="not measured: does not fit; formula only")
        rows.append(row)

    budget_label = f"{si(budget['bytes'], 'B')} × gpu_memory_utilization {GPU_MEMORY_UTILIZATION} ({budget['source']})"
    print_table(["model", "KV/token", "tokens", "formula", "measured", "ratio", "weights", "tokens that fit",
                 "full-context seqs"],
                [[r["model"], si(r["kv_bytes_per_token"], "B"), r["tokens"], si(r["formula_bytes"], "B"),
                  si(r["measured_bytes"], "B") if r["measured_bytes"] is not None else "—",
                  f"{r['measured_bytes'] / r['formula_bytes']:.4f}" if r["measured_bytes"] is not None else "—",
                  si(r["weight_bytes"], "B"), f"{r['tokens_that_fit']:,}", f"{r['full_sequences_that_fit']:,}"]
                 for r in rows],
                f"KV cache bytes, one sequence, {lesson.ceilings.dtype}; memory budget {budget_label}:")
    if device.type == "cpu":
        print("On the CPU 'measured' is the cache's tensor bytes (accounted). The OS's resident-memory delta: "
              + ", ".join(f"{r['model']} {si(r['rss_delta_bytes'], 'B')}" for r in rows
                          if r.get("rss_delta_bytes") is not None) + "\n")

    # Bytes one decode step reads, split, for this lesson's model.
    per_token = cfg.kv_bytes_per_token(dtype)
    weights_read = decode_cost(cfg, 0, 1, dtype).weight_bytes
    crossover = crossover_tokens(weights_read, per_token)
    contexts = sorted({int(cfg.n_ctx * f) for f in (0, 0.125, 0.25, 0.5, 0.75)} | {cfg.n_ctx - 1})
    batches = [1, 8, 32]
    split = [{"context_len": c, "batch": b, "weight_bytes": decode_cost(cfg, c, b, dtype).weight_bytes,
              "kv_read_bytes": decode_cost(cfg, c, b, dtype).kv_read_bytes} for b in batches for c in contexts]
    print_table(["batch", "context", "weights read", "KV read", "KV share"],
                [[s["batch"], s["context_len"], si(s["weight_bytes"], "B"), si(s["kv_read_bytes"], "B"),
                  f"{s['kv_read_bytes'] / (s['kv_read_bytes'] + s['weight_bytes']):.0%}"] for s in split],
                f"Bytes read by one decode step of {args.model} (analytic minimum):")

    tol = (0.01, 2 << 20) if device.type == "cuda" else (0.0, 0)
    verdict = memory_verdict(rows, crossover, cfg.n_ctx, *tol)
    print_verdict(verdict)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    seqs = max(8, math.ceil(1.5 * crossover / cfg.n_ctx))  # full sequences shown: past the crossover
    xs = [i * seqs * cfg.n_ctx / 100 for i in range(101)]  # context × batch
    axes[0].plot(xs, [weights_read / 1e6] * len(xs), label="weights read")
    axes[0].plot(xs, [x * per_token / 1e6 for x in xs], label="KV read")
    axes[0].axvline(crossover, color="grey", ls=":", label=f"crossover {crossover:,.0f} tokens")
    for b in range(1, seqs + 1):
        axes[0].axvline(b * cfg.n_ctx, color="lightgrey", lw=0.5)
    axes[0].set(xlabel=f"context × batch (tokens; grey lines: full {cfg.n_ctx}-token sequences)",
                ylabel="MB read per decode step", title=f"{args.model}, {lesson.ceilings.dtype}")
    axes[0].legend(fontsize=8)
    axes[1].bar([r["model"] for r in rows], [max(r["tokens_that_fit"], 1) for r in rows])
    axes[1].set_yscale("log")
    axes[1].set(ylabel="tokens of context that fit", title="after the weights, in this device's budget")
    save_plot(lesson, fig)

    figures = {"sizes": rows, "budget": {**budget, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION},
               "accounted_model_bytes": tensor_bytes(model), "decode_bytes_split": split,
               "kv_bytes_per_token": per_token, "weights_read_per_step": weights_read, "crossover_tokens": crossover}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    main()
