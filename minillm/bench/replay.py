"""Replaying a trace through an `LLMEngine`, in real time, and what the lessons read from the run.

    trace = lognormal_trace(20, max_len=1024, vocab_size=50257, prompt_median=160, output_median=64)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
                       cache_config=CacheConfig(num_gpu_blocks_override=pool_blocks(trace)))
    run = replay(engine, trace, desc="paged")
    run.throughput, run.percentile("ttft", 99), run.outputs["3"].metrics.token_times

The traces come from `workloads.py`. `replay` admits each request at the first
step boundary after its arrival time, sleeping while the engine is idle; a
trace all at t = 0 is an offline batch. `serve` plays `Conversation`s from
closed-loop clients, each sending its next turn when the last answer is done.

`replay_samples` serves a trace all at once with n greedy samples of each prompt,
as one request of n (sharing its blocks) or as n requests of one, and counts
the blocks each request held at most (lesson 07), watching each step's plan
through the engine's `on_plan` hook and its public `stats()`.

`replay` keeps what it needs from the outputs `step()` returns: each finished
request's `RequestOutput` carries its own token times. The engine forgets a
request once it has reported it finished, so nothing here reads it back, and it
reads the engine only through its public surface (`step`, `timeline`, `stats`).

    cost: the engine's own steps; `replay_samples` adds one stats(tables=True) per step, O(blocks held)
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from minillm.bench.verdict import progress
from minillm.bench.workloads import Conversation, Request
from minillm.engine import LLMEngine, RequestOutput
from minillm.parallel_sampling import sample_params
from minillm.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, and past the end-of-text token: every request runs to exactly its drawn length."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


@dataclass
class Replay:
    """One trace served: every finished request's output, by request id, and the clock."""
    outputs: dict[str, RequestOutput]
    start: float      # perf_counter at t = 0 of the trace
    seconds: float    # until the last request finished
    steps: int
    step_tokens: list[int] = field(default_factory=list)  # tokens each step fed

    @property
    def generated(self) -> int:
        return sum(len(o.output_token_ids) for o in self.outputs.values())

    @property
    def throughput(self) -> float:
        """Generated tokens per second of the whole replay."""
        return self.generated / self.seconds

    @property
    def preemptions(self) -> int:
        return sum(o.num_preemptions for o in self.outputs.values())

    def latencies(self, kind: str) -> list[float]:
        """Every request's TTFT (kind "ttft") or every gap between two tokens of a request ("itl")."""
        if kind == "ttft":
            return [o.metrics.ttft for o in self.outputs.values()]
        return [x for o in self.outputs.values() for x in o.metrics.itls]

    def percentile(self, kind: str, q: float) -> float:
        return percentile(self.latencies(kind), q)

    def summary(self) -> dict:
        return {"seconds": self.seconds, "generated_tokens": self.generated, "throughput": self.throughput,
                "steps": self.steps, "preemptions": self.preemptions,
                "mean_tokens_per_step": statistics.mean(self.step_tokens) if self.step_tokens else 0.0,
                "max_tokens_per_step": max(self.step_tokens, default=0),
                **{f"{k}_p{q}_s": self.percentile(k, q) for k in ("ttft", "itl") for q in (50, 99)}}


def replay(engine: LLMEngine, trace: list[Request], on_step: Callable[[LLMEngine, list], None] | None = None,
           desc: str | None = None) -> Replay:
    """Serve `trace` in real time: before each step, admit every request whose arrival has passed.

    Request i gets the id str(i). `on_step(engine, outputs)` runs after every
    step, and may read the scheduler's queues or add requests of its own.
    """
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    finished: dict[str, RequestOutput] = {}
    step_tokens: list[int] = []
    bar = progress(sum(r.max_tokens for r in trace), desc, "tok")
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + trace[pending[0]].arrival_s <= now:
            i = pending.pop(0)
            engine.add_request(trace[i].prompt, greedy(trace[i].max_tokens), request_id=str(i),
                               arrival_time=start + trace[i].arrival_s)
        if not engine.has_unfinished_requests():
            time.sleep(start + trace[pending[0]].arrival_s - now)  # idle until the next arrival
            continue
        outputs = engine.step()
        step_tokens.append(engine.timeline[-1].num_prefill_tokens + engine.timeline[-1].num_decode_tokens)
        finished.update((o.request_id, o) for o in outputs if o.finished)
        bar.update(len(outputs))
        if on_step is not None:
            on_step(engine, outputs)
    bar.close()
    end = max(o.metrics.finished_time for o in finished.values())
    return Replay(finished, start, end - start, len(step_tokens), step_tokens)


