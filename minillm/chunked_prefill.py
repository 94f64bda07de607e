"""Chunked prefill: decode-first scheduling under a token budget.

The stall
---------
An engine that runs every prefill whole, ahead of decodes (the scheduler's
prefill-first policy, `scheduler.py`), freezes all running streams while a long
prompt goes through: a 1,000-token prefill can take as long as 20 decode
steps, so every user watching text appear sees it stop. Sarathi-Serve calls
this a generation stall; users call it stutter.

The cure
--------
Give every step a token budget, `max_num_batched_tokens`, and fill it in order:

    1. every running decode, one token each        (memory-bound, cheap in FLOPs)
    2. the next chunk of each partly prefilled prompt, oldest first
    3. chunks of waiting prompts, in arrival order, while budget and blocks last
       (and only if this step preempted no one: memory is short)

A long prompt is thus cut into chunks that ride along with the decodes. The
compute-bound chunk uses the arithmetic units that a memory-bound decode step
leaves idle, so the decodes barely slow down and the prompt still progresses.

What it costs
-------------
A prompt of P tokens under a budget B with d decodes running takes about
⌈P / (B − d)⌉ steps instead of one, and each later chunk re-reads the keys and
values of the chunks before it:

    worst gap a stream sees   ≈ t(step of B tokens)          instead of t(prefill of P) + t(decode)
    extra KV reads of a prompt ≈ Σ over chunks of the tokens before it

The trade-off of the budget:

    small budget  → short steps → low, steady ITL, but a long prompt needs many
                    steps → higher TTFT, and small matmuls use the hardware poorly
    large budget  → fewer, bigger steps → better TTFT and throughput, but each
                    step that carries a chunk is longer → ITL spikes return

Tile effects: matmul kernels work in tiles (e.g. 64 or 128 rows), so a step of
130 tokens can cost nearly as much as one of 256. Budgets that are multiples
of the tile size waste the least. Lesson 11 sweeps the budget.

Everything else, the queues, admission and preemption, is the scheduler's
(`scheduler.py`); this file replaces only its policy.

Invariants held by the tests: with any budget from 1 up, greedy tokens are
identical to unchunked generation; every running decode gets its token in
every step that the budget allows; the oldest pending prompt advances every
step; a waiting prompt is never overtaken by a later one.
"""
from __future__ import annotations

from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import SequenceStatus


class ChunkedPrefillScheduler(Scheduler):
    """The scheduler with the decode-first, budget-filling policy (`enable_chunked_prefill=True`)."""

    chunked_prefill = True

    def _plan(self, out: SchedulerOutput) -> None:
        """Decode-first: running decodes, then chunks of partial prefills, then of waiting prompts."""
        # >>> exercise scheduler-budget-fill (lesson 10, 3 pts): fill one step's token budget, decodes first
        # hint: self._schedule_decodes(out) plans the decodes and returns the budget they used; each sequence then takes as many tokens as it still needs, capped by what is left of the budget (self._reserve gets the room for a running one; self._start_first_waiting() is the next waiting one, started after its cached prefix, and self._admit takes it); waiting prompts join in arrival order, never in a step that preempted, never past max_num_seqs, and a prompt without room is not overtaken
        budget = self.config.max_num_batched_tokens - self._schedule_decodes(out)
        for seq in list(self.running):
            if budget == 0:
                return
            if seq.status is SequenceStatus.RUNNING and not seq.is_decoding:
                n = min(seq.num_remaining, budget)
                if self._reserve(seq, n, out):
                    out.chunks.append(ScheduledChunk(seq, n, is_decode=False))
                    budget -= n
        if out.preempted:  # memory is short: a newcomer would only be preempted in turn
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._start_first_waiting()
            n = min(seq.num_remaining, budget)
            if not self.blocks.can_append(seq, n):
                return
            self._admit(seq, n, out)
            budget -= n
        # <<< exercise
