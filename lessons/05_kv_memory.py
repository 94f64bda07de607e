"""Lesson 05: KV-cache memory. The cache, not the model, is what fills memory.

The claim
---------
Every token in flight keeps a key and a value per layer, per KV head:

    KV bytes per token = 2 · n_layer · n_kv_heads · head_dim · bytes per element

GPT-2 gives every query head its own K and V (n_kv_heads = n_head, so
n_kv_heads · head_dim = n_embd): gpt2 in fp32 takes 2 · 12 · 768 · 4 = 72 KiB
per token; gpt2-xl in bf16: 300 KiB. Grouped-query attention (GQA) shares one
K and V among a group of query heads, and multi-query attention (MQA) one among
all: a Llama-style model of 32 layers with 32 query heads of 128 in bf16 keeps
512 KiB per token with a KV head per query head, 128 KiB with 8 KV heads (4×
less), 16 KiB with one (32× less). The lesson prints that example from the
formula; GPT-2 has neither, so what it measures is the n_kv_heads = n_head case.
That is small per token and large per deployment: memory left after the
weights, divided by it, is how many tokens of context can be in flight at once,
summed over every running sequence. And each decode step must *read* all of it:

    bytes read per decode step ≈ weight bytes  +  context · batch · KV bytes per token

so once context × batch passes weight bytes ÷ KV bytes per token, the cache,
not the model, dominates the memory traffic of every step.

What this lesson measures
-------------------------
- a real `KVCache` for every GPT-2 size that fits, filled, its memory measured
  and compared with the formula. On CUDA the allocator says what it handed out
  (`torch.cuda.memory_allocated`). On the CPU there is no allocator to ask, so
  the lesson asks the OS how much memory the process holds (its resident set)
  before and after. Each cache holds at least 64 MiB per tensor: the C library
  maps an allocation that large fresh from the OS, while a smaller one may
  reuse memory the process already holds, which no delta would show. And the
  cache is filled, since the OS counts a page only once it is written;
- how many tokens of context fit after the weights, per size, in this device's
  memory (on the CPU the budget is the machine's total RAM, a stated budget).
  "The weights" are what the loader keeps: on a CPU in fp32 that is the
  checkpoint's bytes and the copies its layout adds (`cpu_layout.py`: the
  head's [C, V] copy and oneDNN-packed copies, 1.3× the weights again for gpt2);
- bytes read per decode step, split into weights and KV, as context grows, and
  the context × batch at which KV reads overtake weight reads (arithmetic from
  the formula, not a measurement).

The verdict: the memory each filled cache actually took (the allocator's or
the OS's count, not the tensor's shape) against the formula's bytes, its
prediction: at most 2% over (+ a few MiB of the allocator's or the OS's
rounding: pools and huge pages are all the count can add), and the smallest
of them at least 98% of its formula (the count saw the whole cache). That a
`KVCache` tensor has the formula's shape is true by construction: a fact,
printed, never judged.

Predict before you run: for gpt2 in fp32, at what context does one sequence's
KV read cost as much as reading the weights? Does it fit in gpt2's 1,024?
"""
from __future__ import annotations

import gc
import math

from common import make_parser, plt, predict, print_table, run, save_plot, si, start, write_results
from minillm.bench.verdict import Check, Fact, judge, print_verdict

import torch

from minillm.config import HF_CHECKPOINTS, PRESETS, dtype_bytes
from minillm.kv_cache import KVCache
from minillm.bench.cost import decode_cost
from minillm.bench.memory import layout_copy_bytes_of, memory_budget, release_free_memory, resident_bytes
from minillm.cpu_layout import layout_of
from minillm.device import synchronize

NAME = "05_kv_memory"
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's knob: the share of device memory the engine may use
MEASURE_SHARE = 0.25          # measure a size only if its cache takes under this share of the available memory
MIN_TENSOR_BYTES = 64 << 20   # above glibc's largest mmap threshold (32 MiB): always fresh pages from the OS
REL_TOL = 0.02
LLAMA_STYLE = {"n_layer": 32, "n_head": 32, "head_dim": 128, "bytes": 2}  # the GQA/MQA example: 32 heads of 128, bf16


