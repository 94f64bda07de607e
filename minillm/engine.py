"""LLMEngine: continuous batching over the paged KV cache.

Requests join and leave the batch *between steps*: a finished request frees
its blocks at once and a waiting one takes its place on the next step, instead
of the whole batch waiting for its longest member. One step reads
schedule → copy → execute → update → record, data flowing one way:

    schedule  scheduler.schedule() → a plan: which sequences feed how many tokens, decodes first
              (and which were preempted); every planned token has a slot. `on_plan` sees it
    copy      copy-on-write: a block the samples of a request share is copied before one writes
    execute   cache.prepare(segments) → the step's PagedMetadata; model(ids, positions) → logits
              only at the rows that sample (and the prompt rows a request scores: `logprobs.py`);
              `sample_sequences` → each row's token (penalties first) and its logprobs if asked
    update    scheduler.update(sampled) → tokens appended, the samples of a prompt just done forked,
              the one stop rule applied, the finished out of the queues with their blocks freed
    record    `last_step` (a StepStats: its rows, prefill chunk or decode) and the timeline, if asked

The pieces, one file each: the policy (`scheduler.py`, `chunked_prefill.py`, `static_batching.py`), the pool
(`block_manager.py`, `paged_attention.py`, sized by `kv_pool.py`; `prefix_caching.py`), the
forward pass of a plan (`model_runner.py`; `cuda_graphs.py` for decode-only steps unless
`enforce_eager=True`), `sampling.py`, and the n samples of one request (`parallel_sampling.py`).
Cost per step: one forward pass over Σ tokens planned, plus bookkeeping linear
in the running sequences; KV memory is blocks in use · block_size · KV bytes per token.

Outputs are the caller's copies and `SamplingParams` are frozen. A finished
request is reported once, then forgotten, as in vLLM. A step is all or nothing:
if `step()` raises anywhere (the forward pass, Ctrl-C, NaN logits), the prefix
cache takes back every hash the step gave; each unfinished request either still
runs with its KV intact and redoes the step's tokens, or waits at the front of
the queue holding no block, to be recomputed; a finished or aborted one is
reported by the next step that returns (`rollback.py`). Non-finite logits abort
only their own requests (NonFiniteLogitsError names them). None vanishes.

A prompt prefilled on another worker enters through two calls of lesson 15's
(`remote_prefill.py`, mixed in): `allocate_remote_prefill`, `start_remote_decode`.

One engine, one thread: a call from a second thread while one runs raises; one
thread owns the engine, others hand it requests through a queue (`request_checks.py`).
Those who watch it read `stats()` (an EngineStats: the queues' request ids, the
pool's blocks, the block tables), never its queues or fields.

Invariants held by the tests: every request's greedy tokens, and their logits,
are those of `kv_cache.generate` run on it alone, whatever the batch, arrivals,
block size, budget, preemptions, prefix hits or decode path (eager, padded, CUDA
graph), and each of n samples seeded s is its seed s + j run alone; after every
step each block is free (or evictable) or held by exactly the running sequences'
tables, and a block several tables hold holds the same tokens in each; when all
have finished every block is free (or evictable) and the engine holds no
request; over 2,000 requests the heap stays flat.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from .block_manager import BlockManager
from .cuda_graphs import DecodeRunner
from .kv_pool import CacheConfig, size_pool
from .model import GPT2
from .model_runner import forward_plan
from .paged_attention import PagedKVCache
from .parallel_sampling import abort_samples, check_shared_blocks, fan_out, group_output, sample_params
from .prefix_caching import PrefixCachingBlockManager
from .remote_prefill import RemotePrefill
from .request_checks import check_fits, check_request, check_samples, one_thread
from .rollback import recover
from .sampling import NonFiniteLogitsError, make_generator, sample_sequences
from .sampling_params import FINISH_ABORT, SamplingParams
from .scheduler import SchedulerConfig, SchedulerOutput
from .sequence import EngineStats, RequestMetrics, RequestOutput, Sequence, StepStats
from .static_batching import policy_for


class LLMEngine(RemotePrefill):
    """Continuous batching over the paged KV cache. One engine, one thread: let one thread own the engine and
    step it, and hand it requests through a queue.Queue (the pattern is in `request_checks.py`)."""

    # The latest step's record while `record_timeline` or `record_steps` (the live page's) is on; else none is built.
    last_step: StepStats | None = None
    record_steps: bool = False
    on_plan: Callable[[SchedulerOutput], None] | None = None  # sees each step's plan, before it runs

    def __init__(self, model: GPT2, scheduler_config: SchedulerConfig | None = None,
                 cache_config: CacheConfig | None = None, enforce_eager: bool = False, record_timeline: bool = True):
        for name, value, kind in (("scheduler_config", scheduler_config, SchedulerConfig),
                                  ("cache_config", cache_config, CacheConfig)):
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"{name} is a {type(value).__name__}; pass a {kind.__name__}, e.g. "
                                 f"{kind.__name__}(**{value!r}) (or None for the defaults)")
        self._guard, self._busy = threading.RLock(), None
        self.model = model.eval()
        self.config = model.config
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.cache_config = cache_config or CacheConfig()
        use_graphs = model.device.type == "cuda" and not enforce_eager  # enforce_eager means nothing on the CPU
        num_blocks, self.memory = size_pool(model, self.scheduler_config, self.cache_config, use_graphs)  # and how
        blocks = PrefixCachingBlockManager if self.cache_config.enable_prefix_caching else BlockManager
        self.block_manager = blocks(num_blocks, self.cache_config.block_size)
        self.cache = PagedKVCache(self.config, self.block_manager, model.device, model.dtype)
        self.decoder = DecodeRunner(model, self.cache, self.scheduler_config.max_num_seqs,
                                    "graph" if use_graphs else "eager")
        self.scheduler = policy_for(self.scheduler_config)(self.scheduler_config, self.block_manager,
                                                           self.config.eos_token_id, self.config.n_ctx)
        self.requests: dict[str, Sequence] = {}  # sample 0 of each request unfinished, or finished and unreported
        self.timeline: list[StepStats] = []  # one row per step; record_timeline=False keeps a long run's memory flat
        self.record_timeline = record_timeline
        self._unreported: list[Sequence] = []  # finished (aborted, or in a step that raised), not yet reported
        self._remote: dict[str, Sequence] = {}  # holding blocks for a prompt's KV computed elsewhere (kv_connector.py)
        self._next_id = 0

    @one_thread
    def close(self) -> None:
        """Free the KV pool and the CUDA graphs now and, on CUDA, hand the allocator's cached memory back
        (`torch.cuda.empty_cache`), so that a next engine, or another process, gets it. No step after this."""
        if self.cache is None:
            return
        cuda = self.cache.pool.device.type == "cuda"
        self.decoder = self.cache = None
        if cuda:
            torch.cuda.empty_cache()

    def __del__(self):
        try:
            self.close()
        except Exception:  # an engine half built, or torch already torn down at exit: nothing left to free
            pass

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @one_thread
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step. Returns its id. `arrival_time` is in
        `time.perf_counter()` seconds (the clock of every metric), at most now; by default now."""
        seq = self._new_sequence(prompt_token_ids, params, request_id, arrival_time)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt_token_ids, params, request_id, arrival_time) -> Sequence:
        """A checked request, not yet queued: every argument is refused here, naming the value and the fix.
        Its sample 0, which holds the others (`samples`) until its prompt is computed."""
        if self.cache is None:
            raise RuntimeError("this engine was closed (its KV pool is freed); build a new LLMEngine")
        now = time.perf_counter()
        prompt_token_ids, params = check_request(self.config, prompt_token_ids, params, request_id, arrival_time,
                                                 now, self.requests)
        if request_id is None:
            while str(self._next_id) in self.requests:  # taken by a caller's own choice
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1  # never reused, though the request it named is forgotten once finished
        check_samples(params.n, self.scheduler_config)  # before n samples are built, whatever n is
        arrival = now if arrival_time is None else float(arrival_time)
        seq, *others = [Sequence(request_id, prompt_token_ids, sp, RequestMetrics(arrival),
                                 make_generator(sp, self.model.device), index=j)
                        for j, sp in enumerate(sample_params(params))]
        seq.samples = others
        check_fits(seq, self.block_manager, self.scheduler_config, params.n)
        return seq

    @one_thread
    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Stop a request now, every sample of it (or only sample `index`, the others going on), and free its
        blocks; the next `step()` reports it ("abort").

        Returns False, and does nothing, for an id the engine does not hold: one already finished (a
        finished request is forgotten once its output is returned), aborted, or never added; and for one
        sample of a request whose samples have not yet forked from its prompt.
        """
        seq = self.requests.get(request_id)
        if seq is None and request_id in self._remote:  # holding blocks for a remote prefill: not yet scheduled
            seq = self.requests[request_id] = self._remote.pop(request_id)  # reported, then forgotten, as any
        if seq is None or not abort_samples(seq, self.scheduler, FINISH_ABORT, time.perf_counter(), index):
            return False
        self._unreported.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has finished (aborted, or in a step that raised) and is not yet
        reported by `step()`."""
        return self.scheduler.has_unfinished() or bool(self._unreported)

    @one_thread
    def stats(self, waiting_ids: int = 0, tables: bool = False, cached_ids: int = 0) -> EngineStats:
        """What the engine holds now, copied (`EngineStats.of`): the wings read this, never its fields."""
        return EngineStats.of(self.scheduler, self.block_manager, waiting_ids, tables, cached_ids)

    def check_invariants(self) -> None:
        """Every block is free (or, with prefix caching, evictable) or held, as often as the tables say, by
        exactly the running sequences, and each running sequence's table covers its computed tokens; a shared
        block holds the same tokens in every table. Cheap enough for tests to call after every step."""
        self.block_manager.check_invariants(self.scheduler.running + list(self._remote.values()))
        check_shared_blocks(self.block_manager, self.scheduler.running)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache ÷ prompt tokens of every request admitted so far."""
        return getattr(self.block_manager, "hit_rate", 0.0)  # 0 without prefix caching

    # ---- one step: schedule → copy → execute → update → record --------------

    @one_thread
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; return the requests that got a token or finished.

        All or nothing: if it raises, the engine is left as if the step had not run, less what it settled
        (requests aborted, finished or sent back to recompute; see the module's docstring)."""
        if self.cache is None:
            raise RuntimeError("this engine was closed (its KV pool is freed); build a new LLMEngine")
        start = time.perf_counter()
        try:
            stepped = self._step(start)
        except BaseException:  # Ctrl-C included: the next step must find the engine whole
            finished = recover(self.scheduler, self.block_manager, self.requests)
            self._unreported += [seq for seq in finished if seq not in self._unreported]
            raise
        reported, self._unreported = self._unreported + stepped, []
        return [self._report(self.requests[rid]) for rid in dict.fromkeys(s.request_id for s in reported)]

    def _step(self, start: float) -> list[Sequence]:
        plan = self.scheduler.schedule()
        if self.on_plan is not None:
            self.on_plan(plan)
        if not plan.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests wait; this is a bug")
            return []
        if self.block_manager.copies:  # copy-on-write: a shared block's KV, copied before a sample writes its own
            self.cache.copy_blocks(self.block_manager.copies)
            self.block_manager.take_copies()  # made: a step that fails from here on leaves them whole
        executed = time.perf_counter()
        sampled = self._execute(plan)
        executed = time.perf_counter() - executed
        self.block_manager.commit()  # the step wrote its keys and values: the blocks it hashed can be shared
        num_rows = len(sampled) - sum(len(s.samples) for s, _, _ in sampled if s.samples and not s.output_token_ids)
        now = time.perf_counter()
        self.scheduler.update(sampled, now)
        if self.record_timeline or self.record_steps:
            self.last_step = StepStats.of(plan, start, now, executed, self.block_manager.num_free_blocks, num_rows)
            if self.record_timeline:
                self.timeline.append(self.last_step)
        return [seq for seq, _, _ in sampled]

    def _execute(self, plan: SchedulerOutput) -> list[tuple[Sequence, int, object]]:
        """Run the plan as one forward pass; returns (sequence, new token, its TokenLogprobs or None) for those
        that sample."""
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        logits, samplers = forward_plan(self.model, self.cache, self.decoder, plan)
        logits, samplers = fan_out(logits, samplers)  # a prompt of n samples is done: each draws its first token
        try:
            sampled = sample_sequences(logits, samplers, self.config.eos_token_id)
        except NonFiniteLogitsError as e:  # fail those requests; the rest redo this step's tokens next step
            bad = [samplers[i].request_id for i in e.rows]
            for request_id in bad:
                self.abort_request(request_id)
            raise NonFiniteLogitsError(e.rows, f"{e}. Requests {bad} were aborted; the next step() reports "
                                               "them", bad) from None
        for chunk in plan.chunks:  # their keys and values are in the cache now, and every token was sampled
            chunk.seq.num_computed_tokens += chunk.num_tokens
        return sampled

    def _report(self, seq: Sequence) -> RequestOutput:
        """The caller's copy of a request's state. A finished request is reported once, then forgotten."""
        out = group_output(seq)
        if out.finished:
            del self.requests[seq.request_id]
        return out

    # ---- convenience --------------------------------------------------------

    @one_thread
    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts.

        It steps the engine until no request is left, so it refuses to start while requests added with
        `add_request` wait or run: their outputs would be consumed here and lost to their caller. Aborts not
        yet reported stay so: the next `step()` reports them. Every prompt is checked before any is queued, so
        a bad one queues none."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams; pass one per prompt, "
                             "or a single SamplingParams for all")
        if self.scheduler.has_unfinished():
            pending = len(self.scheduler.waiting) + len(self.scheduler.running)
            raise RuntimeError(f"generate() runs the engine until it is idle, but {pending} earlier request(s) still "
                               "wait or run, and their outputs would be lost here; step() until "
                               "has_unfinished_requests() is False first, or add these prompts with add_request too")
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            try:
                seqs.append(self._new_sequence(p, sp, None, None))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}; no prompt was queued") from None
        for seq in seqs:
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
        finals: dict[str, RequestOutput] = {}
        held, self._unreported = self._unreported, []
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finals[out.request_id] = out
        finally:
            self._unreported = held + self._unreported
        return [finals[seq.request_id] for seq in seqs]
