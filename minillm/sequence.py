"""One request's life in the engine: its tokens, how far its KV is computed, and its clock.

A sequence's tokens are its prompt followed by what it has generated so far.
`num_computed_tokens` counts the leading tokens whose keys and values are in
the cache; it is the one place a sequence's KV length is kept (the block
manager and the caches read it, never keep their own). Everything the
scheduler needs follows from the gap between the two:

    remaining = len(tokens) − num_computed_tokens
    remaining == 1 and it has output  → decoding: feed the last sampled token
    otherwise                         → prefilling: feed the prompt, or part of
                                        it (after a preemption: prompt + output,
                                        recomputed)

A waiting sequence holds no KV. When it is admitted, num_computed_tokens
starts at the leading tokens whose KV the pool already holds: 0, or with
prefix caching the whole blocks another request left there.

A request of n samples is n sequences under one request id: sample 0 computes
the prompt and holds the others (`samples`) until they fork from it
(`parallel_sampling.py`); from then on each is a sequence like any other.

A step that feeds a sequence's last pending token yields logits for its next
token; only then does the engine sample for it. That single rule keeps TTFT
exact however a prompt is split across steps: the first token comes after the
last piece of the prompt.

What it costs: one list of token ids and a few integers per request; the KV
memory it stands for is the block manager's business.

What a caller reads back lives here too, as plain copies that share nothing the
engine changes: `RequestOutput` per request, `StepStats` per step (its rows),
and `EngineStats`, what the engine holds now (`LLMEngine.stats()`: the queues'
request ids, the pool's blocks, the block tables), which the wings read instead
of the engine's fields.

Invariants held by the tests: 0 ≤ num_computed_tokens ≤ len(tokens); a
sequence is decoding exactly when one token is pending and it has output;
a preempted sequence restarts from num_computed_tokens = 0 with its output kept.
"""
from __future__ import annotations

import itertools
from itertools import islice
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams, finish_reason

if TYPE_CHECKING:
    import torch

    from .scheduler import SchedulerOutput

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"    # queued, or preempted and waiting to be recomputed
    RUNNING = "running"    # holds KV blocks and is scheduled step by step
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""
    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    finished_time: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival → first output token (queueing included, as a user sees it)."""
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def copy(self) -> "RequestMetrics":
        """A copy the caller may keep and change, sharing nothing with the engine's."""
        return replace(self, token_times=list(self.token_times))


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability under the model, and the `k` most likely tokens' at its position
    (`top`: (token id, logprob), most likely first). Frozen: outputs share them with the engine safely."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # a request is an entity: equal only to itself, so `in` and `remove` compare identity
class Sequence:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # a prompt never changes: a tuple, safe to hand out
    params: SamplingParams
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    seq_id: int = field(default_factory=lambda: next(_ids))  # the cache's key for this sequence
    index: int = 0  # which sample of its request (n > 1, `parallel_sampling.py`); 0 prefills the prompt
    samples: list[Sequence] = field(default_factory=list)  # sample 0's: the request's other samples, by index
    # Asked for by params.logprobs / params.prompt_logprobs (else None): one entry per output token, and per
    # prompt position (None at position 0, which has no context); filled position by position (logprobs.py).
    output_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def __post_init__(self):
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens to feed before this sequence can sample again."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_remaining == 1 and bool(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self) -> int:
        """The most tokens whose KV this request can ever hold: its last sampled token is never fed."""
        return len(self.prompt_token_ids) + self.params.max_tokens - 1

    def end_reason(self, eos_token_id: int | None, n_ctx: int) -> str | None:
        """Why the last sampled token ends this request ("stop" or "length"), or None if it goes on."""
        return finish_reason(self.output_token_ids[-1], len(self.output_token_ids), self.num_tokens, self.params,
                             eos_token_id, n_ctx)

    def finish(self, reason: str, now: float) -> None:
        """Mark the request finished for `reason` at time `now` (time.perf_counter seconds)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = now


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's: its index among the request's n, its tokens so far, why it ended,
    and its own tokens' log-probabilities (one per token, when params.logprobs is set; else None)."""
    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """One request's state after a step: the caller's own copy, sharing nothing the engine changes.

    `outputs` holds its n samples by index (vLLM's shape), each with its own log-probabilities; a request of
    one sample may be read through `output_token_ids`, `finish_reason` and `logprobs` too. The prompt's
    log-probabilities are the request's, shared by its samples. `finished` once every sample has; `metrics` is the request's
    clock as sample 0 saw it (every sample gets its first token in the same step), finished when the last did."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_preemptions: int = 0  # of all its samples
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache; None if never admitted
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, when params.prompt_logprobs

    def _only(self) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise AttributeError(f"request {self.request_id} has {len(self.outputs)} samples (n > 1): read "
                                 "outputs[i].token_ids and outputs[i].finish_reason")
        return self.outputs[0]

    @property
    def output_token_ids(self) -> list[int]:
        """Everything its one sample generated so far."""
        return self._only().token_ids

    @property
    def finish_reason(self) -> str | None:
        return self._only().finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Its one sample's log-probabilities, one per output token (None unless params.logprobs is set)."""
        return self._only().logprobs


