"""What a step that raised leaves behind: every request in a state the next step can run.

A step is all or nothing (engine.py's docstring). When `step()` raises, wherever
it does (an exception in the forward pass, Ctrl-C, NaN logits), `recover` settles
each request the engine holds, so that none vanishes and the block manager's
invariants hold again:

- the block manager takes back every hash the step gave (`rollback`): a block is
  trusted only once the step that wrote its keys and values has returned;
- a request whose last token ended it, or that finished or was aborted, frees
  its blocks and is reported by the next step that returns;
- a running request keeps its blocks and redoes the step's tokens if its table
  still covers its computed tokens, none in a block whose hash was taken back,
  and its policy can resume it where it stands;
- any other (mid-admission, mid-preemption, sharing a block the step was to
  write, or mid-prompt under prefill-first) frees its blocks and rejoins the
  front of the waiting queue, in arrival order, to be recomputed, its admission
  uncounted if the failed step was its first;
- a sample of n that has not forked yet waits on, holding nothing.

It moves no sequence between queues itself: it asks the scheduler (`remove`,
`finish_if_done`, the one stop rule, and `requeue`). Cost: O(requests + running).

Invariants held by the tests: whichever call of a step raises, every request
is reported exactly once, a finished one with the tokens it gets alone and an
aborted one a prefix of them; the blocks check after every step, failed ones
included, and none leaks.
"""
from __future__ import annotations

import time

from .parallel_sampling import is_unstarted
from .sequence import Sequence, SequenceStatus


def recover(scheduler, blocks, requests: dict[str, Sequence]) -> list[Sequence]:
    """After a step raised, anywhere in it: make every request (`requests`, by id: each one's sample 0) one the
    next step can run. Returns the sequences found finished, for the engine to report."""
    now = time.perf_counter()
    lost = set(blocks.rollback(scheduler.running))
    running, finished, back = set(scheduler.running), [], []
    for seq in [x for leader in requests.values() for x in (leader, *leader.samples)]:
        if is_unstarted(seq):  # it waits for sample 0's prompt, holding nothing
            continue
        if not seq.is_finished and seq.output_token_ids:  # its last token may have ended it before the step raised
            scheduler.finish_if_done(seq, now)
        if seq.is_finished:
            scheduler.remove(seq)  # frees nothing if the step's own `remove` got that far
            finished.append(seq)
            continue
        if seq in running and seq not in lost and seq.status is SequenceStatus.RUNNING \
                and seq.num_cached_tokens is not None \
                and len(blocks.block_tables.get(seq.seq_id, ())) >= blocks.blocks_for(seq.num_computed_tokens) \
                and seq.num_remaining >= 1 and (seq.is_decoding or scheduler.chunked_prefill):
            continue
        if blocks.forget_admission(seq):  # first admitted by the failed step: counted when admitted again
            seq.num_cached_tokens = None
        back.append(seq)
    scheduler.requeue(back)
    return finished
