"""LLMEngine: continuous batching over the paged KV cache.

Serving means many requests of unknown length at once. Continuous batching
lets them join and leave the batch *between steps*: a finished request frees
its blocks at once and a waiting one takes its place on the next step, instead
of the whole batch waiting for its longest member.

One step, data flowing one way:

    scheduler.schedule()      → a plan: which sequences feed how many tokens, decodes
                                first (and which were preempted to make room); the
                                block manager has given every planned token a slot
    cache.prepare(segments)   → the step's AttentionMetadata: positions, slot mapping,
                                block tables, context lengths, built once
    model(ids, positions)     → one forward pass over the flattened ragged batch,
                                logits only at the rows that will sample
    sample, update, record    → new tokens, finished requests free their blocks,
                                per-request times and a per-step timeline

The pieces, each in its own file: `scheduler.py` (queues, admission,
preemption) or `chunked_prefill.py` (its decode-first policy),
`block_manager.py` (which blocks each sequence owns), `paged_attention.py`
(the pool and attention through block tables), `sampling.py`.

Names follow vLLM: `add_request`, `abort_request`, `step`, `has_unfinished_requests`,
`SamplingParams`, `RequestOutput`, `max_num_batched_tokens`, `max_num_seqs`,
`block_size`, `gpu_memory_utilization`, `kv_cache_memory_bytes`,
`enable_prefix_caching`, `num_cached_tokens`.

Prefix caching (`enable_prefix_caching=True`, off by default): full blocks are
kept by the hash of their whole prefix and shared by every request that
starts alike (`prefix_caching.py`). Each output carries `num_cached_tokens`,
the prompt tokens its request found cached; `prefix_cache_hit_rate` is the
share of all admitted prompt tokens that were.

Sizing the pool: give `num_blocks` directly; or a byte budget
`kv_cache_memory_bytes`; or, on CUDA, `gpu_memory_utilization`, the share of
the GPU's memory the engine may fill: weights and everything else already
allocated are subtracted and the rest becomes KV blocks. On the CPU the
default budget is 1 GiB.

What it costs: per step, one forward pass over Σ tokens planned, plus Python
bookkeeping linear in the running sequences; KV memory is blocks in use ·
block_size · KV bytes per token.

Invariants held by the tests: every request's greedy tokens, and the logits
they were chosen from, are those of `kv_cache.generate` run on it alone,
whatever the batch, arrival pattern, block size, budget, preemptions or
prefix cache hits; after every step each block is free (or evictable) or held
by exactly the running sequences' tables; when every request has finished,
every block is free (or evictable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from .chunked_prefill import ChunkedPrefillScheduler
from .kv_cache import Segment
from .model import GPT2
from .paged_attention import PagedKVCache
from .prefix_caching import PrefixCachingBlockManager
from .sampling import FINISH_ABORT, SamplingParams, finish_reason, make_generator, sample
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import RequestMetrics, Sequence, SequenceStatus

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache; None if never admitted


@dataclass
class StepStats:
    """One row of the engine's timeline."""
    start: float
    duration: float          # schedule + forward + sample, synchronised
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_preempted: int
    num_free_blocks: int     # after the step


