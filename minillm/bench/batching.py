"""Static against continuous batching, counted in steps: the cost model of lesson 09.

All requests arrive at once; `seats` is `max_num_seqs`; the policy is prefill-first
(`scheduler.py`): a step that admits runs only the prompts it admits, which sample
their first token, and the other steps run one decode for every running request.
Static batching (`static_batching.py`) admits only into an empty batch.

    static steps     = Σ over batches of (1 + the batch's longest output − 1)
    continuous steps = the same requests, each seat refilled at the step after it frees

If a step costs the same whatever its batch (lesson 04: decode is memory-bound),
the speedup of continuous batching is static steps ÷ continuous steps, and a
request's latency is the step at which it finishes. `padded_generate` is the
same static batching done by transformers' `generate`, left-padded, the reference.

Invariant held by the tests: the engine, on a pool that never preempts, takes exactly
the steps `finish_steps` counts, in both modes.
"""
from __future__ import annotations

import random
import time
from collections import deque

import torch

from .workloads import Request


def finish_steps(outputs: list[int], seats: int, static: bool) -> list[int]:
    """The step at which each request finishes, in arrival order."""
    left, waiting, finish, step = {}, deque(range(len(outputs))), [0] * len(outputs), 0
    while waiting or left:
        step += 1
        free = 0 if static and left else seats - len(left)
        admitted = [waiting.popleft() for _ in range(min(free, len(waiting)))]
        left.update((i, outputs[i]) for i in admitted)
        for i in admitted or list(left):
            left[i] -= 1
            if not left[i]:
                del left[i]
                finish[i] = step
    return finish


def long_and_short(n: int, seats: int, mean: int, spread: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """n requests, one in `seats` long (mean + (seats − 1) · spread output tokens), the rest short (mean − spread),
    so the mean stays `mean`; shuffled with the seed; prompts of 4 to 16 tokens, the same for every spread."""
    rng = random.Random(seed)
    outputs = [mean + (seats - 1) * spread if i % seats == 0 else mean - spread for i in range(n)]
    rng.shuffle(outputs)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 16))] for _ in outputs]
    return [Request(p, o) for p, o in zip(prompts, outputs)]


def padded_generate(hf, trace: list[Request], seats: int) -> dict:
    """transformers' static batching: batches of `seats` prompts, left-padded, generated to the batch's longest."""
    tokens, latency, t0 = [], [], time.perf_counter()
    for batch in (trace[b:b + seats] for b in range(0, len(trace), seats)):
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch], device=hf.device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=hf.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in batch),
                              do_sample=False, pad_token_id=0)
        tokens += [out[i, width:width + r.max_tokens].tolist() for i, r in enumerate(batch)]
        latency += [time.perf_counter() - t0] * len(batch)
    return {"tokens": tokens, "latency": latency}
