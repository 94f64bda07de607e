"""Every trace the project serves, seeded: the lessons' and `bench-serve`'s (as vLLM's `benchmarks/datasets/`).

A trace is a list of `Request`s: a prompt of token ids, how many tokens to
generate (greedy past the end-of-text token, so exactly that many), and when it
arrives. Every generator is seeded, so every run serves the same requests.
`replay.py` serves a trace through an `LLMEngine`; `serve.py` sends one to a
server over HTTP.

    Workload(name, num_prompts, vocab_size, max_len, ...)    bench-serve's --workload and its knobs:
        random         every prompt `input_len` tokens, every output `output_len` (vLLM's)
        lognormal      log-normal prompt and output lengths around `prompt_median` and `output_median`
        stutter        `input_len`-token prompts, and a share `long_fraction` of `long_prompt_len`-token
                       ones: the long prefills that stall running streams (lessons 10, 12)
        shared-prefix  a system prompt of `prefix_len` tokens shared by all, then `input_len` of its own
    add_random_arguments(parser)    the knobs of a `random` workload on a command line (bench.gather, bench.serve_overhead)
    arrivals(n, rate)               a Poisson process of `rate` requests/s, or all at t = 0 (rate = inf)
    lognormal_trace(n, ...)         the lessons' log-normal trace (05, 08), arrivals drawn with the lengths
    shared_prefix_workload, multi_turn_workload, no_sharing_workload, ttft_sweep
                                    `Conversation`s, traffic that repeats itself (lesson 13), served by
                                    closed-loop clients (`replay.serve`)

Log-normal lengths are the shape of real chat traffic (ShareGPT, which vLLM's
paper replays): prompt ~ LogNormal(ln prompt_median, σ) in [1, max_len/2],
output ~ LogNormal(ln output_median, σ) in [1, max_len − prompt], σ = 0.7.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

import numpy as np

SIGMA = 0.7  # the spread of log-normal lengths


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the trace starts


def lognormal_lengths(rng: np.random.Generator, max_len: int, prompt_median: float, output_median: float,
                      sigma: float = SIGMA) -> tuple[int, int]:
    """One (prompt, output) length pair: prompt in [1, max_len/2], output in [1, max_len − prompt]."""
    p = int(np.clip(round(rng.lognormal(math.log(prompt_median), sigma)), 1, max_len // 2))
    return p, int(np.clip(round(rng.lognormal(math.log(output_median), sigma)), 1, max_len - p))


SHAPES = ("random", "lognormal", "stutter", "shared-prefix")


@dataclass
class Workload:
    """`bench-serve`'s trace: its shape and knobs (the flags `--random-input-len` and so on). Iterating it draws its
    (prompt token ids, output length) pairs from the seed, the same every time; each fits in `max_len` tokens."""
    name: str               # one of SHAPES
    num_prompts: int
    vocab_size: int         # prompt token ids are drawn below this
    max_len: int            # prompt + output stay within this
    seed: int = 0
    input_len: int = 32     # random, stutter, shared-prefix: a request's own prompt tokens
    output_len: int = 32    # random, stutter, shared-prefix: its output tokens
    prompt_median: float = 64   # lognormal
    output_median: float = 32   # lognormal
    long_prompt_len: int = 512  # stutter: a long prompt's tokens
    long_fraction: float = 0.1  # stutter: the share of long prompts
    prefix_len: int = 64        # shared-prefix: the system prompt's tokens

    def __post_init__(self):
        if self.name not in SHAPES:
            raise ValueError(f"workload {self.name!r} is not one of {', '.join(SHAPES)}")

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        ids = lambda k: rng.integers(0, self.vocab_size, k).tolist()  # noqa: E731

        def fit(p: int, o: int) -> tuple[int, int]:
            p = max(1, min(p, self.max_len - 1))
            return p, max(1, min(o, self.max_len - p))

        system = ids(self.prefix_len) if self.name == "shared-prefix" else []
        for _ in range(self.num_prompts):
            if self.name == "random":
                p, o = fit(self.input_len, self.output_len)
            elif self.name == "lognormal":
                p, o = lognormal_lengths(rng, self.max_len, self.prompt_median, self.output_median)
            elif self.name == "stutter":
                p, o = fit(self.long_prompt_len if rng.random() < self.long_fraction else self.input_len,
                           self.output_len)
            else:  # shared-prefix
                p, o = fit(self.prefix_len + self.input_len, self.output_len)
                yield system[:p] + ids(max(0, p - self.prefix_len)), o
                continue
            yield ids(p), o

    def requests(self, rate: float) -> list[Request]:
        """The trace, arriving at `rate` requests per second (`arrivals`)."""
        return [Request(p, o, t) for (p, o), t in zip(self, arrivals(self.num_prompts, rate, self.seed))]


def add_random_arguments(p: argparse.ArgumentParser, input_len: int, output_len: int = 64, num_prompts: int = 32,
                         rounds: int = 3) -> None:
    """A `random` workload's knobs, vLLM's names: --model, --num-prompts, --input-len, --output-len, --rounds."""
    p.add_argument("--model", default="gpt2")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--rounds", type=int, default=rounds, help="rounds, each side once per round")


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s): all at 0 for rate = inf, else a Poisson process of `rate` requests per second."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"--request-rate {rate} must be > 0 requests/s, or inf to send every request at once")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


def lognormal_trace(n: int, max_len: int, vocab_size: int, prompt_median: float, output_median: float,
                    sigma: float = SIGMA, seed: int = 0, rate: float | None = None) -> list[Request]:
    """The lessons' trace: n requests of log-normal lengths, all at t = 0 (`rate=None`: an offline batch, whose
    queue never empties, so memory and compute set the pace) or Poisson arrivals at `rate` per second, each gap
    drawn before its request's lengths."""
    rng = np.random.default_rng(seed)
    t, trace = 0.0, []
    for i in range(n):
        if rate is not None and i:
            t += rng.exponential(1 / rate)
        p, o = lognormal_lengths(rng, max_len, prompt_median, output_median, sigma)
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


