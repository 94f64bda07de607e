"""Lesson 08: what paging costs, and where the time goes.

The claim
---------
Lesson 07 showed what paging saves: memory, hence concurrency. The price is a
copy. A sequence's keys no longer sit in one slab, so attention must follow the
block table. vLLM's CUDA kernel reads the blocks in place and still paid
20–26% in attention against a contiguous kernel. Our pure-PyTorch cache
(`minillm/paged_attention.py`) *gathers* every sequence's blocks into a
buffer first and then runs the same attention as the contiguous cache: an
extra copy of every K and V, every layer, every step, of whole blocks,

    gathered bytes per decode step = 2 · (2 · n_layer · n_embd · bytes) · Σ_i ⌈(context_i + 1) / block⌉ · block

(read, then written). The cost model: the rest of the step reads what a
contiguous step reads, so at the measured bandwidth

    paged step ÷ contiguous step ≈ 1 + gathered bytes ÷ contiguous step bytes

(at batch 8 and a quarter of gpt2's context, about 1.5). The model leaves out a
copy's write costing more than its read (up to a read for ownership: 1.5× the
bytes it counts) and a rest of the step slower than its bytes (per-op overhead,
which dilutes the gather). So the claim judged is the mechanism, with that room:
the paged step costs at most 1.3× the ratio the model predicts (`BAND`).

What this lesson measures
-------------------------
The same decode step, paged (blocks of 16, interleaved across the sequences as
sequences that grow together get them) and contiguous (`KVCache`), timed in
turns, and split *inside each step* (not timed apart, where caches would be
warm): the time inside attention (every layer's `cache.attend`) and, paged,
inside the gather (every `gather_kv` call attention makes; on a GPU each is
synchronised). So the bars add up to the step, and the extra is placed: the gather,
the rest of attention, outside attention (the block tables and slot mapping
`prepare` builds). Then the full run repeats it at other contexts (the share
of K and V grows with the context, and the ratio with it) and at other block
sizes (tiny blocks mean long tables; big ones copy padding: the formula's
⌈·⌉; the gather's calls per layer and bytes/s per block size show what
padding does not explain). `--quick` times the judged point and three block sizes.

Predict before you run: attention alone, how much dearer is it paged? And the
whole step? At which context would the step's ratio pass 1.5?
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from common import make_parser, ms, pct, plt, predict, print_table, run, save_plot, si, start, ticks_at, write_results
from minillm.bench.verdict import Check, Fact, interleave, judge, median_interval, print_verdict

import torch

from minillm import paged_attention
from minillm.block_manager import BlockManager
from minillm.bench.cost import decode_cost
from minillm.device import synchronize
from minillm.kv_cache import KVCache, Segment
from minillm.paged_attention import PagedKVCache

NAME = "08_paging_cost"
BAND = 1.3                              # measured ÷ predicted step ratio at most this (the docstring says why)
VLLM_ATTENTION_OVERHEAD = (0.20, 0.26)  # vLLM's CUDA paged-attention kernel against a contiguous one
BATCH, BLOCK_SIZE = 8, 16


class Decode:
    """One decode step of `batch` sequences after `ctx` cached tokens each, in a contiguous or a paged cache;
    `step()` returns the seconds it spent inside attention and inside the gather."""

    def __init__(self, model, batch: int, ctx: int, block_size: int | None = None):
        cfg, self.model, self.ctx = model.config, model, ctx
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
            self.rows = torch.arange(batch, device=model.device)  # the LM head on every row, as contiguous does
        self.ids = torch.randint(0, cfg.vocab_size, shape, generator=g).to(model.device)
        self.split = {"attention": 0.0, "gather": 0.0}
        self.cache.attend = self.timed("attention", self.cache.attend)  # the step's own calls, timed where they run

    def timed(self, part: str, fn):
        def timed_fn(*args, **kwargs):
            synchronize(self.model.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            synchronize(self.model.device)
            self.split[part] += time.perf_counter() - t0
            return out
        return timed_fn

    @torch.inference_mode()
    def step(self) -> dict:
        self.split, real = {"attention": 0.0, "gather": 0.0}, paged_attention.gather_kv
        paged_attention.gather_kv = self.timed("gather", real)  # every gather the paged cache's attention makes
        try:
            meta = self.cache.prepare(self.segments)  # the same step every time: every repeat does the same work
            self.model(self.ids, meta.positions, cache=self.cache, logits_indices=self.rows)
        finally:
            paged_attention.gather_kv = real
        return dict(self.split)


def gathered_bytes(config, dtype, ctx: int, block_size: int) -> int:
    """The gather's bytes per step: whole blocks of K and V, every layer, read and written."""
    return 2 * BATCH * -(-(ctx + 1) // block_size) * block_size * config.kv_bytes_per_token(dtype)


def compare(model, ctx: int, block_size: int, repeats: int, until=None) -> dict:
    """Paged against contiguous at one point, timed in turns, each step split inside; per round: the ratio of the
    steps and every part (rounds added while `until(rounds)` is false, for the judged point)."""
    contiguous, paged = Decode(model, BATCH, ctx), Decode(model, BATCH, ctx, block_size)
    r = interleave({"contiguous step": contiguous.step, "paged step": paged.step}, repeats, device=model.device,
                   desc=f"context {ctx}, block {block_size}", until=until)
    parts = {}
    for cache in ("contiguous", "paged"):
        steps, splits = r.times(f"{cache} step"), r.results(f"{cache} step")
        parts[cache] = {"step_s": steps, "gather_s": [s["gather"] for s in splits],
                        "attention_s": [s["attention"] - s["gather"] for s in splits],  # attention less its gather
                        "outside_s": [t - s["attention"] for t, s in zip(steps, splits)]}
    keys_per_row = -(-(ctx + 1) // block_size) * block_size  # a row's whole blocks
    return {"rounds": r, "context": ctx, "block_size": block_size, "parts": parts,
            "step_ratio": r.ratio("paged step", "contiguous step"),
            "gather_bytes": gathered_bytes(model.config, model.dtype, ctx, block_size),
            "gathers_per_layer": len(paged.cache.decode_groups(BATCH, keys_per_row))}


med = statistics.median


def sizes(n_ctx: int, quick: bool) -> dict:
    judged = n_ctx // 4
    if quick:
        return {"judged": judged, "contexts": [judged], "block_sizes": [4, 16, 64], "repeats": 5}
    return {"judged": judged, "contexts": [n_ctx // 8, judged, n_ctx // 2, n_ctx - 1],
            "block_sizes": [1, 4, 8, 16, 32, 64, 128], "repeats": 5}


def predicted_ratio(config, dtype, ctx: int, block_size: int) -> float:
    return 1 + gathered_bytes(config, dtype, ctx, block_size) / decode_cost(config, ctx, BATCH, dtype).bytes


def predict_gather(lesson, s: dict) -> float:
    cfg, dtype = lesson.config, lesson.dtype
    moved, cost = gathered_bytes(cfg, dtype, s["judged"], BLOCK_SIZE), decode_cost(cfg, s["judged"], BATCH, dtype)
    ratio = predicted_ratio(cfg, dtype, s["judged"], BLOCK_SIZE)
    predict(lesson, f"a contiguous step at batch {BATCH}, context {s['judged']} reads {si(cost.bytes, 'B')}, "
            f"{ms(cost.bytes / lesson.ceilings.bandwidth)} at the measured bandwidth; paging adds a gather that reads "
            f"and writes {si(moved, 'B')}, {ms(moved / lesson.ceilings.bandwidth)}: the paged step should cost "
            f"1 + {si(moved, 'B')} ÷ {si(cost.bytes, 'B')} = {ratio:.2f}× the contiguous one, all of it in "
            f"attention's gather; the claim's line is {BAND}× that, {BAND * ratio:.2f}×", expect={"step_ratio": ratio})
    return ratio


def checks(figures: dict) -> list[Check]:
    """The judged point's paged step ÷ contiguous step, round by round, against the model's ratio × BAND."""
    point, pred = figures["judged_point"], figures["predicted_step_ratio"]
    p, c = point["parts"]["paged"], point["parts"]["contiguous"]
    extra = med(p["step_s"]) - med(c["step_s"])
    rate = point["gather_bytes"] / med(p["gather_s"])
    return [Check(f"paged step ÷ contiguous step at batch {BATCH}, context {point['context']}, block "
                  f"{point['block_size']}", point["step_ratio"], BAND * pred, "<=", fmt="{:.2f}", predicted=pred,
                  key="step_ratio",
                  why=f"the paged step took {ms(extra)} more: {ms(med(p['gather_s']))} inside the gather "
                      f"({si(point['gather_bytes'], 'B')} at {si(rate, 'B/s')}, {pct(rate / figures['bandwidth'])} of "
                      f"the measured bandwidth), {ms(med(p['attention_s']) - med(c['attention_s']))} in the rest of "
                      f"attention, {ms(med(p['outside_s']) - med(c['outside_s']))} outside attention")]


def where_the_extra_goes(point: dict) -> dict:
    """The median round (its step ratio the median one): each cache's parts, and the paged step's extra seconds by
    part, which add up to the extra of the whole step."""
    i = sorted(range(len(point["step_ratio"])), key=point["step_ratio"].__getitem__)[len(point["step_ratio"]) // 2]
    parts = {cache: {k: v[i] for k, v in point["parts"][cache].items()} for cache in ("contiguous", "paged")}
    p, c = parts["paged"], parts["contiguous"]
    return {"round": i + 1, "parts": parts, "step": p["step_s"] - c["step_s"], "gather": p["gather_s"],
            "rest_of_attention": p["attention_s"] - c["attention_s"], "outside_attention": p["outside_s"] - c["outside_s"]}


def facts(figures: dict) -> list[Fact]:
    point = figures["judged_point"]
    p, c = point["parts"]["paged"], point["parts"]["contiguous"]
    attn = (med(p["attention_s"]) + med(p["gather_s"])) / med(c["attention_s"])
    return [Fact("paged attention ÷ contiguous attention, inside the step", attn, fmt="{:.2f}",
                 why=f"context, not a line: vLLM's in-place CUDA kernel paid +{VLLM_ATTENTION_OVERHEAD[0]:.0%}–"
                     f"{VLLM_ATTENTION_OVERHEAD[1]:.0%}; a gather copies what a fused kernel reads in place")]


def measure(lesson, s: dict) -> dict:
    """Paged against contiguous by context, and by block size at the judged context (the judged point's rounds
    added until decided); printed as two tables."""
    model, cfg, dtype, bw = lesson.model, lesson.config, lesson.dtype, lesson.ceilings.bandwidth
    pred = predicted_ratio(cfg, dtype, s["judged"], BLOCK_SIZE)

    def settle(r):  # the judged check, decided
        return Check("", r.ratio("paged step", "contiguous step"), BAND * pred, "<=").outcome() != "INCONCLUSIVE"
    by_context = [compare(model, c, BLOCK_SIZE, s["repeats"], settle if c == s["judged"] else None)
                  for c in s["contexts"]]
    point = next(r for r in by_context if r["context"] == s["judged"])
    by_block = [point if bs == BLOCK_SIZE else compare(model, s["judged"], bs, s["repeats"]) for bs in s["block_sizes"]]

    def row(r):
        p, c = r["parts"]["paged"], r["parts"]["contiguous"]
        padding = gathered_bytes(cfg, dtype, r["context"], r["block_size"]) / gathered_bytes(cfg, dtype, r["context"], 1)
        return [r["context"], r["block_size"], ms(med(c["step_s"])), ms(med(p["step_s"])),
                f"{med(r['step_ratio']):.2f}", f"{predicted_ratio(cfg, dtype, r['context'], r['block_size']):.2f}",
                ms(med(c["attention_s"])), ms(med(p["attention_s"])), ms(med(p["gather_s"])),
                si(r["gather_bytes"], "B"), f"{padding - 1:.0%}", r["gathers_per_layer"],
                pct(r["gather_bytes"] / med(p["gather_s"]) / bw),
                ms(med([a - b for a, b in zip(p["outside_s"], c["outside_s"])]))]
    headers = ["context", "block", "contig step", "paged step", "step ×", "predicted ×", "contig attn",
               "paged attn less gather", "gather", "gathered", "padding", "calls", "gather % bw", "extra outside attn"]
    print_table(headers, [row(r) for r in by_context], f"Batch {BATCH}, block {BLOCK_SIZE}, by context, each step "
                f"split inside (medians of {s['repeats']} rounds; {point['rounds'].count} at context {s['judged']}):")
    print_table(headers, [row(r) for r in by_block], f"Batch {BATCH}, context {s['judged']}, by block size:")
    return {"by_context": by_context, "by_block": by_block, "point": point}


def block_notes(rows: list[dict], bandwidth: float) -> list[str]:
    """Each block size whose gather ran at under 2/3 of block 16's bytes/s: what padding explains, and what not."""
    ref = next((r for r in rows if r["block_size"] == BLOCK_SIZE), None)
    rate = lambda r: r["gather_bytes"] / med(r["parts"]["paged"]["gather_s"])  # noqa: E731
    notes = []
    for r in rows:
        if ref is not None and r is not ref and rate(r) < 2 / 3 * rate(ref):
            took = lambda x: ms(med(x["parts"]["paged"]["gather_s"]))  # noqa: E731
            notes.append(f"block {r['block_size']}: its gather took {took(r)} against {took(ref)} at block "
                         f"{BLOCK_SIZE}, for {si(r['gather_bytes'], 'B')} of whole blocks against {si(ref['gather_bytes'], 'B')}: at {si(rate(r), 'B/s')} against "
                         f"{si(rate(ref), 'B/s')} in {r['gathers_per_layer']} call(s) a layer against "
                         f"{ref['gathers_per_layer']}: a copy slower per byte ({pct(rate(r) / bandwidth)} of the "
                         "bandwidth) than its padding explains")
    return notes


def judge_claim(lesson, figures: dict, rounds, by_block: list[dict]):
    point = figures["judged_point"]
    verdict = judge(f"at batch {BATCH} and context {point['context']}, the paged decode step costs what its gather's "
                    f"bytes predict: at most {BAND}× the cost model's ratio to the contiguous step",
                    checks(figures), lesson.load(), [rounds], facts=facts(figures))
    w = figures["where_the_extra_goes_s"]
    verdict.notes.append(f"where the paged step's extra {ms(w['step'])} went in round {w['round']} (the median one), "
                         f"inside the step: the gather "
                         f"{ms(w['gather'])}, the rest of attention {ms(w['rest_of_attention'])}, outside attention "
                         f"{ms(w['outside_attention'])} (prepare's block tables and slot mapping, and whatever the "
                         "gather's copy evicted from the caches for the layers after it)")
    verdict.notes += block_notes(by_block, figures["bandwidth"])
    print_verdict(verdict)
    return verdict


def plot(lesson, s: dict, m: dict, figures: dict, verdict) -> None:
    point, w = m["point"], figures["where_the_extra_goes_s"]
    cfg, dtype = lesson.config, lesson.dtype
    sweeps = [(m["by_context"], "context", "context (tokens)", f"by context, block {BLOCK_SIZE}"),
              (m["by_block"], "block_size", "block size (tokens)", f"by block size, context {s['judged']}")]
    sweeps = [sw for sw in sweeps if len(sw[0]) > 1]  # a quick run times one context: no sweep to draw
    fig, axes = plt.subplots(1, 1 + len(sweeps), figsize=(5.8 * (1 + len(sweeps)), 5.6))
    for i, cache in enumerate(("contiguous", "paged")):
        parts, bottom = w["parts"][cache], 0.0
        for key, color, label in (("outside_s", "lightgrey", "outside attention"),
                                  ("attention_s", "C0", "attention (less the gather)"), ("gather_s", "C3", "the gather")):
            h = parts[key] * 1e3
            axes[0].bar(i, h, bottom=bottom, color=color, label=label if i == 1 else None)
            bottom += h
    axes[0].set_xticks([0, 1], ["contiguous", "paged"])
    axes[0].axhline(figures["verdict_line"] * w["parts"]["contiguous"]["step_s"] * 1e3, color="k", ls=":",
                    label=f"the claim's line: {BAND}× predicted × contiguous")
    c, p = w["parts"]["contiguous"], w["parts"]["paged"]
    axes[0].set(ylabel=f"ms per decode step (round {w['round']}, the median one)",
                title=f"one step, batch {BATCH}, context {s['judged']}: contiguous {c['step_s'] * 1e3:.3g} ms,\n"
                      f"paged {p['step_s'] * 1e3:.3g} ms, of which {p['gather_s'] * 1e3:.3g} ms in the gather")
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    for ax, (rows, key, label, title) in zip(axes[1:], sweeps):
        xs = [r[key] for r in rows]
        mid = [med(r["step_ratio"]) for r in rows]
        ivs = [median_interval(r["step_ratio"]) for r in rows]  # what the verdict judges by, not the outliers' range
        ax.errorbar(xs, mid, yerr=[[m - iv[0] for m, iv in zip(mid, ivs)], [iv[1] - m for m, iv in zip(mid, ivs)]],
                    fmt="o-", color="C0", capsize=3, label="paged ÷ contiguous step (median, interval)")
        preds = [predicted_ratio(cfg, dtype, r["context"], r["block_size"]) for r in rows]
        ax.plot(xs, preds, "k:", label="the cost model: 1 + gathered ÷ step bytes")
        ax.plot(xs, [BAND * p for p in preds], "r--", lw=1, label=f"{BAND}× the model (the claim's line at the point)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ticks_at(ax, xs)
        ax.set(xlabel=label, ylabel="paged ÷ contiguous step", ylim=(0, None), title=title)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    save_plot(lesson, fig, verdict)


def main(argv=None) -> dict:
    args = make_parser(__doc__).parse_args(argv)
    lesson = start(NAME, args)
    s = sizes(lesson.config.n_ctx, args.quick)
    pred = predict_gather(lesson, s)
    m = measure(lesson, s)
    rounds = m["point"]["rounds"]
    for r in m["by_context"] + m["by_block"]:
        r.pop("rounds", None)
    figures = {"batch": BATCH, "judged_context": s["judged"], "judged_point": m["point"], "predicted_step_ratio": pred,
               "verdict_line": BAND * pred, "bandwidth": lesson.ceilings.bandwidth,
               "where_the_extra_goes_s": where_the_extra_goes(m["point"]),
               "by_context": m["by_context"], "by_block_size": m["by_block"]}
    verdict = judge_claim(lesson, figures, rounds, m["by_block"])
    plot(lesson, s, m, figures, verdict)
    write_results(lesson, figures, verdict)
    return {"figures": figures, "verdict": verdict}


if __name__ == "__main__":
    run(main)