@dataclass
class StepStats:
    """One row of the engine's timeline: what a step did, and what it cost."""
    start: float
    duration: float          # schedule + forward + sample, synchronised
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_preempted: int
    num_free_blocks: int     # after the step
    # The batch, decodes first, in the order the forward pass took them: one (request_id, is_decode, num_tokens,
    # start) per row, `start` its tokens already in the KV cache before the row (the context it attends to).
    # A decode feeds 1 token; a prefill chunk feeds num_tokens of its prompt (after a preemption, prompt +
    # output). Plain tuples: the cheapest to build, and the garbage collector stops tracking them.
    rows: tuple[tuple[str, bool, int, int], ...] = ()
    preempted: tuple[str, ...] = ()   # request ids preempted to make room for this step
    num_sampled: int = 0              # rows that sampled a token: decodes, and chunks that ended a prompt
    forward_s: float = 0.0            # of `duration`, the forward pass and sampling; the rest is host bookkeeping

    @classmethod
    def of(cls, plan: SchedulerOutput, start: float, end: float, forward_s: float, num_free_blocks: int,
           num_sampled: int) -> "StepStats":
        """The record of a step that ran `plan` from `start` to `end`, read once its chunks are computed."""
        rows = tuple((c.seq.request_id, c.is_decode, c.num_tokens, c.seq.num_computed_tokens - c.num_tokens)
                     for c in plan.chunks)
        return cls(start, end - start, plan.num_prefill_tokens, plan.num_decode_tokens, len(plan.chunks),
                   len(plan.preempted), num_free_blocks, rows, tuple(seq.request_id for seq in plan.preempted),
                   num_sampled, forward_s)


@dataclass(frozen=True)
class EngineStats:
    """What an engine holds now (`LLMEngine.stats()`), copied for those who watch it without touching it: the
    server's gauges, the live page, a router of worker processes. A request of n samples is named once per
    running sample."""
    running: tuple[str, ...]  # the request id of each running sequence, in the running queue's order
    num_waiting: int
    num_blocks: int
    num_free_blocks: int      # free, or evictable (prefix caching: cached, held by no one)
    waiting: tuple[str, ...] = ()  # the first waiting request ids, in queue order, as many as were asked for
    block_tables: dict[str, tuple[int, ...]] | None = None  # when asked: each running request's blocks, once
    cached: tuple[int, ...] = ()   # when asked: the evictable blocks, the least recently used first

    @classmethod
    def of(cls, scheduler, blocks, waiting_ids: int = 0, tables: bool = False, cached_ids: int = 0) -> "EngineStats":
        """Read from a scheduler and its block manager: the first `waiting_ids` waiting ids; with `tables`, each
        running request's blocks (its samples' once) and the first `cached_ids` evictable blocks. Cost:
        O(running), and the tables' length when asked."""
        held = None
        if tables:
            held = {}
            for seq in scheduler.running:
                rid = seq.request_id
                held[rid] = tuple(dict.fromkeys((*held.get(rid, ()), *blocks.block_tables.get(seq.seq_id, ()))))
        evictable = getattr(blocks.allocator, "evictable", None) if tables and cached_ids else None
        return cls(tuple(seq.request_id for seq in scheduler.running), len(scheduler.waiting), blocks.num_blocks,
                   blocks.num_free_blocks, tuple(seq.request_id for seq in islice(scheduler.waiting, waiting_ids)),
                   held, tuple(islice(evictable, cached_ids)) if evictable else ())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        """Blocks held ÷ blocks in the pool (vLLM's gauge of the same name)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks if self.num_blocks else 0.0