# ---- traffic that repeats itself: a shared system prompt, conversations, and the control ----


@dataclass
class Conversation:
    turns: list[list[int]]  # the user's message each turn; a turn's prompt is the history so far, then this
    max_tokens: int         # the length of every answer (greedy, no early stop)


def shared_prefix_workload(n: int, prefix_len: int, suffix_len: int, max_tokens: int, vocab_size: int,
                           seed: int = 0) -> list[Conversation]:
    """n one-turn requests: the same system prompt of `prefix_len` tokens, then `suffix_len` tokens of their own."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [Conversation([system + [rng.randrange(vocab_size) for _ in range(suffix_len)]], max_tokens)
            for _ in range(n)]


def multi_turn_workload(n: int, turns: int, first_len: int, user_len: int, max_tokens: int, vocab_size: int,
                        seed: int = 0) -> list[Conversation]:
    """n conversations: a first message of `first_len` tokens, then `turns` − 1 messages of `user_len`."""
    rng = random.Random(seed)
    return [Conversation([[rng.randrange(vocab_size) for _ in range(first_len if t == 0 else user_len)]
                          for t in range(turns)], max_tokens) for _ in range(n)]


def no_sharing_workload(n: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> list[Conversation]:
    """The control: n one-turn requests of `prompt_len` tokens, nothing in common."""
    rng = random.Random(seed)
    return [Conversation([[rng.randrange(vocab_size) for _ in range(prompt_len)]], max_tokens) for _ in range(n)]


def conversation_blocks(conversations: list[Conversation], block_size: int = 16) -> int:
    """Blocks for every conversation at its longest (its last turn's prompt and answer) at once: never preempts."""
    return sum(-(-(sum(len(t) for t in c.turns) + len(c.turns) * c.max_tokens) // block_size) for c in conversations)


def ttft_sweep(prefixes: list[int], suffix: int, vocab_size: int, seed: int = 3) -> list[Conversation]:
    """One request with the longest system prompt (it fills the cache), then one per shared length, max_tokens 1."""
    longest = shared_prefix_workload(len(prefixes) + 1, max(prefixes), suffix, 1, vocab_size, seed)
    return [longest[0]] + [Conversation([c.turns[0][:s] + c.turns[0][-suffix:]], 1)
                           for s, c in zip(prefixes, longest[1:])]
