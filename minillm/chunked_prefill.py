"""Chunked prefill: decode-first scheduling under a token budget.

The stall
---------
An engine that runs every prefill whole, ahead of decodes, freezes all running
streams while a long prompt goes through: a 1,000-token prefill can take as
long as 20 decode steps, so every user watching text appear sees it stop.
Sarathi-Serve calls this a generation stall; users call it stutter.

The cure
--------
Give every step a token budget, `max_num_batched_tokens`, and fill it in order:

    1. every running decode, one token each        (memory-bound, cheap in FLOPs)
    2. the next chunk of each partly prefilled prompt, oldest first
    3. chunks of waiting prompts, in arrival order, while budget and blocks last

A long prompt is thus cut into chunks that ride along with the decodes. The
compute-bound chunk uses the arithmetic units that a memory-bound decode step
leaves idle, so the decodes barely slow down and the prompt still progresses.

The trade-off of the budget
---------------------------
    small budget  → short steps → low, steady ITL, but a long prompt needs many
                    steps → higher TTFT, and small matmuls use the hardware poorly
    large budget  → fewer, bigger steps → better TTFT and throughput, but each
                    step that carries a chunk is longer → ITL spikes return

Tile effects: matmul kernels work in tiles (e.g. 64 or 128 rows), so a step of
130 tokens can cost nearly as much as one of 256. Budgets that are multiples
of the tile size waste the least. Lesson 06 sweeps the budget.

With `enable_chunked_prefill=False` the policy is the one engines used before
chunking: waiting prompts are prefilled whole, in a step of their own, before
decodes resume. That is the baseline lesson 06 measures against.

Memory: a sequence that cannot get the KV blocks it needs preempts the newest
running sequence not already in this step's plan, or itself if none is left;
the victim's blocks are freed and it is recomputed later, as in vLLM. Because
decodes are planned first, a decode may preempt an older, partly prefilled
prompt. A victim rejoins the *front* of the waiting queue, ahead of every
request not yet admitted, so it is delayed but never starved.

This policy is a plain object: queue state in, a plan for one step out. It
never touches a model, so its tests drive it with a fake one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256             # the most sequences running at once
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer ≥ 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_num_seqs={self.max_num_seqs}: a step could not give every running sequence its decode "
                f"token, so some streams would starve. Raise max_num_batched_tokens to at least "
                f"{self.max_num_seqs} or lower max_num_seqs to at most {self.max_num_batched_tokens}")


class BlockSpace(Protocol):
    """What the scheduler asks of the KV cache: room for tokens, in blocks."""
    def can_append(self, seq_id: int, num_new: int) -> bool: ...
    def append_slots(self, seq_id: int, num_new: int) -> None: ...
    def free(self, seq_id: int) -> None: ...


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # 1 for a decode; a prefill chunk may end anywhere, mid-block included
    is_decode: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockSpace):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted sequences rejoin at the front
        self.running: list[Sequence] = []        # arrival order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.enable_chunked_prefill:
            self._fill_budget(out)
        else:
            self._prefill_first(out)
        return out

    # ---- the two policies ---------------------------------------------------

    def _fill_budget(self, out: SchedulerOutput) -> None:
        """Decode-first: running decodes, then chunks of partial prefills, then of waiting prompts."""
        # >>> exercise scheduler-budget-fill (lesson 06, 3 pts): fill one step's token budget, decodes first
        # hint: budget = max_num_batched_tokens; self._schedule_decodes(out) returns the budget it used; then for running sequences that are not decoding, then self.waiting (admit with self._admit), take min(seq.num_remaining, budget left) via self._reserve; stop admitting when a waiting prompt gets no room (keep arrival order)
        budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
        for seq in list(self.running):
            if budget == 0:
                return
            if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
                n = min(seq.num_remaining, budget)
                if self._reserve(seq, n, out):
                    out.chunks.append(ScheduledChunk(seq, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_remaining, budget)
            if not self.blocks.can_append(seq.seq_id, n):
                return
            self._admit(seq, n, out)
            budget -= n
        # <<< exercise

    def _prefill_first(self, out: SchedulerOutput) -> None:
        """The baseline: whole prompts, in a step of their own, before any decode resumes."""
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_remaining > budget or not self.blocks.can_append(seq.seq_id, seq.num_remaining):
                break
            budget -= seq.num_remaining
            self._admit(seq, seq.num_remaining, out)
        if not out.chunks:
            self._schedule_decodes(out)

    # ---- shared mechanics ---------------------------------------------------

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        """One token for every running decode, oldest first; returns the tokens scheduled."""
        n = 0
        for seq in list(self.running):
            if seq.status is SequenceStatus.RUNNING and seq.is_decoding and self._reserve(seq, 1, out):
                out.chunks.append(ScheduledChunk(seq, 1, is_decode=True))
                n += 1
        return n

    def _admit(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.blocks.append_slots(seq.seq_id, num_tokens)
        out.chunks.append(ScheduledChunk(seq, num_tokens))

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Get KV room for `seq`, preempting the newest unscheduled running sequences if needed.
        Returns False if `seq` itself had to be preempted."""
        if self.blocks.can_append(seq.seq_id, num_tokens):  # the common case: room without preempting
            self.blocks.append_slots(seq.seq_id, num_tokens)
            return True
        scheduled = {id(c.seq) for c in out.chunks}  # O(plan); built only when a victim must be chosen
        while not self.blocks.can_append(seq.seq_id, num_tokens):
            # >>> exercise scheduler-preempt (lesson 05, 2 pts): free blocks by preempting the newest running sequence
            # hint: the victim is the newest running sequence that is neither `seq` nor already in this step's plan (`scheduled` holds their id()), else `seq` itself; preempt it with `self._preempt`; give up (False) if that was `seq`
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
            # <<< exercise
        self.blocks.append_slots(seq.seq_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free all of `seq`'s blocks; it will be recomputed from scratch (vLLM's recompute mode)."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
