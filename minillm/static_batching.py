"""Static batching: the batch that continuous batching replaced, run on the same kernels.

Before Orca, a serving system took up to `max_num_seqs` requests, ran them as
one batch until the *last* of them finished, and only then took the next
batch (Hugging Face's padded `generate`, FasterTransformer). A request that
ends early leaves its seat empty: the step still costs about one step of the
full batch while decode is memory-bound (lesson 04), but serves fewer tokens.
Orca calls this request-level scheduling; continuous batching (iteration-level
scheduling, `scheduler.py`) lets a waiting request take the seat at the next step.

The knob is TensorRT-LLM's, `batching_type` ("static", or "continuous": its
INFLIGHT); vLLM has no static mode. With `SchedulerConfig(batching_type="static",
enable_chunked_prefill=False)` the engine runs this policy, prefill-first like
`scheduler.py`'s, with one rule more:

    a batch is formed only when the last one has entirely finished: its members
    are the first `max_num_seqs` waiting requests, and no other request is
    admitted until every member has finished

A member that the budget or the pool keeps out for a step (or that is
preempted, or a sample forked from a member) still joins its batch later.

What it costs
-------------
A batch of outputs o_1 … o_B takes max_i o_i decode steps; continuous batching
needs about Σ o_i ÷ B. Over batches of a workload,

    static decode steps     = Σ over batches of max(o_i)
    continuous decode steps ≈ max(Σ o_i ÷ max_num_seqs, longest o_i)
    seats idle in static    = Σ over batches of Σ_i (max(o) − o_i)

so the win grows with the spread of the output lengths, and is none when all
are equal. A short request also waits for the whole batch ahead of it.

Invariants held by the tests: greedy tokens identical to continuous batching's;
a request is admitted only into an empty batch or into the batch it belongs to;
nothing is lost and, when all have finished, every block is free.
"""
from __future__ import annotations

from itertools import islice

from .chunked_prefill import ChunkedPrefillScheduler
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Sequence


class StaticBatchingScheduler(Scheduler):
    """Prefill-first, admitting only the members of the current batch (`batching_type="static"`)."""

    batching_type = "static"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch: set[int] = set()  # seq_ids of the batch being served

    def _plan(self, out: SchedulerOutput) -> None:
        """A new batch only when no member of the last one runs or waits; then prefill-first, members only."""
        if not self.running and not any(s.seq_id in self.batch for s in self.waiting):
            self.batch = {s.seq_id for s in islice(self.waiting, self.config.max_num_seqs)}
        budget = self.config.max_num_batched_tokens
        while self.waiting and self.waiting[0].seq_id in self.batch and len(self.running) < self.config.max_num_seqs:
            seq = self._start_first_waiting()
            if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
                break
            budget -= seq.num_remaining
            self._admit(seq, seq.num_remaining, out)
        if not out.chunks:
            self._schedule_decodes(out)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The samples of a member's request belong to its batch."""
        self.batch.update(s.seq_id for s in children)
        super().fork(parent, children)


def policy_for(config: SchedulerConfig) -> type[Scheduler]:
    """The scheduler class that implements `config`'s policy."""
    if config.batching_type == "static":
        return StaticBatchingScheduler
    return ChunkedPrefillScheduler if config.enable_chunked_prefill else Scheduler
