"""One step, measured: prefill and decode steps on the contiguous KV cache, timed or counted op by op.

`prefill_step` and `decode_step` return a function that runs one such step,
for a lesson to time (`time_prefill`, `time_decode`) or count. `count_ops(fn)`
counts the ATen ops one call dispatches from Python, views included: each costs
the host time, and the non-view ones are roughly the kernels a GPU launches.
`time_decode(..., mode=)` times the same decode step eager, on static buffers,
or replayed as a CUDA graph (`cuda_graphs.py`), so a lesson sets each against
the floor of `cost.weight_read_floor`.

`engine_against_forward` times the step a user of the engine gets, `LLMEngine.step()` at batch 1 (schedule,
the paged cache's metadata and gather, the forward pass on the loaded model's layout, sampling, bookkeeping),
in turns with `decode_step`'s forward pass alone on the same model: their ratio is what the engine adds.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cuda_graphs import DecodeRunner
from ..device import synchronize
from ..engine import LLMEngine
from ..kv_cache import KVCache, Segment
from ..kv_pool import CacheConfig
from ..sampling_params import SamplingParams
from .timing import Timing, time_fn


def prefill_step(model, prompt_len: int, batch: int = 1, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A function that runs one prefill of `batch` prompts of `prompt_len` tokens into a fresh KV cache.

    The LM head runs on each prompt's last position only, as a serving engine does.
    """
    cfg, device = model.config, model.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    last = torch.arange(batch, device=device) * prompt_len + (prompt_len - 1)
    cache = KVCache(cfg, batch, prompt_len, device, model.dtype)
    segments = [Segment(row, 0, prompt_len) for row in range(batch)]  # every call starts fresh, same reservation

    @torch.inference_mode()
    def step():
        meta = cache.prepare(segments)
        return model(ids, meta.positions, cache=cache, logits_indices=last)

    return step


def decode_step(model, cached_len: int, batch: int = 1, seed: int = 0,
                mode: str = "eager") -> Callable[[], torch.Tensor]:
    """A function that runs one decode step: `batch` sequences each add a token after `cached_len` cached ones.

    Time does not depend on the values in the cache, so instead of running a
    prefill we declare the first `cached_len` slots filled (they hold zeros).
    Every call prepares the same step at the same length, so it does the same work.

    mode "eager"   `cache.prepare` and a forward pass, new metadata tensors each step
         "static"  the same step on buffers allocated once (`cuda_graphs.DecodeRunner`);
                   its rows are read through an index, a copy of their keys and
                   values that eager's consecutive rows (a view) do not pay
         "graph"   that static step replayed as a CUDA graph (CUDA only): the
                   same kernels as "static", so the difference is launch overhead
    Each call includes the host's work: filling the step's inputs, and the
    launches (or the one replay).
    """
    cfg, device = model.config, model.device
    if cached_len + 1 > cfg.n_ctx:
        raise ValueError(f"cached_len={cached_len} leaves no room for a new token in n_ctx={cfg.n_ctx}; "
                         f"use cached_len ≤ {cfg.n_ctx - 1}")
    if mode not in ("eager", "static", "graph"):
        raise ValueError(f"mode={mode!r}; use eager, static or graph")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g).tolist()
    cache = KVCache(cfg, batch, cached_len + 1, device, model.dtype)
    segments = [Segment(row, cached_len, 1, is_decode=True) for row in range(batch)]
    if mode == "eager":
        ids = torch.tensor(tokens, device=device)[:, None]

        @torch.inference_mode()
        def step():
            meta = cache.prepare(segments)
            return model(ids, meta.positions, cache=cache)
    else:  # max_num_seqs = batch: the batch is its own bucket, nothing is padded
        step = functools.partial(DecodeRunner(model, cache, batch, mode).run, segments, tokens)
    return step


def time_prefill(model, prompt_len: int, batch: int = 1, warmup: int = 1, repeats: int = 3,
                 seed: int = 0) -> Timing:
    """Time `prefill_step`: one prefill of `batch` prompts of `prompt_len` tokens."""
    return time_fn(prefill_step(model, prompt_len, batch, seed), model.device, warmup, repeats)