def serve(engine: LLMEngine, conversations: list[Conversation], concurrency: int | None = None) -> dict:
    """Serve conversations from `concurrency` closed-loop clients (all at once by default): a client sends a
    conversation's next turn (history + answer + next message) as soon as the last answer is complete, and
    starts the next conversation when its own has ended. TTFT counts from the moment a request is added.

    Returns every request's record, throughput (generated tokens ÷ makespan), TTFT p50/p90 (all requests, and
    those that hit the cache), prompt tokens, prefill tokens computed, the hit rate, KV blocks in use (cached
    blocks nobody holds count as free: any allocation may take them), and the seconds spent in steps that
    prefilled against steps that only decoded, and the host's: the makespan less the steps' forward passes and
    sampling (scheduling, block bookkeeping, prefix hashing and lookups, this loop of clients).
    """
    waiting = deque(range(len(conversations)))
    active: dict[str, tuple[int, int, list[int]]] = {}  # request id → (conversation, turn, prompt)
    records, first_step = [], len(engine.timeline)

    def send(c: int, turn: int, history: list[int]) -> None:
        prompt = history + conversations[c].turns[turn]
        active[engine.add_request(prompt, greedy(conversations[c].max_tokens))] = (c, turn, prompt)

    t0 = time.perf_counter()
    for _ in range(min(concurrency or len(conversations), len(conversations))):
        send(waiting.popleft(), 0, [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c, turn, prompt = active.pop(out.request_id)
            records.append({"conversation": c, "turn": turn, "prompt_tokens": len(prompt),
                            "cached_tokens": out.num_cached_tokens, "generated_tokens": len(out.output_token_ids),
                            "ttft_s": out.metrics.ttft, "finished_s": out.metrics.finished_time - t0})
            if turn + 1 < len(conversations[c].turns):
                send(c, turn + 1, prompt + out.output_token_ids)
            elif waiting:
                send(waiting.popleft(), 0, [])
    steps = engine.timeline[first_step:]
    in_use = [engine.stats().num_blocks - s.num_free_blocks for s in steps]
    makespan = max(r["finished_s"] for r in records)
    ttfts, hits = [r["ttft_s"] for r in records], [r["ttft_s"] for r in records if r["cached_tokens"]]
    return {"requests": len(records), "makespan_s": makespan,
            "throughput": sum(r["generated_tokens"] for r in records) / makespan,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "hit_ttft_p50_s": percentile(hits, 50),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "prefill_tokens_computed": sum(s.num_prefill_tokens for s in steps),
            "hit_rate": sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records),
            "peak_blocks_in_use": max(in_use), "mean_blocks_in_use": statistics.mean(in_use),
            "prefill_steps_s": sum(s.duration for s in steps if s.num_prefill_tokens),
            "decode_steps_s": sum(s.duration for s in steps if not s.num_prefill_tokens),
            "host_s": makespan - sum(s.forward_s for s in steps),  # all but forward passes and sampling
            "records": sorted(records, key=lambda r: (r["conversation"], r["turn"]))}


def replay_samples(engine: LLMEngine, trace: list[Request], n: int, grouped: bool) -> dict:
    """Each request of `trace`, all at once, as one request of n greedy samples, or as n requests of one: the blocks
    in use while each step runs, the most each request's samples held at once, the copies copy-on-write made, the
    steps, tokens and prefill tokens."""
    for i, r in enumerate(trace):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, n=n)
        for j, sp in enumerate([params] if grouped else sample_params(params)):
            engine.add_request(r.prompt, sp, request_id=f"{i}" if grouped else f"{i}.{j}")
    held, peaks = [], [0] * len(trace)

    def count(plan) -> None:  # while the step runs: its blocks are planned, and none that ends in it is freed yet
        now = engine.stats(tables=True)
        mine: dict[int, set[int]] = {}
        for rid, blocks in now.block_tables.items():
            mine.setdefault(int(rid.split(".")[0]), set()).update(blocks)
        for i, blocks in mine.items():
            peaks[i] = max(peaks[i], len(blocks))
        held.append(now.num_blocks - now.num_free_blocks)

    engine.on_plan, tokens, began = count, 0, time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            tokens += sum(sum(len(c.token_ids) for c in out.outputs) for out in engine.step() if out.finished)
    finally:
        engine.on_plan = None
    steps, seconds = engine.timeline, time.perf_counter() - began
    return {"blocks_held": held, "request_peaks": peaks, "copies": engine.block_manager.num_copies,
            "steps": len(steps), "generated_tokens": tokens, "tokens_per_step": tokens / len(steps), "seconds": seconds,
            "throughput": tokens / seconds,
            "prefill_tokens": sum(x.num_prefill_tokens for x in steps),
            "preemptions": sum(x.num_preempted for x in steps)}
