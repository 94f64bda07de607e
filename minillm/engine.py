"""LLMEngine: continuous batching over the paged KV cache.

Serving means many requests of unknown length at once. Continuous batching
lets them join and leave the batch *between steps*: a finished request frees
its blocks at once and a waiting one takes its place on the next step, instead
of the whole batch waiting for its longest member.

One step, data flowing one way:

    scheduler.schedule()      → a plan: which sequences feed how many tokens, decodes
                                first (and which were preempted to make room); the
                                block manager has given every planned token a slot
    cache.prepare(segments)   → the step's PagedMetadata: positions, slot mapping,
                                block tables, context lengths, built once (decodes
                                only: written into buffers allocated once, below)
    model(ids, positions)     → one forward pass over the flattened ragged batch,
                                logits only at the rows that will sample
    sample, update, record    → new tokens, finished requests free their blocks,
                                per-request times and a per-step timeline

The pieces, each in its own file: `scheduler.py` or `chunked_prefill.py` (the
policy), `block_manager.py` (which blocks each sequence owns),
`paged_attention.py` (the pool), `cuda_graphs.py` (decode-only steps on buffers
allocated once: on CUDA the replay of a graph per batch and width bucket,
eager at exact shapes with `enforce_eager=True` or on the CPU; prefill and
mixed steps always run eagerly), `sampling.py`, and `kv_pool.py` (the pool's
size). Names follow vLLM's (`add_request`, `abort_request`, `step`,
`has_unfinished_requests`, `RequestOutput`, and every knob).

Prefix caching (`enable_prefix_caching=True`, off by default): full blocks are
kept by the hash of their whole prefix and shared by every request that
starts alike (`prefix_caching.py`). Each output carries `num_cached_tokens`,
the prompt tokens its request found cached; `prefix_cache_hit_rate` is the
share of all admitted prompt tokens that were.

Sizing the pool: `num_blocks`, or a byte budget `kv_cache_memory_bytes`, or
on CUDA `gpu_memory_utilization`, from which a profile run takes what the
engine's largest steps need (`kv_pool.py`). `close()` frees the pool and the
graphs and empties the cache for other processes.

What it costs: per step, one forward pass over Σ tokens planned, plus Python
bookkeeping linear in the running sequences; KV memory is blocks in use ·
block_size · KV bytes per token.

Who owns what: `step()` hands back `RequestOutput`s that are the caller's own
copies (token lists, metrics), and `SamplingParams` are frozen, so nothing a
caller does to them reaches the engine. A finished request's output is
returned once, with its metrics and preemption count, and then the engine
forgets the request, as vLLM does: keep what you need from that output. The
requests still running or waiting are in `scheduler.running` and
`scheduler.waiting`. Logits that are not finite fail only their own requests:
those are aborted (the next step reports them) and `step()` raises
NonFiniteLogitsError naming them; the rest redo the step's tokens.

A step is all or nothing. If `step()` raises, wherever it does (an exception
in the forward pass, Ctrl-C, NaN logits), nothing of it stays half done: the
prefix cache takes back every hash the step gave (a block is trusted only once
a step that wrote its keys and values has returned, `prefix_caching.py`);
each unfinished request is either still running with its KV intact, to redo
the step's tokens next step, or back at the front of the waiting queue holding
no block, to be recomputed (one that shared a block the step was to write, or
that the prefill-first policy cannot resume mid-prompt); a request that
finished or was aborted is reported by the next step that returns. None
vanishes, and the invariants below hold after the exception as after a step.

One engine, one thread. Nothing here is locked, so two threads inside one
engine would corrupt it silently; instead `step`, `add_request`,
`abort_request`, `generate` and `close` refuse, with a RuntimeError naming this
rule, to start while another thread is inside one of them. The safe pattern:
one thread owns the engine and loops over `step()`; other threads hand it
requests and aborts through a `queue.Queue`, which the owner drains between
steps, and receive outputs the same way:

    def owner(engine, inbox, outbox):                 # the only thread that touches engine
        while True:
            while not inbox.empty() or not engine.has_unfinished_requests():
                kind, *args = inbox.get()             # blocks while there is nothing to do
                if kind == "add":
                    engine.add_request(*args)
                else:
                    engine.abort_request(*args)
            for out in engine.step():
                outbox.put(out)

Invariants held by the tests: every request's greedy tokens, and the logits
they were chosen from, are those of `kv_cache.generate` run on it alone,
whatever the batch, arrival pattern, block size, budget, preemptions or
prefix cache hits, and whether decode steps run eagerly, padded, or as CUDA
graphs; after every step each block is free (or evictable) or held by exactly
the running sequences' tables; when every request has finished, every block is
free (or evictable) and the engine holds no request; over 2,000 requests the
Python heap stays flat.
"""
from __future__ import annotations

