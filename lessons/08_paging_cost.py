"""Lesson 08: what paging costs. The paged cache's price is paid in the attention kernel.

The claim
---------
Lesson 07 showed what paging saves: memory, hence concurrency. The price is in
attention. A sequence's keys no longer sit in one slab, so attention must
follow the block table. vLLM's CUDA kernel reads the blocks in place and still
paid 20–26% in attention against a contiguous kernel. Our pure-PyTorch cache
(`minillm/paged_attention.py`) *gathers* every sequence's blocks into a
contiguous buffer first and then runs the same attention as the contiguous
cache: an extra copy of every K and V, every layer, every step,

    gathered bytes per decode step = 2 · (2 · n_layer · n_embd · bytes) · Σ context_i   (read, then written)

On a CPU the gather takes a group of rows at a time (`GATHER_BYTES`, 16 MiB of
K and V) into one buffer the cache keeps (paged_attention.py says why).

So the gather makes attention much dearer, but attention is only part of a
decode step: at batch B and context T the step also reads every weight once.
The whole step pays in proportion to the share of K and V in what it reads.
The claim judged here: at batch 8 and a quarter of the model's context (256
tokens on gpt2, where K and V are under a third of the bytes a step reads),
the paged decode step costs at most 1.5× the contiguous one.

What this lesson measures
-------------------------
The same decode step, paged (blocks of 16, interleaved across the sequences as
sequences that grow together get them) and contiguous (`KVCache`), timed in
turns: the whole step; attention alone (every layer's `cache.attend` with the
step's metadata); and the gather alone. Then the full run repeats it at other
contexts (the step's share of K and V grows with the context, and the ratio
with it) and at other block sizes (tiny blocks mean long block tables, big
ones copy padding). `--quick` times the judged point and three block sizes.

The verdict: the paged step over the contiguous step, round by round, is at
most 1.5 at the judged point.

Predict before you run: attention alone, how much dearer is it paged? And the
whole step? At which context would the step's ratio pass 1.5?
"""
from __future__ import annotations

import statistics
from types import SimpleNamespace

from common import make_parser, ms, pct, plt, predict, print_table, run, save_plot, si, start, ticks_at, write_results
from minillm.bench.verdict import Check, interleave, judge, median_interval, print_verdict

import torch

from minillm.block_manager import BlockManager
from minillm.kv_cache import KVCache, Segment
from minillm.bench.cost import decode_cost
from minillm.paged_attention import PagedKVCache, gather_kv

NAME = "08_paging_cost"
STEP_COST_LIMIT = 1.5                   # the paged decode step costs at most 1.5× the contiguous one
VLLM_ATTENTION_OVERHEAD = (0.20, 0.26)  # vLLM's CUDA paged-attention kernel against a contiguous one
BATCH, BLOCK_SIZE = 8, 16