class LLMEngine:
    def __init__(self, model: GPT2, scheduler_config: SchedulerConfig | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = False):
        self.model = model.eval()
        self.config = model.config
        self.scheduler_config = scheduler_config or SchedulerConfig()
        if num_blocks is None:
            num_blocks = self._num_blocks_for_budget(block_size, kv_cache_memory_bytes, gpu_memory_utilization)
        blocks = PrefixCachingBlockManager if enable_prefix_caching else BlockManager
        self.block_manager = blocks(num_blocks, block_size)
        self.cache = PagedKVCache(self.config, self.block_manager, model.device, model.dtype)
        policy = ChunkedPrefillScheduler if self.scheduler_config.enable_chunked_prefill else Scheduler
        self.scheduler = policy(self.scheduler_config, self.block_manager)
        self.requests: dict[str, Sequence] = {}
        self.timeline: list[StepStats] = []
        self._aborted: list[Sequence] = []
        self._next_id = 0

    def _num_blocks_for_budget(self, block_size: int, budget: int | None, utilization: float) -> int:
        block_bytes = block_size * self.config.kv_bytes_per_token(self.model.dtype)
        if budget is None and self.model.device.type == "cuda":
            if not 0 < utilization <= 1:
                raise ValueError(f"gpu_memory_utilization={utilization} must be in (0, 1]")
            free, total = torch.cuda.mem_get_info(self.model.device)
            budget = int(total * utilization) - (total - free)  # what is left of our share after the weights
        elif budget is None:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV budget of {budget / 2**20:.1f} MiB holds no block of {block_bytes / 2**20:.2f} MiB "
                             f"({block_size} tokens); raise kv_cache_memory_bytes or gpu_memory_utilization, "
                             "or use a smaller model")
        return num_blocks

    # ---- requests -----------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step. Returns its id."""
        params = params or SamplingParams()
        prompt_token_ids = self.config.check_prompt(prompt_token_ids, params.max_tokens)
        if request_id is None:
            while str(self._next_id) in self.requests:  # taken: by an earlier request, or chosen by a caller
                self._next_id += 1
            request_id = str(self._next_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique "
                             "(pass another, or none for an automatic one)")
        seq = Sequence(request_id, prompt_token_ids, params,
                       RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
                       make_generator(params, self.model.device))
        self._check_fits(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

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

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next `step()` reports it finished ("abort")."""
        if request_id not in self.requests:
            raise KeyError(f"no request with id {request_id!r}; known ids: {sorted(self.requests)[:10]}")
        seq = self.requests[request_id]
        if seq.is_finished:
            return
        self.scheduler.remove(seq)
        self._finish(seq, FINISH_ABORT, time.perf_counter())
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs, or was aborted and not yet reported by `step()`."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def check_invariants(self) -> None:
        """Every block is free (or, with prefix caching, evictable) or held, as often as the tables say, by
        exactly the running sequences, and each running sequence's table covers its computed tokens. Cheap
        enough for tests to call after every step."""
        self.block_manager.check_invariants(self.scheduler.running)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache ÷ prompt tokens of every request admitted so far."""
        s = self.scheduler
        return s.num_cached_prompt_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0

    # ---- one step -----------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; return the requests that got a token or finished."""
        start = time.perf_counter()
        outputs = [self._output(s) for s in self._aborted]
        self._aborted = []
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests wait; this is a bug")
            return outputs
        sampled = self._execute(plan)
        now = time.perf_counter()
        for seq, token in sampled:
            seq.output_token_ids.append(token)
            seq.metrics.token_times.append(now)
            reason = finish_reason(token, len(seq.output_token_ids), seq.num_tokens, seq.params,
                                   self.config.eos_token_id, self.config.n_ctx)
            if reason:
                self.scheduler.remove(seq)
                self._finish(seq, reason, now)
            outputs.append(self._output(seq))
        self.timeline.append(StepStats(start, now - start, plan.num_prefill_tokens, plan.num_decode_tokens,
                                       len(plan.chunks), len(plan.preempted), self.block_manager.num_free_blocks))
        return outputs

    def _execute(self, plan: SchedulerOutput) -> list[tuple[Sequence, int]]:
        """Run the plan as one ragged forward pass; returns (sequence, new token) for those that sample."""
        ids, segments, sample_rows, samplers = [], [], [], []
        now = time.perf_counter()
        for chunk in plan.chunks:
            seq, n, start = chunk.seq, chunk.num_tokens, chunk.seq.num_computed_tokens
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            # A decode feeds its last sampled token; only a prefill chunk needs the token list sliced.
            ids.extend(seq.output_token_ids[-1:] if chunk.is_decode else seq.token_ids[start:start + n])
            segments.append(Segment(seq.seq_id, start, n, chunk.is_decode))
            if start + n == seq.num_tokens:  # its last pending token is in: it samples this step
                sample_rows.append(len(ids) - 1)
                samplers.append(seq)
        device = self.model.device
        meta = self.cache.prepare(segments)
        logits = self.model(torch.tensor([ids], device=device), meta.positions, cache=self.cache,
                            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=device))
        for chunk in plan.chunks:  # their keys and values are in the cache now
            chunk.seq.num_computed_tokens += chunk.num_tokens
        tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        return list(zip(samplers, tokens))

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.is_finished,
                             seq.finish_reason, seq.metrics, seq.num_preemptions, seq.num_cached_tokens)

    # ---- convenience --------------------------------------------------------

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams; pass one per prompt, "
                             "or a single SamplingParams for all")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        finals: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[i] for i in ids]
