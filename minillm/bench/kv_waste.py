"""KV memory that holds tokens against KV memory handed out: a trace replayed under one budget (lesson 07).

Two policies share one `LLMEngine`, scheduler and attention kernel, so the
difference is the memory policy alone:

    contiguous  `slabs` sequences at most, each charged a whole max_model_len slab (M tokens)
    paged       blocks of `block_size` from the same budget, as many sequences as fit

After every step a snapshot counts the real tokens held (Σ cached tokens of the
running sequences) against the memory allocated (contiguous: running · M;
paged: blocks in use · block_size), and the running and waiting sequences:

    waste = 1 − Σ real tokens / Σ allocated tokens          over the steps that hold anything

Waste is a property of token counts: the scheduler and the block manager never
look at the model's width, so `narrow_model` (1 layer, 8 wide, the same context
and vocabulary) replays a trace with the same counts, in seconds. Invariant
(tests/test_lesson_05_fragmentation.py): the replay's waste follows the formula,
and a contiguous run never runs more than `slabs` sequences.
"""
from __future__ import annotations

import statistics

from ..engine import LLMEngine
from ..kv_pool import CacheConfig
from ..model import GPT2
from ..scheduler import SchedulerConfig
from .replay import replay

MAX_NUM_SEQS = 256  # vLLM's default cap on running sequences


def narrow_model(model) -> GPT2:
    """A 1-layer, 8-wide GPT-2 of the same context and vocabulary: the same memory behaviour, cheap to run."""
    return GPT2(model.config.with_(n_layer=1, n_head=1, n_embd=8), seed=0).eval()


def paged_engine(model, blocks: int, block_size: int, max_num_seqs: int = MAX_NUM_SEQS) -> LLMEngine:
    """The engine every replay here runs: prefill-first, whole prompts, `blocks` blocks of `block_size`."""
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=max(2048, model.config.n_ctx),
                                            max_num_seqs=max_num_seqs, enable_chunked_prefill=False),
                     cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=blocks))


def serve_in_budget(model, trace, budget_tokens: int, block_size: int, slabs: int | None = None,
                    desc: str | None = None) -> dict:
    """Replay the trace under the budget, paged, or in `slabs` contiguous max_model_len slabs; snapshot real tokens
    against allocated memory after every step."""
    M = model.config.n_ctx
    engine = paged_engine(model, budget_tokens // block_size, block_size, slabs or MAX_NUM_SEQS)
    snapshots = []

    def snapshot(engine, outputs):
        running, blocks = engine.scheduler.running, engine.block_manager
        allocated = len(running) * M if slabs else (blocks.num_blocks - blocks.num_free_blocks) * block_size
        snapshots.append({"real_tokens": sum(s.num_computed_tokens for s in running), "allocated_tokens": allocated,
                          "running": len(running), "waiting": len(engine.scheduler.waiting)})

    served = replay(engine, trace, on_step=snapshot, desc=desc)
    return {"snapshots": snapshots, **served.summary(), **kv_use(snapshots, budget_tokens)}


def kv_use(snapshots: list[dict], budget_tokens: int) -> dict:
    """Waste and concurrency over a run, every step's snapshot weighing the same.

    waste: share of allocated KV memory (free blocks excluded) not holding a real token;
    sustained_running: mean running sequences while requests still wait (the
    queue is full, so memory is the limit); peak_running: the most at once.
    """
    used = [s for s in snapshots if s["allocated_tokens"]]
    real, allocated = sum(s["real_tokens"] for s in used), sum(s["allocated_tokens"] for s in used)
    saturated = [s["running"] for s in snapshots if s["waiting"]] or [s["running"] for s in snapshots]
    return {"waste": 1 - real / allocated, "real_share_of_budget": real / (budget_tokens * len(used)),
            "peak_running": max(s["running"] for s in snapshots), "sustained_running": statistics.mean(saturated)}