import functools
import math
import numbers
import threading
import time

import torch

from .block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from .chunked_prefill import ChunkedPrefillScheduler
from .cuda_graphs import DecodeRunner
from .kv_cache import Segment
from .kv_pool import size_pool
from .model import GPT2
from .paged_attention import PagedKVCache
from .prefix_caching import PrefixCachingBlockManager
from .sampling import (FINISH_ABORT, NonFiniteLogitsError, SamplingParams, check_prompt, finish_reason,
                       make_generator, sample, to_device)
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import RequestMetrics, RequestOutput, Sequence, SequenceStatus, StepStats


def one_thread(method):
    """Run an engine method holding the engine's guard, refusing a call from a second thread while one runs.

    The guard is re-entrant (the NonFiniteLogitsError path of `step` aborts requests), and never waits: a
    second thread that waited would still interleave its calls with the owner's between steps."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._guard.acquire(blocking=False):
            raise RuntimeError(f"LLMEngine.{method.__name__}() called from thread "
                               f"{threading.current_thread().name!r} while {self._busy or 'another call'} is "
                               "running: one engine, one thread. Let one thread own the engine and step it, and "
                               "hand it requests through a queue.Queue (see LLMEngine's docstring)")
        outer, self._busy = self._busy, f"{method.__name__}() in thread {threading.current_thread().name!r}"
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy = outer
            self._guard.release()
    return guarded


class LLMEngine:
    def __init__(self, model: GPT2, scheduler_config: SchedulerConfig | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, enable_prefix_caching: bool = False,
                 record_timeline: bool = True):
        if scheduler_config is not None and not isinstance(scheduler_config, SchedulerConfig):
            raise ValueError(f"scheduler_config is a {type(scheduler_config).__name__}; pass a SchedulerConfig, "
                             f"e.g. SchedulerConfig(**{scheduler_config!r}) (or None for the defaults)")
        self._guard, self._busy = threading.RLock(), None
        self.model = model.eval()
        self.config = model.config
        self.scheduler_config = scheduler_config or SchedulerConfig()
        use_graphs = model.device.type == "cuda" and not enforce_eager  # enforce_eager means nothing on the CPU
        # how the pool was sized: budget, activation peak, graph bytes
        num_blocks, self.memory = size_pool(model, self.scheduler_config, block_size, num_blocks,
                                            kv_cache_memory_bytes, gpu_memory_utilization, use_graphs)
        blocks = PrefixCachingBlockManager if enable_prefix_caching else BlockManager
        self.block_manager = blocks(num_blocks, block_size)
        self.cache = PagedKVCache(self.config, self.block_manager, model.device, model.dtype)
        self.decoder = DecodeRunner(model, self.cache, self.scheduler_config.max_num_seqs,
                                    "graph" if use_graphs else "eager")
        policy = ChunkedPrefillScheduler if self.scheduler_config.enable_chunked_prefill else Scheduler
        self.scheduler = policy(self.scheduler_config, self.block_manager)
        self.requests: dict[str, Sequence] = {}  # unfinished, or finished and not yet reported
        self.timeline: list[StepStats] = []  # one row per step; record_timeline=False keeps a long run's memory flat
        self.record_timeline = record_timeline
        self._unreported: list[Sequence] = []  # finished (aborted, or in a step that raised), not yet reported
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

    # ---- requests -----------------------------------------------------------

    @one_thread
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step. Returns its id.

        `arrival_time` is in `time.perf_counter()` seconds (the clock of every metric), at most now; by default
        now."""
        seq = self._new_sequence(prompt_token_ids, params, request_id, arrival_time)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt_token_ids, params, request_id, arrival_time) -> Sequence:
        """A checked request, not yet queued: every argument is refused here, naming the value and the fix."""
        if self.cache is None:
            raise RuntimeError("this engine was closed (its KV pool is freed); build a new LLMEngine")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params is a {type(params).__name__}; pass a SamplingParams (or None for the defaults)")
        prompt_token_ids = tuple(check_prompt(self.config, prompt_token_ids, params.max_tokens))
        vocab = self.config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop token id {t} is outside the vocabulary of {vocab} tokens (ids 0 to "
                                 f"{vocab - 1}): it could never be generated; drop it or use the model's tokenizer")
        now = time.perf_counter()
        if arrival_time is not None:
            if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
                    or not math.isfinite(arrival_time) or arrival_time > now:
                raise ValueError(f"arrival_time={arrival_time!r} must be a time.perf_counter() reading no later "
                                 f"than now ({now:.3f}); time.time() is another clock. Leave it out to mean now")
        if request_id is None:
            while str(self._next_id) in self.requests:  # taken by a caller's own choice
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1  # never reused, though the request it named is forgotten once finished
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} is a {type(request_id).__name__}; it must be a str "
                             f"(str({request_id!r}) will do), or None for an automatic one")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique "
                             "(pass another, or none for an automatic one)")
        seq = Sequence(request_id, prompt_token_ids, params,
                       RequestMetrics(now if arrival_time is None else float(arrival_time)),
                       make_generator(params, self.model.device))
        self._check_fits(seq)
        return seq

    def _check_fits(self, seq: Sequence) -> None:
        """Reject now a request that could never run, rather than let it wait forever."""
        tokens, bs = seq.max_total_tokens(), self.block_manager.block_size
        blocks = self.block_manager.blocks_for(tokens)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"request needs up to {tokens} tokens of KV = {blocks} blocks of {bs}, but the whole "
                             f"pool has {self.block_manager.num_blocks} blocks; lower max_tokens, shorten the prompt, "
                             "or give the engine more KV memory (num_blocks / kv_cache_memory_bytes)")
        budget = self.scheduler_config.max_num_batched_tokens
        if not self.scheduler_config.enable_chunked_prefill and tokens > budget:
            raise ValueError(f"with chunked prefill off, a request is (re)computed in one step, and this one can "
                             f"reach {tokens} tokens > max_num_batched_tokens={budget}; raise the budget to at "
                             f"least {tokens} or set enable_chunked_prefill=True")

    @one_thread
    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next `step()` reports it finished ("abort").

        Returns False, and does nothing, for an id the engine does not hold: one already finished (a
        finished request is forgotten once its output is returned), aborted, or never added.
        """
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, FINISH_ABORT, time.perf_counter())
        self._unreported.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or has finished (aborted, or in a step that raised) and is not yet
        reported by `step()`."""
        return self.scheduler.has_unfinished() or bool(self._unreported)

    def check_invariants(self) -> None:
        """Every block is free (or, with prefix caching, evictable) or held, as often as the tables say, by
        exactly the running sequences, and each running sequence's table covers its computed tokens. Cheap
        enough for tests to call after every step."""
        self.block_manager.check_invariants(self.scheduler.running)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache ÷ prompt tokens of every request admitted so far."""
        return getattr(self.block_manager, "hit_rate", 0.0)  # 0 without prefix caching

    # ---- one step -----------------------------------------------------------

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
            self._recover()
            raise
        reported, self._unreported = self._unreported + stepped, []
        return [self._report(s) for s in reported]

    def _step(self, start: float) -> list[Sequence]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests wait; this is a bug")
            return []
        sampled = self._execute(plan)
        self.block_manager.commit()  # the step wrote its keys and values: the blocks it hashed can be shared
        now = time.perf_counter()
        for seq, token in sampled:
            seq.output_token_ids.append(token)
            seq.metrics.token_times.append(now)
            reason = finish_reason(token, len(seq.output_token_ids), seq.num_tokens, seq.params,
                                   self.config.eos_token_id, self.config.n_ctx)
            if reason:
                self.scheduler.remove(seq)
                self._finish(seq, reason, now)
        if self.record_timeline:
            self.timeline.append(StepStats(start, now - start, plan.num_prefill_tokens, plan.num_decode_tokens,
                                           len(plan.chunks), len(plan.preempted), self.block_manager.num_free_blocks))
        return [seq for seq, _ in sampled]

    def _recover(self) -> None:
        """After a step raised, anywhere in it: make every request one the next step can run.

        The block manager takes back the hashes the step gave (`rollback`). A running request is kept if its
        table still covers its computed tokens, none of them in a block whose hash was taken back, and its
        policy can resume it where it stands; any other unfinished one (mid-admission, mid-preemption, or
        sharing a block the step was to write) frees its blocks and rejoins the front of the waiting queue,
        in arrival order, to be recomputed, its admission uncounted if it was its first. A finished one not
        yet reported is reported by the next step."""
        s, bm, now = self.scheduler, self.block_manager, time.perf_counter()
        lost = set(bm.rollback(s.running))
        running, waiting, back = set(s.running), set(s.waiting), []
        for seq in self.requests.values():
            reason = not seq.is_finished and seq.output_token_ids and finish_reason(
                seq.output_token_ids[-1], len(seq.output_token_ids), seq.num_tokens, seq.params,
                self.config.eos_token_id, self.config.n_ctx)
            if reason:  # its last token ended it, but the step raised before it was marked finished
                self._finish(seq, reason, now)
            if seq.is_finished:
                bm.free(seq)  # nothing if the step's `remove` got that far
                running.discard(seq)
                if seq in waiting:
                    s.waiting.remove(seq)
                if seq not in self._unreported:
                    self._unreported.append(seq)
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

    def _execute(self, plan: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Run the plan as one forward pass; returns (sequence, new token) for those that sample."""
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        if all(chunk.is_decode for chunk in plan.chunks):  # decode only: static buffers, a graph on CUDA
            samplers = [chunk.seq for chunk in plan.chunks]
            segments = [Segment(s.seq_id, s.num_computed_tokens, 1, True) for s in samplers]
            logits = self.decoder.run(segments, [s.output_token_ids[-1] for s in samplers])
        else:
            logits, samplers = self._execute_eager(plan)
        try:
            tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        except NonFiniteLogitsError as e:  # fail those requests; the rest redo this step's tokens next step
            bad = [samplers[i].request_id for i in e.rows]
            for request_id in bad:
                self.abort_request(request_id)
            raise NonFiniteLogitsError(e.rows, f"{e}. Requests {bad} were aborted; the next step() reports "
                                               "them") from None
        for chunk in plan.chunks:  # their keys and values are in the cache now, and every token was sampled
            chunk.seq.num_computed_tokens += chunk.num_tokens
        return list(zip(samplers, tokens))

    def _execute_eager(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """A step with prefill chunks: one ragged forward pass over the flattened batch, shaped for this step."""
        ids, segments, sample_rows, samplers = [], [], [], []
        for chunk in plan.chunks:
            seq, n, start = chunk.seq, chunk.num_tokens, chunk.seq.num_computed_tokens
            # A decode feeds its last sampled token; only a prefill chunk needs the token list sliced.
            ids.extend(seq.output_token_ids[-1:] if chunk.is_decode else seq.token_ids[start:start + n])
            segments.append(Segment(seq.seq_id, start, n, chunk.is_decode))
            if start + n == seq.num_tokens:  # its last pending token is in: it samples this step
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        device = self.model.device
        meta = self.cache.prepare(segments)
        logits = self.model(to_device([ids], device), meta.positions, cache=self.cache,
                            logits_indices=to_device(sample_rows, device))
        return logits, samplers

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now

    def _report(self, seq: Sequence) -> RequestOutput:
        """The caller's copy of a request's state. A finished request is reported once, then forgotten."""
        if seq.is_finished:
            del self.requests[seq.request_id]
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.is_finished,
                             seq.finish_reason, seq.metrics.copy(), seq.num_preemptions, seq.num_cached_tokens)

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


