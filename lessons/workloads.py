"""The serving lessons' workloads: seeded request traces, and replaying one through an `LLMEngine`.

    trace = lognormal_trace(20, max_len=1024, vocab_size=50257, prompt_median=160, output_median=64)
    engine = LLMEngine(model, SchedulerConfig(2048, 256, enable_chunked_prefill=True),
                       num_blocks=pool_blocks(trace))
    run = replay(engine, trace, desc="paged")
    run.throughput, run.percentile("ttft", 99), run.outputs["3"].metrics.token_times

A trace's lengths are log-normal, the shape of real chat traffic (ShareGPT,
which vLLM's paper replays), and seeded, so every run of a lesson serves the
same requests. `rate=None` queues every request at t = 0 (an offline batch: the
queue never empties, so memory and compute, not arrivals, set the pace); a rate
draws Poisson arrivals, and `replay` admits each request at the first step
boundary after its arrival time, sleeping while the engine is idle.

`replay` keeps what it needs from the outputs `step()` returns: each finished
request's `RequestOutput` carries its own token times. The engine forgets a
request once it has reported it finished, so nothing here reads it back.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from measure import progress
from minillm.engine import LLMEngine, RequestOutput
from minillm.sampling import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the replay starts


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, and past the end-of-text token: every request runs to exactly its drawn length."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def lognormal_trace(n: int, max_len: int, vocab_size: int, prompt_median: float, output_median: float,
                    sigma: float = 0.7, seed: int = 0, rate: float | None = None) -> list[Request]:
    """n requests: prompt ~ LogNormal(ln prompt_median, σ) in [1, max_len/2], output ~ LogNormal(ln
    output_median, σ) in [1, max_len − prompt]; all at t = 0, or Poisson arrivals at `rate` per second."""
    rng = np.random.default_rng(seed)
    t, trace = 0.0, []
    for i in range(n):
        if rate is not None and i:
            t += rng.exponential(1 / rate)
        p = int(np.clip(round(rng.lognormal(math.log(prompt_median), sigma)), 1, max_len // 2))
        o = int(np.clip(round(rng.lognormal(math.log(output_median), sigma)), 1, max_len - p))
        trace.append(Request(rng.integers(0, vocab_size, p).tolist(), o, t))
    return trace


def describe_trace(trace: list[Request]) -> dict:
    prompts, outputs = [len(r.prompt) for r in trace], [r.max_tokens for r in trace]
    return {"requests": len(trace), "prompt_mean": statistics.mean(prompts), "prompt_max": max(prompts),
            "output_mean": statistics.mean(outputs), "output_max": max(outputs), "longest": longest(trace),
            "last_arrival_s": trace[-1].arrival_s}


def longest(trace: list[Request]) -> int:
    """The most tokens of KV one request can hold: without chunking, its whole (re)compute is one step."""
    return max(len(r.prompt) + r.max_tokens - 1 for r in trace)


def pool_blocks(trace: list[Request], block_size: int = 16) -> int:
    """Blocks for every request at its longest at once: a pool that never preempts."""
    return sum(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in trace)


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