def time_decode(model, cached_len: int, batch: int = 1, warmup: int = 1, repeats: int = 5,
                seed: int = 0, mode: str = "eager") -> Timing:
    """Time `decode_step` (same arguments): `batch` sequences each add a token after `cached_len` cached ones."""
    return time_fn(decode_step(model, cached_len, batch, seed, mode), model.device, warmup, repeats)


def engine_against_forward(model, context_len: int, steps: int = 32, rounds: int = 3, warmup: int = 1,
                           seed: int = 0) -> dict:
    """The engine's batch-1 decode step against the model's forward step, timed in turns on `model` as loaded.

    Each round runs one greedy request of `steps` tokens alone through an `LLMEngine` built on `model` (its
    defaults, as `load_model` then `LLMEngine` and `serve` build it, but a pool of one context's blocks: a step
    reads only its own table's, and a GPU's default pool would claim most of its memory), its prompt so that the
    decode contexts centre on `context_len`; after each of the engine's decode steps, one `decode_step` at
    `context_len` (the mode the engine decodes with on this device: a CUDA graph on CUDA, eager elsewhere).
    A step is the wall time of one `engine.step()` call, one output token: what a caller, and `serve`'s ITL,
    gets. Each engine step is paired with the forward step after it, so a load that comes and goes slows
    both. Returns the medians over every timed step ("engine_s", "forward_s"), the median of the paired ratios
    ("ratio"), and each round's median of them ("round_ratios"), the run's own spread."""
    cfg, device = model.config, model.device
    prompt_len = min(max(1, context_len - steps // 2), cfg.n_ctx - 1)
    steps = min(steps, cfg.n_ctx - prompt_len)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    mode = "graph" if device.type == "cuda" else "eager"
    forward = decode_step(model, min(context_len, cfg.n_ctx - 1), 1, seed, mode)
    engine_s, forward_s, ratios, round_ratios = [], [], [], []
    pool = CacheConfig(num_gpu_blocks_override=-(-cfg.n_ctx // CacheConfig.block_size) + 1)
    with LLMEngine(model, cache_config=pool, record_timeline=False) as engine:
        for r in range(warmup + rounds):
            engine.add_request(prompt, params)
            while not engine.step():  # the prefill, up to the first token
                pass
            es, fs, paired = [], [], []
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()  # samples on the host: the step has finished when it returns
                es.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                forward()
                synchronize(device)
                fs.append(time.perf_counter() - t0)
                paired.append(es[-1] / fs[-1])
            if r >= warmup:
                engine_s, forward_s, ratios = engine_s + es, forward_s + fs, ratios + paired
                round_ratios.append(statistics.median(paired))
    return {"engine_s": statistics.median(engine_s), "forward_s": statistics.median(forward_s),
            "ratio": statistics.median(ratios), "round_ratios": round_ratios, "steps": len(es),
            "rounds": rounds, "prompt_len": prompt_len, "context_len": context_len}


# ---- launch overhead ------------------------------------------------------------------


@dataclass
class OpCount:
    """The ATen ops one call dispatched from Python: `total`, of which `views` only reinterpret memory."""
    total: int
    views: int
    by_op: dict[str, int]

    @property
    def kernels(self) -> int:
        """Ops that are not views: on a GPU, roughly the kernels launched."""
        return self.total - self.views

    def as_dict(self) -> dict:
        return {**asdict(self), "kernels": self.kernels}


class _Dispatches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> OpCount:
    """Count the ATen ops that one call of `fn` dispatches: what the host pays for, op by op.

    It runs under inference_mode, as the engine does, where an op reaches the
    count as Python called it: `F.linear` is one op, whatever it calls inside.
    A replayed CUDA graph is a single call, not an op, so only the host's own
    work around it (filling and uploading the step's inputs) counts.
    """
    counter = _Dispatches()
    with torch.inference_mode(), counter:
        fn()
    views = sum(n for op, n in counter.ops.items() if op.is_view)
    by_op = {str(op).removeprefix("aten."): n for op, n in counter.ops.most_common()}
    return OpCount(sum(counter.ops.values()), views, by_op)
