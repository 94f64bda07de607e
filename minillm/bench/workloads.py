"""The workloads `bench-serve` replays: seeded prompts (token ids), output lengths and arrival times.

Workloads (`--workload`), the same shapes the lessons replay:

    random         every prompt --random-input-len tokens, every output --random-output-len (vLLM's)
    lognormal      log-normal prompt and output lengths around --prompt-median and
                   --output-median (σ = 0.7), as lessons 08 and 12 draw them
    stutter        --random-input-len short prompts, and a share --long-fraction of long ones
                   of --long-prompt-len tokens: the long prefills that stall streams (lesson 07)
    shared-prefix  a system prompt of --prefix-len tokens shared by all, then
                   --random-input-len tokens of each request's own (lesson 10)

Arrivals are a Poisson process of `--request-rate` requests/s, or all at once with `inf`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the run starts



def workload(name: str, n: int, vocab_size: int, max_len: int, *, seed: int = 0, input_len: int = 32,
             output_len: int = 32, prompt_median: float = 64, output_median: float = 32, long_prompt_len: int = 512,
             long_fraction: float = 0.1, prefix_len: int = 64) -> list[tuple[list[int], int]]:
    """n seeded (prompt token ids, output length) pairs of the named shape; each fits in max_len tokens."""
    rng = np.random.default_rng(seed)

    def ids(k: int) -> list[int]:
        return rng.integers(0, vocab_size, k).tolist()

    def fit(p: int, o: int) -> tuple[int, int]:
        p = max(1, min(p, max_len - 1))
        return p, max(1, min(o, max_len - p))

    out = []
    if name == "shared-prefix":
        system = ids(prefix_len)
    for i in range(n):
        if name == "random":
            p, o = fit(input_len, output_len)
        elif name == "lognormal":
            p = int(np.clip(round(rng.lognormal(math.log(prompt_median), 0.7)), 1, max_len // 2))
            o = int(np.clip(round(rng.lognormal(math.log(output_median), 0.7)), 1, max_len - p))
        elif name == "stutter":
            p, o = fit(long_prompt_len if rng.random() < long_fraction else input_len, output_len)
        elif name == "shared-prefix":
            p, o = fit(prefix_len + input_len, output_len)
            out.append((system[:p] + ids(max(0, p - prefix_len)), o))
            continue
        else:
            raise ValueError(f"workload {name!r} is not one of random, lognormal, stutter, shared-prefix")
        out.append((ids(p), o))
    return out


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s): all at 0 for rate = inf, else a Poisson process of `rate` requests per second."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"--request-rate {rate} must be > 0 requests/s, or inf to send every request at once")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()
