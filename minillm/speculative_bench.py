"""The measurements behind speculative decoding (lesson 11): what verification costs, and when speculation pays.

    verification_cost(model, context_len, ks)           one target pass over k new tokens, for each k, vs k = 1,
                                                        and the same pass's matrix products alone
    draft_cost(target, draft, context_len)              c: a draft step's time over a target step's
    speculation_sweep(target, draft, prompts, params)   per γ: α, tokens per target pass, measured and predicted speedup

Every comparison is timed *interleaved*: each repeat runs every configuration
once, in a rotating order, and a configuration's figure is the median over the
repeats. A machine busy with something else then slows all configurations of
a repeat alike, and the ratios survive; `spread` (the largest over the
smallest repeat) says how disturbed the run was. The speedup is measured
against `kv_cache.generate` of the target alone over the same prompts.

The prediction is Leviathan et al.'s, fed the measured α and c:

    speedup ≈ (1 − α^(γ+1)) / ((1 − α)(γc + 1))

It counts a verification pass over γ + 1 tokens as one target step. Passing the
measured cost of that pass (`verify_ratio`, from `verification_cost`) in place
of the 1 gives the prediction that also charges for verification's extra width.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, Segment
from .kv_cache import generate as cached_generate
from .metrics import time_fn
from .model import GPT2, Conv1D
from .sampling import SamplingParams
from .speculative import NgramProposer, expected_tokens_per_pass
from .speculative import generate as speculative_generate


def interleaved(fns: dict[str, Callable[[], object]], device, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call, per repeat: every repeat runs every fn once, starting one further along each time."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_fn(fns[name], device, warmup=0, repeats=1).median_s)
    return times


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "spread": max(times) / min(times), "times_s": times}


def verification_cost(model: GPT2, context_len: int = 256, ks=(1, 2, 4, 8, 16), repeats: int = 9,
                      warmup: int = 2, seed: int = 0) -> dict:
    """One target pass feeding k new tokens after `context_len` cached ones, with logits at all k (as a
    verification needs), for each k; `ratio[k]` is its median time over the k = 1 step's.

    Beside each pass it times the pass's matrix products alone (every projection and the LM head, on k
    random rows): when the pass grows faster with k than the weight reads explain, `matmul_ratio` says
    whether the matrix-product kernel for k rows is the cause. Time does not depend on the cached values,
    so the cache is declared filled (zeros), as `metrics.time_decode` does.
    """
    cfg, device = model.config, model.device
    if context_len + max(ks) > cfg.n_ctx:
        raise ValueError(f"context_len={context_len} + k={max(ks)} new tokens exceed n_ctx={cfg.n_ctx}; "
                         f"use context_len ≤ {cfg.n_ctx - max(ks)}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, max(ks)), generator=g).to(device)
    cache = KVCache(cfg, 1, context_len + max(ks), device, model.dtype)
    projections = [m for m in model.modules() if isinstance(m, Conv1D)]

    def verify_pass(k: int):
        @torch.inference_mode()
        def run():
            meta = cache.prepare([Segment(0, context_len, k)])
            return model(ids[:, :k], meta.positions, cache=cache, logits_indices=torch.arange(k, device=device))
        return run

    def matmuls(k: int):
        xs = {n: torch.randn(k, n, generator=g).to(device, model.dtype) for n in {p.weight.shape[0] for p in projections}}

        @torch.inference_mode()
        def run():
            for p in projections:
                p(xs[p.weight.shape[0]])
            return F.linear(xs[cfg.n_embd], model.wte.weight)   # the LM head, over all k rows
        return run

    fns = {**{f"pass {k}": verify_pass(k) for k in ks}, **{f"matmuls {k}": matmuls(k) for k in ks}}
    times = interleaved(fns, device, repeats, warmup)
    per_k = {k: _summary(times[f"pass {k}"]) for k in ks}
    mm = {k: _summary(times[f"matmuls {k}"]) for k in ks}
    return {"context_len": context_len, "ks": list(ks), "per_k": per_k, "matmuls": mm,
            "ratio": {k: per_k[k]["median_s"] / per_k[ks[0]]["median_s"] for k in ks},
            "matmul_ratio": {k: mm[k]["median_s"] / mm[ks[0]]["median_s"] for k in ks}}


def draft_cost(target: GPT2, draft: GPT2 | NgramProposer, context_len: int = 256, repeats: int = 9,
               gamma: int = 4, seed: int = 0) -> dict:
    """c: one draft step over one target decode step after `context_len` tokens, timed interleaved.

    A model draft's step is its own one-token decode; prompt lookup's is one `propose` call over a
    sequence of `context_len` random tokens (a worst case: it scans the whole sequence and finds nothing).
    """
    device = target.device
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (context_len,), generator=g).tolist()

    def decode_step(model: GPT2):
        cache = KVCache(model.config, 1, context_len + 1, device, model.dtype)
        ids = torch.tensor([[tokens[-1]]], device=device)

        @torch.inference_mode()
        def run():
            meta = cache.prepare([Segment(0, context_len, 1, is_decode=True)])
            return model(ids, meta.positions, cache=cache)
        return run

    if isinstance(draft, GPT2):
        draft_step = decode_step(draft)
    else:
        def draft_step():
            return draft.propose(tokens, gamma, SamplingParams(temperature=0.0), None)
    times = interleaved({"target": decode_step(target), "draft": draft_step}, device, repeats)
    target_s, draft_s = _summary(times["target"]), _summary(times["draft"])
    return {"c": draft_s["median_s"] / target_s["median_s"], "target": target_s, "draft": draft_s,
            "context_len": context_len}


def speculation_sweep(target: GPT2, draft: GPT2 | NgramProposer, prompts: list[list[int]],
                      params: SamplingParams, gammas=range(1, 9), repeats: int = 3, c: float | None = None,
                      verify_ratio: dict[int, float] | None = None) -> dict:
    """For each γ: α, tokens per target pass, the wall-clock speedup over `kv_cache.generate` of the target
    alone (all `prompts`, one at a time, interleaved with the baseline and every other γ), and the predictions.

    `c` (from `draft_cost`) feeds Leviathan's prediction; `verify_ratio` (k → cost of a pass over k tokens over
    a one-token step, from `verification_cost`) feeds the prediction that also charges for verification.
    """
    device = target.device

    def baseline():
        return [cached_generate(target, [p], params)[0] for p in prompts]

    def speculate(gamma: int):
        def run():
            return [speculative_generate(target, draft, p, params, num_speculative_tokens=gamma) for p in prompts]
        return run

    fns = {"baseline": baseline, **{f"γ={g}": speculate(g) for g in gammas}}
    outputs = {name: fn() for name, fn in fns.items()}     # the warm-up run, kept for the statistics
    times = interleaved(fns, device, repeats, warmup=0)
    base = _summary(times["baseline"])
    rows = []
    for g in gammas:
        outs = outputs[f"γ={g}"]
        accepted = sum(o.stats.num_accepted_tokens for o in outs)
        judged = accepted + sum(o.stats.num_rejections for o in outs)
        alpha = accepted / judged if judged else 0.0
        passes = sum(o.stats.num_target_passes for o in outs)
        new_tokens = sum(len(o.token_ids) for o in outs)
        spec = _summary(times[f"γ={g}"])
        proposed = sum(o.stats.num_draft_tokens for o in outs)
        row = {"gamma": g, "alpha": alpha, "tokens_per_target_pass": new_tokens / passes,
               "expected_tokens_per_pass": expected_tokens_per_pass(alpha, g),
               "guesses_per_target_pass": proposed / passes,   # < γ where lookup finds nothing or max_tokens nears
               "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
               "num_target_passes": passes, "num_draft_passes": sum(o.stats.num_draft_passes for o in outs),
               "new_tokens": new_tokens, "seconds": spec, "speedup": base["median_s"] / spec["median_s"],
               "same_tokens_as_baseline": ([o.token_ids for o in outs] == outputs["baseline"]) if params.greedy else None}
        if c is not None:
            row["predicted_speedup"] = expected_tokens_per_pass(alpha, g) / (g * c + 1)
            if verify_ratio and g + 1 in verify_ratio:
                row["predicted_with_verify_cost"] = expected_tokens_per_pass(alpha, g) / (g * c + verify_ratio[g + 1])
        rows.append(row)
    return {"baseline": base, "per_gamma": rows, "c": c, "repeats": repeats, "num_prompts": len(prompts)}
