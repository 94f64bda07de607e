"""What prefix caching buys a workload: the same conversations served caching off and on, and the most it can buy.

Each run gets a fresh engine whose pool holds its whole workload at once
(`conversation_blocks`), so nothing is preempted and caching is the only
difference between the two runs. Rounds of `interleave` name each run
"<workload> off" and "<workload> on"; the ratios are taken within a round:

    gain               throughput on ÷ off
    same-forward gain  off's makespan ÷ (off's makespan + on's host time − off's host time)
                       (both runs given off's forward time: what caching's host work costs, without
                       the noise of the forward passes)
    bound              1 / (1 − prefill share · tokens saved)        (Amdahl's law: the saved prefill
                       tokens' time falls to zero, the rest stays)

Invariant (tests/test_lesson_10_prompt_caching.py): the bound is Amdahl's law on
the prefill saved, and the same-forward gain is 1 when caching adds no host time.
"""
from __future__ import annotations

from ..engine import LLMEngine
from ..kv_pool import CacheConfig
from ..scheduler import SchedulerConfig
from .replay import serve
from .workloads import Conversation, conversation_blocks

BLOCK_SIZE = 16


def make_engine(model, conversations: list[Conversation], caching: bool, block_size: int = BLOCK_SIZE) -> LLMEngine:
    """An engine whose pool holds every conversation at its longest at once, prefix caching on or off."""
    pool = CacheConfig(block_size=block_size, num_gpu_blocks_override=conversation_blocks(conversations, block_size),
                       enable_prefix_caching=caching)
    return LLMEngine(model, SchedulerConfig(max_num_seqs=len(conversations)), pool)


def runner(model, conversations: list[Conversation], caching: bool, concurrency: int | None = None):
    """A function that serves the conversations once, on a fresh engine (`replay.serve`'s closed-loop clients)."""
    return lambda: serve(make_engine(model, conversations, caching), conversations, concurrency)


def gains(r, w: str) -> list[float]:
    """Throughput on ÷ off of workload `w`, one per round."""
    return [b["throughput"] / a["throughput"] for a, b in zip(r.results(f"{w} off"), r.results(f"{w} on"))]


def same_forward_gains(r, w: str) -> list[float]:
    """Throughput on ÷ off of workload `w` with both runs given off's forward time, one per round: off's makespan ÷
    (off's makespan + on's host time − off's). What caching's host work costs, without the noise of the passes."""
    return [a["makespan_s"] / (a["makespan_s"] + b["host_s"] - a["host_s"])
            for a, b in zip(r.results(f"{w} off"), r.results(f"{w} on"))]


def caching_bound(prefill_s: float, decode_s: float, tokens_saved: float) -> dict:
    """The most caching can gain in throughput when prefill takes `prefill_s` and decode `decode_s`, and caching
    saves a share `tokens_saved` of the prefill tokens (Amdahl's law)."""
    share = prefill_s / (prefill_s + decode_s)
    return {"prefill_share": share, "tokens_saved": tokens_saved, "bound": 1 / (1 - share * tokens_saved)}


def throughput_bound(off: dict, on: dict) -> dict:
    """The most caching can gain in throughput: the uncached run's prefill-step share × the prefill tokens saved,
    as if the saved tokens' time fell to zero and the rest stayed."""
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    return caching_bound(off["prefill_steps_s"], off["decode_steps_s"], saved)