class Decode:
    """One decode step of `batch` sequences after `ctx` cached tokens each, in a contiguous or a paged cache."""

    def __init__(self, model, batch: int, ctx: int, block_size: int | None = None):
        cfg, self.model = model.config, model
        g = torch.Generator().manual_seed(0)
        self.segments = [Segment(i, ctx, 1, is_decode=True) for i in range(batch)]
        if block_size is None:
            self.cache, shape = KVCache(cfg, batch, ctx + 1, model.device, model.dtype), (batch, 1)
            self.rows = None
        else:
            blocks_per_seq = -(-(ctx + 1) // block_size)
            self.blocks = BlockManager(batch * blocks_per_seq, block_size)
            self.cache, shape = PagedKVCache(cfg, self.blocks, model.device, model.dtype), (1, batch)
            for j in range(blocks_per_seq):  # round-robin: sequences that grow together get their blocks in turns
                for i in range(batch):
                    self.blocks.append_slots(SimpleNamespace(seq_id=i, num_computed_tokens=j * block_size),
                                             min(block_size, ctx + 1 - j * block_size))
            self.tables = torch.tensor([self.blocks.block_tables[i] for i in range(batch)], device=model.device)
            self.rows = torch.arange(batch, device=model.device)  # the LM head on every row, as contiguous does
        self.ids = torch.randint(0, cfg.vocab_size, shape, generator=g).to(model.device)
        qkv_shape = (batch, cfg.n_head, 1, cfg.head_dim) if block_size is None else (1, cfg.n_head, batch, cfg.head_dim)
        self.qkv = [torch.randn(qkv_shape, generator=g).to(model.device, model.dtype) for _ in range(3)]
        self.ctx = ctx

    @torch.inference_mode()
    def step(self):
        meta = self.cache.prepare(self.segments)  # the same step every time: every repeat does the same work
        return self.model(self.ids, meta.positions, cache=self.cache, logits_indices=self.rows)

    @torch.inference_mode()
    def attention(self):
        """cache.attend on every layer with the step's metadata: attention and nothing else."""
        for layer in range(self.model.config.n_layer):
            self.cache.attend(layer, *self.qkv)

    @torch.inference_mode()
    def gather(self):
        """Only the copy paging adds: every layer's K and V gathered through the block tables, in the groups of
        rows attention gathers them in, into the buffer it gathers into (`PagedKVCache.decode_groups` and
        `gather_buffer`: on a CPU, up to 16 MiB at a time into a buffer the cache keeps)."""
        groups = self.cache.decode_groups(len(self.tables), self.tables.shape[1] * self.cache.block_size)
        for layer in range(self.model.config.n_layer):
            for rows in groups:
                gather_kv(self.cache.pool[layer], self.tables[rows], self.ctx + 1,
                          self.cache.gather_buffer(self.tables[rows].numel()))


def compare(model, ctx: int, block_size: int, repeats: int, until=None) -> dict:
    """Paged against contiguous at one point, timed in turns; ratios round by round (rounds added while
    `until(rounds)` is false, for the judged point)."""
    contiguous, paged = Decode(model, BATCH, ctx), Decode(model, BATCH, ctx, block_size)
    contiguous.step(), paged.step()  # the step's metadata is there for attention() to use
    r = interleave({"contiguous step": contiguous.step, "paged step": paged.step,
                    "contiguous attention": contiguous.attention, "paged attention": paged.attention,
                    "gather": paged.gather}, repeats, device=model.device, desc=f"context {ctx}, block {block_size}",
                   until=until)
    return {"rounds": r, "context": ctx, "block_size": block_size, **{k.replace(" ", "_") + "_s": r.median(k) for k in r.names},
            "step_ratio": r.ratio("paged step", "contiguous step"),
            "attention_ratio": r.ratio("paged attention", "contiguous attention")}


def sizes(n_ctx: int, quick: bool) -> dict:
    judged = n_ctx // 4
    if quick:
        return {"judged": judged, "contexts": [judged], "block_sizes": [4, 16, 64], "repeats": 3}
    return {"judged": judged, "contexts": [n_ctx // 8, judged, n_ctx // 2, n_ctx - 1],
            "block_sizes": [1, 4, 8, 16, 32, 64, 128], "repeats": 5}


def predict_gather(lesson, s: dict) -> int:
    """The bytes paging's gather moves per step against the bytes a contiguous step reads; returns the gather's."""
    cfg, dtype = lesson.config, lesson.dtype
    moved = 2 * BATCH * (s["judged"] + 1) * cfg.kv_bytes_per_token(dtype)  # K and V read once and written once
    cost = decode_cost(cfg, s["judged"], BATCH, dtype)
    predict(lesson, f"a contiguous step at batch {BATCH}, context {s['judged']} reads {si(cost.bytes, 'B')}; paging "
            f"adds a gather that reads and writes {si(moved, 'B')}: at the measured bandwidth the paged step should cost "
            f"about 1 + {si(moved, 'B')} ÷ {si(cost.bytes, 'B')} = {1 + moved / cost.bytes:.2f}× the contiguous one, "
            f"{'under' if 1 + moved / cost.bytes <= STEP_COST_LIMIT else 'over'} the {STEP_COST_LIMIT}× line (if the "
            "rest of the step ran at the measured bandwidth too; a slower rest makes the gather's share smaller)")
    return moved


def make_check(ratios, s: dict) -> Check:
    return Check(f"paged step ÷ contiguous step at batch {BATCH}, context {s['judged']}, block {BLOCK_SIZE}",
                 ratios, STEP_COST_LIMIT, "<=", fmt="{:.2f}")


def measure(lesson, s: dict) -> dict:
    """Paged against contiguous by context, and by block size at the judged context (the judged point's rounds
    added until decided); printed as two tables."""
    model, cfg, dtype = lesson.model, lesson.config, lesson.dtype
    settle = lambda r: make_check(r.ratio("paged step", "contiguous step"), s).outcome() != "INCONCLUSIVE"  # noqa
    by_context = [compare(model, c, BLOCK_SIZE, s["repeats"], settle if c == s["judged"] else None)
                  for c in s["contexts"]]
    point = next(r for r in by_context if r["context"] == s["judged"])
    by_block = [point if bs == BLOCK_SIZE else compare(model, s["judged"], bs, s["repeats"]) for bs in s["block_sizes"]]

    def row(r):
        cost = decode_cost(cfg, r["context"], BATCH, dtype)
        return [r["context"], r["block_size"], f"{cost.kv_read_bytes / cost.bytes:.0%}", ms(r["contiguous_step_s"]),
                ms(r["paged_step_s"]), f"{statistics.median(r['step_ratio']):.2f}", ms(r["contiguous_attention_s"]),
                ms(r["paged_attention_s"]), f"{statistics.median(r['attention_ratio']):.2f}", ms(r["gather_s"])]
    headers = ["context", "block", "KV share of bytes", "contig step", "paged step", "step ×", "contig attn",
               "paged attn", "attn ×", "gather"]
    print_table(headers, [row(r) for r in by_context], f"Batch {BATCH}, block {BLOCK_SIZE}, by context "
                f"(medians of {s['repeats']} rounds; {point['rounds'].count} at context {s['judged']}):")
    print_table(headers, [row(r) for r in by_block], f"Batch {BATCH}, context {s['judged']}, by block size:")
    return {"by_context": by_context, "by_block": by_block, "point": point}


def judge_claim(lesson, s: dict, m: dict, moved: int):
    """The judged point's step ratio, explained by the gather and attention; notes against vLLM's kernel."""
    point = m["point"]
    share = moved / point["gather_s"] / lesson.ceilings.bandwidth
    attn = statistics.median(point["attention_ratio"]) - 1
    extra = point["paged_step_s"] - point["contiguous_step_s"]
    check = make_check(point["step_ratio"], s)
    check.why = (f"the paged step took {ms(point['paged_step_s'])} against {ms(point['contiguous_step_s'])}: "
                 f"{ms(extra)} more, of which the gather alone is {ms(point['gather_s'])} "
                 f"({si(moved, 'B')} at {pct(share)} of the measured bandwidth) and paged attention "
                 f"{statistics.median(point['attention_ratio']):.2f}× contiguous attention")
    verdict = judge(f"at batch {BATCH} and context {s['judged']}, the paged decode step costs at most "
                    f"{STEP_COST_LIMIT}× the contiguous one", [check], lesson.load(), [point["rounds"]])
    verdict.notes.append(f"attention alone costs {attn + 1:.2f}× ({attn:+.0%}); vLLM's in-place CUDA kernel paid "
                         f"+{VLLM_ATTENTION_OVERHEAD[0]:.0%}–{VLLM_ATTENTION_OVERHEAD[1]:.0%}: a gather copies what a "
                         "fused kernel reads in place")
    verdict.notes.append(f"the gather moves {si(moved, 'B')} per step in {ms(point['gather_s'])}, {share:.0%} of the "
                         "measured bandwidth" + (" (over 100%: the buffer is reused layer after layer and stays "
                                                      "partly in cache)" if share > 1 else "")
                         + (f"; the paged step's extra {ms(extra)} is {extra / point['gather_s']:.1f}× the gather alone"
                            if extra > 0 else "; the paged step was no slower here"))
    print_verdict(verdict)
    return verdict, share


def plot(lesson, s: dict, m: dict, verdict) -> None:
    point = m["point"]
    sweeps = [(m["by_context"], "context", "context (tokens)", f"by context, block {BLOCK_SIZE}"),
              (m["by_block"], "block_size", "block size (tokens)", f"by block size, context {s['judged']}")]
    sweeps = [sw for sw in sweeps if len(sw[0]) > 1]  # a quick run times one context: no sweep to draw
    fig, axes = plt.subplots(1, 1 + len(sweeps), figsize=(5.5 * (1 + len(sweeps)), 5.2))
    bars = {"contiguous": (point["contiguous_step_s"], point["contiguous_attention_s"], 0.0),
            "paged": (point["paged_step_s"], point["paged_attention_s"], point["gather_s"])}
    for i, (name, (step, attention, gather)) in enumerate(bars.items()):
        axes[0].bar(i, (step - attention) * 1e3, color="lightgrey", label="rest of the step" if i == 0 else None)
        axes[0].bar(i, (attention - gather) * 1e3, bottom=(step - attention) * 1e3, color="C0",
                    label="attention" if i == 0 else None)
        if gather:
            axes[0].bar(i, gather * 1e3, bottom=(step - gather) * 1e3, color="C3", label="of which the gather")
    axes[0].set_xticks([0, 1], list(bars))
    axes[0].axhline(STEP_COST_LIMIT * point["contiguous_step_s"] * 1e3, color="k", ls=":",
                    label=f"the claim's line: {STEP_COST_LIMIT}× contiguous")
    axes[0].set(ylabel="ms per decode step", title=f"one step, batch {BATCH}, context {s['judged']}\n"
                                                   f"(medians of {point['rounds'].count} rounds)")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    for ax, (rows, key, label, title) in zip(axes[1:], sweeps):
        xs = [r[key] for r in rows]
        for ratio, name, color in (("step_ratio", "whole step", "C0"), ("attention_ratio", "attention alone", "C3")):
            mid = [statistics.median(r[ratio]) for r in rows]
            ivs = [median_interval(r[ratio]) for r in rows]  # what the verdict judges by, not the outliers' range
            ax.errorbar(xs, mid, yerr=[[m - iv[0] for m, iv in zip(mid, ivs)], [iv[1] - m for m, iv in zip(mid, ivs)]],
                        fmt="o-", color=color, capsize=3, label=f"{name}, paged ÷ contiguous")
        ax.axhline(STEP_COST_LIMIT, color="k", ls=":", label=f"the claim's line: {STEP_COST_LIMIT}× (whole step)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ticks_at(ax, xs)
        top = max(1.15 * STEP_COST_LIMIT, *(max(median_interval(r["step_ratio"])[1],
                                                median_interval(r["attention_ratio"])[1]) * 1.1 for r in rows))
        ax.set(xlabel=label, ylabel="paged ÷ contiguous (medians;\nbars: the interval of the median)", ylim=(0, top),
               title=title)
        if top > 10:  # a burst of load stretched an interval: a log axis keeps the line at 1.5 readable
            ax.set_yscale("log")
            ax.set_ylim(min(0.5, *(median_interval(r[k])[0] * 0.8 for r in rows for k in ("step_ratio",
                                                                                          "attention_ratio"))), top)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    moved = predict_gather(lesson, s)
    m = measure(lesson, s)
    verdict, share = judge_claim(lesson, s, m, moved)
    plot(lesson, s, m, verdict)
    for r in m["by_context"] + m["by_block"]:
        r.pop("rounds", None)
    figures = {"batch": BATCH, "judged_context": s["judged"], "by_context": m["by_context"],
               "by_block_size": m["by_block"], "gather_bytes": moved, "gather_bandwidth_share": share}
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
