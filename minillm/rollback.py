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
"""
from __future__ import annotations

import time

from .parallel_sampling import is_unstarted
from .sequence import SequenceStatus


def recover(engine) -> None:
    """After `engine`'s step raised, anywhere in it: make every request one the next step can run."""
    s, bm, cfg, now = engine.scheduler, engine.block_manager, engine.config, time.perf_counter()
    lost = set(bm.rollback(s.running))
    running, waiting, back = set(s.running), set(s.waiting), []
    for seq in [x for leader in engine.requests.values() for x in (leader, *leader.samples)]:
        if is_unstarted(seq):  # it waits for sample 0's prompt, holding nothing
            continue
        reason = not seq.is_finished and seq.output_token_ids and seq.end_reason(cfg.eos_token_id, cfg.n_ctx)
        if reason:  # its last token ended it, but the step raised before it was marked finished
            seq.finish(reason, now)
        if seq.is_finished:
            bm.free(seq)  # nothing if the step's `remove` got that far
            running.discard(seq)
            if seq in waiting:
                s.waiting.remove(seq)
            if seq not in engine._unreported:
                engine._unreported.append(seq)
            continue
        if seq in running and seq not in lost and seq.status is SequenceStatus.RUNNING \
                and seq.num_cached_tokens is not None \
                and len(bm.block_tables.get(seq.seq_id, ())) >= bm.blocks_for(seq.num_computed_tokens) \
                and seq.num_remaining >= 1 and (seq.is_decoding or s.chunked_prefill):
            continue
        bm.free(seq)
        running.discard(seq)
        if bm.forget_admission(seq):  # first admitted by the failed step: counted when admitted again
            seq.num_cached_tokens = None
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        if seq not in waiting:
            back.append(seq)
    s.running = [seq for seq in s.running if seq in running]
    s.waiting.extendleft(reversed(back))