def kv_bytes(n_layer: int, n_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """KV bytes per token: 2 (K and V) · n_layer · n_kv_heads · head_dim · bytes; GPT-2: n_kv_heads · head_dim = n_embd."""
    return 2 * n_layer * n_kv_heads * head_dim * bytes_per_element


def memory_now(device) -> int | None:
    synchronize(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()


def sequences_measured(config, dtype) -> int:
    """Full-context sequences in a measured cache: at least MIN_TENSOR_BYTES per tensor (K, V)."""
    return max(1, math.ceil(2 * MIN_TENSOR_BYTES / (config.kv_bytes_per_token(dtype) * config.n_ctx)))


def measure_cache(config, device, dtype) -> dict:
    """A filled KVCache of full-context sequences, at least MIN_TENSOR_BYTES per tensor: its memory, before/after."""
    per_token = config.kv_bytes_per_token(dtype)
    seqs = sequences_measured(config, dtype)
    gc.collect()
    release_free_memory()  # else the cache may be carved from freed memory the OS still counts
    before = memory_now(device)
    cache = KVCache(config, seqs, config.n_ctx, device, dtype)
    cache.k.fill_(1.0)  # write every page: the OS counts a page only once it is touched
    cache.v.fill_(1.0)
    after = memory_now(device)
    row = {"sequences": seqs, "tokens": seqs * config.n_ctx, "formula_bytes": per_token * seqs * config.n_ctx,
           "accounted_bytes": cache.nbytes,
           "measured_bytes": None if before is None or after is None else after - before,
           "measured_by": "torch.cuda.memory_allocated delta" if device.type == "cuda" else
                          "resident set delta (/proc/self/statm) after filling the cache"}
    del cache
    gc.collect()
    return row


def tokens_that_fit(budget_bytes: float, weight_bytes: int, kv_per_token: int) -> int:
    """Tokens of context (summed over all sequences) that fit beside the weights; 0 if the weights do not fit."""
    return max(0, int((budget_bytes - weight_bytes) // kv_per_token))


def crossover_tokens(weight_bytes: int, kv_per_token: int) -> float:
    """Context × batch at which one decode step reads as many KV bytes as weight bytes."""
    return weight_bytes / kv_per_token


def slack_bytes(device) -> int:
    """What rounding may add to a measured cache: the CUDA allocator's 2 MiB blocks, or the OS's huge pages."""
    return (2 << 20) * 2 if device.type == "cuda" else (4 << 20)


def predict_bytes(lesson) -> None:
    cfg, dtype, device = lesson.config, lesson.dtype, lesson.device
    per_token = kv_bytes(cfg.n_layer, cfg.n_head, cfg.head_dim, dtype_bytes(dtype))
    ex = LLAMA_STYLE
    mha, gqa, mqa = (kv_bytes(ex["n_layer"], h, ex["head_dim"], ex["bytes"]) for h in (ex["n_head"], 8, 1))
    predict(lesson, f"{lesson.args.model}'s KV cache holds 2 · n_layer {cfg.n_layer} · n_kv_heads {cfg.n_head} (= n_head: "
            f"GPT-2 has no GQA) · head_dim {cfg.head_dim} · {dtype_bytes(dtype)} bytes = {si(per_token, 'B')} per token, "
            f"so a full {cfg.n_ctx}-token context takes {si(per_token * cfg.n_ctx, 'B')}; what the "
            f"{'allocator' if device.type == 'cuda' else 'OS'} reports should match within "
            f"{REL_TOL:.0%} plus {si(slack_bytes(device), 'B')} of rounding",
            f"what GQA/MQA would change: {ex['n_layer']} layers of {ex['n_head']} query heads of {ex['head_dim']} in "
            f"bf16 keep {si(mha, 'B')} per token with a KV head per query head, {si(gqa, 'B')} with 8 (GQA, "
            f"{mha // gqa}× less), {si(mqa, 'B')} with one (MQA, {mha // mqa}× less): as many more tokens in flight",
            expect={**{f"mb_{name}": c.kv_bytes_per_token(dtype) * c.n_ctx * sequences_measured(c, dtype) / 1e6
                       for name, c in {**{n: PRESETS[n] for n in HF_CHECKPOINTS}, lesson.args.model: cfg}.items()},
                    "least_over_formula": 1.0})


def measure(lesson, budget: dict) -> list[dict]:
    """Per GPT-2 size (and the lesson's model): its KV bytes per token, a filled cache measured where it fits in
    MEASURE_SHARE of the available memory, and how many tokens and full sequences fit beside the weights."""
    device, dtype = lesson.device, lesson.dtype
    available = budget["free_bytes"] if budget["free_bytes"] is not None else budget["bytes"]
    usable = GPU_MEMORY_UTILIZATION * budget["bytes"]
    configs = {n: PRESETS[n] for n in HF_CHECKPOINTS}
    configs[lesson.args.model] = lesson.config  # the lesson's own model too (a checkpoint folder: its own shape)
    rows = []
    for name, c in configs.items():
        per_token = c.kv_bytes_per_token(dtype)
        layout = layout_of(lesson.model)  # the layout chosen here
        copies = layout_copy_bytes_of(c, dtype, layout["head_copy"], layout["packed"])
        row = {"model": name, "kv_bytes_per_token": per_token, "weight_bytes": c.weight_bytes(dtype),
               "layout_copy_bytes": copies, "n_ctx": c.n_ctx,
               "tokens_that_fit": tokens_that_fit(usable, c.weight_bytes(dtype) + copies, per_token)}
        row["full_sequences_that_fit"] = row["tokens_that_fit"] // c.n_ctx
        seqs = sequences_measured(c, dtype)
        if per_token * seqs * c.n_ctx <= MEASURE_SHARE * available:
            row.update(measure_cache(c, device, dtype))
        else:
            row.update(measured_bytes=None, measured_by="not measured: it would take over "
                                                        f"{MEASURE_SHARE:.0%} of the available memory")
        rows.append(row)
    budget_label = f"{si(budget['bytes'], 'B')} × gpu_memory_utilization {GPU_MEMORY_UTILIZATION} ({budget['source']})"
    print_table(["model", "KV/token", "tokens", "formula", "measured", "measured / formula", "weights",
                 "+ layout copies", "tokens that fit", "full-context seqs"],
                [[r["model"], si(r["kv_bytes_per_token"], "B"), r.get("tokens", "—"), si(r.get("formula_bytes", 0), "B"),
                  si(r["measured_bytes"], "B") if r["measured_bytes"] is not None else "—",
                  f"{r['measured_bytes'] / r['formula_bytes']:.4f}" if r["measured_bytes"] is not None else "—",
                  si(r["weight_bytes"], "B"), si(r["layout_copy_bytes"], "B"), f"{r['tokens_that_fit']:,}",
                  f"{r['full_sequences_that_fit']:,}"]
                 for r in rows],
                f"KV cache memory, {str(dtype).removeprefix('torch.')}, measured by {rows[0]['measured_by']}; "
                f"memory budget {budget_label}:")
    return rows


def decode_bytes(lesson) -> dict:
    """Bytes one decode step reads, weights against KV, by batch and context; where KV reads overtake."""
    cfg, dtype = lesson.config, lesson.dtype
    weights_read = decode_cost(cfg, 0, 1, dtype).weight_bytes
    crossover = crossover_tokens(weights_read, cfg.kv_bytes_per_token(dtype))
    contexts = sorted({int(cfg.n_ctx * f) for f in (0, 0.125, 0.25, 0.5, 0.75)} | {cfg.n_ctx - 1})
    split = [{"context_len": c, "batch": b, "weight_bytes": weights_read,
              "kv_read_bytes": decode_cost(cfg, c, b, dtype).kv_read_bytes} for b in (1, 8, 32) for c in contexts]
    print_table(["batch", "context", "weights read", "KV read", "KV share"],
                [[x["batch"], x["context_len"], si(x["weight_bytes"], "B"), si(x["kv_read_bytes"], "B"),
                  f"{x['kv_read_bytes'] / (x['kv_read_bytes'] + x['weight_bytes']):.0%}"] for x in split],
                f"Bytes read by one decode step of {lesson.args.model} (the formula's minimum):")
    where = (f"within one sequence's context n_ctx={cfg.n_ctx}" if crossover <= cfg.n_ctx else
             f"beyond one sequence's n_ctx={cfg.n_ctx}: at full context from batch {math.ceil(crossover / cfg.n_ctx)} up")
    print(f"KV reads overtake weight reads at context × batch = {crossover:,.0f} tokens, {where}.\n")
    return {"split": split, "weights_read": weights_read, "crossover": crossover}


def checks(figures: dict) -> list[Check]:
    """Per measured size: the memory its filled cache took, in MB, at most the formula's + REL_TOL + rounding; and
    the least of measured ÷ formula, with the rounding, at least 1 − REL_TOL."""
    slack, rows = figures["rounding_allowed_bytes"], [r for r in figures["sizes"] if r["measured_bytes"] is not None]
    out = [Check(f"{r['model']}: MB a filled cache took, {si(slack, 'B')} of rounding allowed",
                 [r["measured_bytes"] / 1e6], (r["formula_bytes"] * (1 + REL_TOL) + slack) / 1e6, "<=", timed=False,
                 fmt="{:.4g}", predicted=r["formula_bytes"] / 1e6, key=f"mb_{r['model']}",
                 why=f"{r['model']}: {si(r['measured_bytes'], 'B')} measured by {r['measured_by']} against "
                     f"{si(r['formula_bytes'], 'B')} by the formula for {r['tokens']:,} tokens: the measurement counts "
                     "memory that is not the cache (the allocator's pools, or pages the process touched meanwhile)")
           for r in rows]
    least = min(rows, key=lambda r: r["measured_bytes"] / r["formula_bytes"])
    out.append(Check("the least of (measured + rounding) ÷ formula", [(least["measured_bytes"] + slack) /
                                                                    least["formula_bytes"]], 1 - REL_TOL, ">=",
                     timed=False, fmt="{:.4f}", predicted=1.0, key="least_over_formula",
                     why=f"{least['model']}: only {si(least['measured_bytes'], 'B')} of {si(least['formula_bytes'], 'B')} "
                         f"counted by {least['measured_by']}: the count missed pages of the cache (never written, or "
                         "taken from memory the process already held)"))
    return out


def facts(figures: dict) -> list[Fact]:
    rows = figures["sizes"]
    same = sum(r.get("accounted_bytes") == r.get("formula_bytes") for r in rows if "accounted_bytes" in r)
    return [Fact("caches whose tensors hold the formula's bytes (KVCache.nbytes)", same,
                 predicted=sum("accounted_bytes" in r for r in rows), fmt="{:.0f}",
                 why="the cache allocates tensors of the formula's shape: equal by construction, so not a check")]


def judge_claim(lesson, figures: dict):
    if not any(r["measured_bytes"] is not None for r in figures["sizes"]):
        raise SystemExit(f"{NAME}: nothing could be measured here: no CUDA device, and the OS does not report this "
                         "process's resident memory (/proc/self/statm); run it on Linux or on a GPU")
    verdict = judge("a filled KV cache takes 2 · n_layer · n_kv_heads · head_dim · bytes per token of context (GPT-2: "
                    "n_kv_heads · head_dim = n_embd), counted by the allocator or the OS", checks(figures),
                    lesson.load(), facts=facts(figures))
    print_verdict(verdict)
    return verdict


def plot(lesson, rows: list[dict], d: dict, verdict) -> None:
    cfg, measured, crossover = lesson.config, [r for r in rows if r["measured_bytes"] is not None], d["crossover"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    seqs = max(8, math.ceil(1.5 * crossover / cfg.n_ctx))  # full sequences shown: past the crossover
    xs = [i * seqs * cfg.n_ctx / 100 for i in range(101)]  # context × batch
    axes[0].plot(xs, [d["weights_read"] / 1e6] * len(xs), label="weights read")
    axes[0].plot(xs, [x * cfg.kv_bytes_per_token(lesson.dtype) / 1e6 for x in xs], label="KV read")
    axes[0].axvline(crossover, color="grey", ls=":", label=f"crossover {crossover:,.0f} tokens")
    axes[0].set(xlabel="context × batch (tokens)", ylabel="MB read per decode step", xlim=(0, None), ylim=(0, None),
                title=f"bytes per decode step, {lesson.args.model}")
    axes[0].legend(fontsize=8)
    x = range(len(measured))
    axes[1].bar([i - 0.2 for i in x], [r["formula_bytes"] / 1e6 for r in measured], 0.4, label="formula")
    axes[1].bar([i + 0.2 for i in x], [r["measured_bytes"] / 1e6 for r in measured], 0.4, label="measured")
    axes[1].set_xticks(list(x), [f"{r['model']}\n{r['tokens']:,} tok" for r in measured], fontsize=7, rotation=30,
                       ha="right")
    axes[1].set(ylabel="MB", title="a filled cache: formula vs measured")
    axes[1].legend(fontsize=8)
    axes[2].bar([r["model"] for r in rows], [r["full_sequences_that_fit"] for r in rows])
    for i, r in enumerate(rows):
        axes[2].annotate(f"{r['full_sequences_that_fit']:,}", (i, r["full_sequences_that_fit"]), ha="center",
                         va="bottom", fontsize=8)
    axes[2].set(ylabel="full-context sequences (log)", yscale="log", title="sequences whose KV fits beside the weights")
    axes[2].tick_params(axis="x", labelsize=7, rotation=30)
    axes[2].yaxis.set_minor_formatter(plt.NullFormatter())  # powers of ten only
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args, ceilings=False)
    budget = memory_budget(lesson.device)
    predict_bytes(lesson)
    rows = measure(lesson, budget)
    d = decode_bytes(lesson)
    figures = {"sizes": rows, "budget": {**budget, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION},
               "decode_bytes_split": d["split"], "kv_bytes_per_token": lesson.config.kv_bytes_per_token(lesson.dtype),
               "weights_read_per_step": d["weights_read"], "crossover_tokens": d["crossover"],
               "rounding_allowed_bytes": slack_bytes(lesson.device), "gqa_example": {
                   **LLAMA_STYLE, "kv_bytes_per_token": {h: kv_bytes(LLAMA_STYLE["n_layer"], h, LLAMA_STYLE["head_dim"],
                                                                      LLAMA_STYLE["bytes"]) for h in (32, 8, 1)}}}
    verdict = judge_claim(lesson, figures)
    plot(lesson, rows, d, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
