"""The scheduler: which sequences run in the next step, and how many tokens each feeds.

Continuous batching
-------------------
Requests arrive at any time and stop after any number of tokens. The
scheduler keeps two queues:

    waiting   arrived, holding no KV yet (or preempted and to be recomputed), in arrival order
    running   holding KV blocks, stepped every step, in arrival order

and once per step turns them into a plan: a list of (sequence, tokens to feed).
A finished request leaves `running` at once and frees its blocks, so a waiting
one can join at the very next step: the batch never waits for its longest
member. This file's policy is the one engines used before chunked prefill:

    prefill-first   admit waiting prompts whole, as many as the token budget
                    `max_num_batched_tokens` and `max_num_seqs` allow, in a step
                    of their own; only a step that admits nothing runs the decodes

`chunked_prefill.py` (lessons 10 and 11) replaces that one policy and keeps the rest;
`static_batching.py` (lesson 09) replaces it with the batching continuous batching replaced.

Memory, and preemption by recompute
-----------------------------------
Every token fed needs a KV slot, so the scheduler asks the block manager for
room (`can_append`, `append_slots`) before it plans a token. When a running
sequence cannot grow, the newest running sequence not already in this step's
plan is *preempted*: its blocks are freed, its computed tokens forgotten, and
it rejoins the *front* of the waiting queue, to be recomputed from its prompt
and output later (vLLM's recompute mode). If no other victim is left, the
sequence preempts itself. A step that preempted admits no waiting request:
memory is short, and a newcomer would only be preempted in turn.

    recompute cost of a victim  = its prompt + output tokens, prefilled again

Decodes are planned oldest first, so a newer sequence never pushes out an
older one; a victim is delayed, never starved.

Admission after a prefix cache hit
----------------------------------
A sequence is admitted at its first token whose KV the pool does not hold:
right before admitting it, the scheduler asks the block manager how many
leading tokens it already holds (none without prefix caching; whole cached
blocks with it, `prefix_caching.py`) and starts `num_computed_tokens` there.
Its first chunk, and what it costs of the budget, is only the rest; a victim
of preemption may find its own blocks still cached when it returns.

The scheduler owns its queues
-----------------------------
Only this class (and its policy subclasses) changes `waiting` and `running`;
everyone else asks it with a verb, as vLLM's `update_from_output` does:

    add, remove          a request arrives; one finishes or is aborted (its blocks freed)
    schedule             the plan for the next step
    update(sampled, now) after the step: each sequence that sampled gets its token, the
                         samples of a prompt just computed fork from it (`fork`), and THE stop
                         rule (`finish_if_done`) ends and removes those it ends
    start_running        a sequence whose KV its blocks already hold (`remote_prefill.py`) joins
    requeue              sequences whose KV a failed step left untrusted wait again (`rollback.py`)

This policy is a plain object, queue state in, a plan for one step out. It
never touches a model or a tensor, so its tests drive it with a fake block
space that only counts tokens. Cost of a step's bookkeeping: O(running).

Invariants held by the tests: a step never holds more than
`max_num_batched_tokens` tokens or `max_num_seqs` sequences; decodes come
first in the plan; a sequence appears at most once per plan; a preempted
sequence is not in the plan of the step that preempted it, and nothing is
admitted in that step; `update` ends a request exactly when the stop rule
says so and frees its blocks at once; a forked sample sits right after its
parent, or waits first in line.
"""
from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The step's knobs, under vLLM's names, given by keyword."""
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256             # the most sequences running at once
    enable_chunked_prefill: bool = True  # decode-first chunks (chunked_prefill.py); False: prefill-first (here)
    batching_type: str = "continuous"   # or "static" (static_batching.py), TensorRT-LLM's knob (STATIC, INFLIGHT)

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer ≥ 1")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} must be True or False")
        if self.batching_type not in ("continuous", "static"):
            raise ValueError(f"batching_type={self.batching_type!r} must be 'continuous' or 'static'")
        if self.batching_type == "static" and self.enable_chunked_prefill:
            raise ValueError("batching_type='static' admits whole prompts, prefill-first: it needs "
                             "enable_chunked_prefill=False (chunks feed a batch that is always open)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_num_seqs={self.max_num_seqs}: a step could not give every running sequence its decode "
                f"token, so some streams would starve. Raise max_num_batched_tokens to at least "
                f"{self.max_num_seqs} or lower max_num_seqs to at most {self.max_num_batched_tokens}")


class BlockSpace(Protocol):
    """What the scheduler asks of KV memory: what it holds of a sequence yet to be admitted, and room for a
    sequence's next tokens, in blocks."""
    def match_prefix(self, seq: Sequence) -> int: ...
    def can_append(self, seq: Sequence, num_new: int) -> bool: ...
    def append_slots(self, seq: Sequence, num_new: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def fork(self, parent: Sequence, child: Sequence) -> None: ...


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # 1 for a decode; a prefill chunk may end anywhere, mid-block included
    is_decode: bool  # the sequence's last sampled token is fed: decided here, once, from seq.is_decoding


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
    """Queues, admission and preemption, with the prefill-first policy."""

    chunked_prefill = False  # which value of SchedulerConfig.enable_chunked_prefill this class implements
    batching_type = "continuous"  # and of SchedulerConfig.batching_type

    def __init__(self, config: SchedulerConfig, blocks: BlockSpace, eos_token_id: int | None = None,
                 n_ctx: int = sys.maxsize):
        if config.enable_chunked_prefill != self.chunked_prefill:
            raise ValueError(f"{type(self).__name__} implements enable_chunked_prefill={self.chunked_prefill}, but "
                             f"the config asks for {config.enable_chunked_prefill}; use "
                             f"{'ChunkedPrefillScheduler (minillm/chunked_prefill.py)' if config.enable_chunked_prefill else 'Scheduler (minillm/scheduler.py)'}")
        if config.batching_type != self.batching_type:
            raise ValueError(f"{type(self).__name__} implements batching_type={self.batching_type!r}, but the config "
                             f"asks for {config.batching_type!r}; use static_batching.policy_for(config)")
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted sequences rejoin at the front
        self.running: list[Sequence] = []        # arrival order
        self.eos_token_id, self.n_ctx = eos_token_id, n_ctx  # what ends a request besides its params: the model's

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_if_done(self, seq: Sequence, now: float) -> bool:
        """THE stop rule (`finish_reason`: a stop token, max_tokens, or the context full), applied to `seq`'s
        last sampled token: if it ends the request, it is finished at `now` and leaves the queues."""
        # >>> exercise scheduler-finish (lesson 07, 1 pt): end a request that its last token ends, and free its seat now
        # hint: seq.end_reason(...) is the stop rule; a request it ends leaves the queues and gives back its blocks in this very call (self.remove does both), not at some later one: a waiting request needs them at the next step; it is finished for that reason at `now`; the return value says whether it ended
        reason = seq.end_reason(self.eos_token_id, self.n_ctx)
        if reason:
            self.remove(seq)
            seq.finish(reason, now)
        return bool(reason)
        # <<< exercise

    def update(self, sampled: list[tuple[Sequence, int, object]], now: float) -> None:
        """After a step: each (sequence, token, its TokenLogprobs or None) that sampled gets its token at `now`;
        a sample 0 whose prompt was just computed first lets its samples fork; then the stop rule."""
        for seq, _, _ in sampled:
            if seq.samples and not seq.output_token_ids:
                self.fork(seq, seq.samples)
        for seq, token, logprobs in sampled:
            seq.output_token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs)
            seq.metrics.token_times.append(now)
            self.finish_if_done(seq, now)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """`children` (the other samples of `parent`'s request, `parallel_sampling.py`) start where `parent`
        stands: into the running queue right after it, sharing its blocks, while `max_num_seqs` allows; the
        rest to the front of the waiting queue, in order, to be recomputed."""
        at, late = self.running.index(parent) + 1, []
        for seq in children:
            seq.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            seq.num_cached_tokens = parent.num_cached_tokens
            if len(self.running) < self.config.max_num_seqs:
                self.blocks.fork(parent, seq)
                seq.num_computed_tokens, seq.status = parent.num_computed_tokens, SequenceStatus.RUNNING
                self.running.insert(at, seq)
                at += 1
            else:
                late.append(seq)
        self.waiting.extendleft(reversed(late))

    def start_running(self, seq: Sequence) -> None:
        """`seq`, whose computed tokens' KV its blocks already hold (a prompt prefilled elsewhere,
        `remote_prefill.py`), joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seqs: list[Sequence]) -> None:
        """`seqs`, whose KV can no longer be trusted (a step that raised, `rollback.py`), free their blocks and
        wait at the front of the queue, in the order given, to be recomputed; one already waiting keeps its place."""
        gone, waiting = set(seqs), set(self.waiting)
        self.running = [seq for seq in self.running if seq not in gone]
        for seq in seqs:
            self.blocks.free(seq)
            seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.extendleft(reversed([seq for seq in seqs if seq not in waiting]))

    def schedule(self) -> SchedulerOutput:
        """The plan for the next step: decodes first, then prefill chunks; and who was preempted for it."""
        out = SchedulerOutput()
        self._plan(out)
        return out

    def _plan(self, out: SchedulerOutput) -> None:
        """Prefill-first: whole prompts, in a step of their own, before any decode resumes."""
        # >>> exercise scheduler-admit (lesson 07, 2 pts): admit waiting prompts between steps, prefill-first
        # hint: a seat a finished request left (update freed it at once) is taken at the very next step, whatever the others still have to do; waiting prompts join in arrival order, whole, while the token budget, max_num_seqs and the KV room (self.blocks.can_append) allow, and one that does not fit is not overtaken (self._start_first_waiting() is the next one, self._admit takes it); a step that admits runs only its prompts, and one that admits nothing runs the decodes (self._schedule_decodes)
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self._start_first_waiting()
            if seq.num_remaining > budget or not self.blocks.can_append(seq, seq.num_remaining):
                break
            budget -= seq.num_remaining
            self._admit(seq, seq.num_remaining, out)
        if not out.chunks:
            self._schedule_decodes(out)
        # <<< exercise

    # ---- shared mechanics ---------------------------------------------------

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        """One token for every running decode, oldest first; returns the tokens scheduled."""
        n = 0
        for seq in list(self.running):
            if seq.status is SequenceStatus.RUNNING and seq.is_decoding and self._reserve(seq, 1, out):
                out.chunks.append(ScheduledChunk(seq, 1, is_decode=True))
                n += 1
        return n

    def _start_first_waiting(self) -> Sequence:
        """The next sequence to admit, starting after the tokens whose KV the pool already holds (a prefix
        cache hit); ask right before admitting it, as the cache changes whenever a block is allocated. A request
        that asks for prompt logprobs takes nothing from the cache: it needs the logits of every prompt position."""
        seq = self.waiting[0]
        seq.num_computed_tokens = 0 if seq.params.prompt_logprobs is not None else self.blocks.match_prefix(seq)
        return seq

    def _admit(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        """Move the first waiting sequence to running with `num_tokens` planned after its cached ones; room
        was checked."""
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.blocks.append_slots(seq, num_tokens)
        if seq.num_cached_tokens is None:  # its first admission: the prompt tokens it found cached
            seq.num_cached_tokens = seq.num_computed_tokens
        out.chunks.append(ScheduledChunk(seq, num_tokens, is_decode=False))

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Get KV room for `seq`, preempting the newest unscheduled running sequences if needed.
        Returns False if `seq` itself had to be preempted."""
        if self.blocks.can_append(seq, num_tokens):  # the common case: room without preempting
            self.blocks.append_slots(seq, num_tokens)
            return True
        scheduled = {id(c.seq) for c in out.chunks}  # O(plan); built only when a victim must be chosen
        while not self.blocks.can_append(seq, num_tokens):
            # >>> exercise scheduler-preempt (lesson 07, 2 pts): free blocks by preempting the newest running sequence
            # hint: who may give up its blocks for `seq`: which running sequences must be spared, and in what order are the others taken (who is the newest)? What if no one else is left? What does the return value tell the caller? (`self._preempt` frees one sequence)
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
            # <<< exercise
        self.blocks.append_slots(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free all of `seq`'s blocks; it will be recomputed from scratch (vLLM's recompute mode)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
