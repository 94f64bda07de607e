"""Naive decode: the baseline every later idea is measured against.

To generate token n+1, run the whole model over all n tokens so far, keep the
last position's logits, pick a token, append it, repeat. Nothing is stored
between steps, so every step recomputes the keys and values of every earlier
token, which were identical last step:

    work at step n      ~ n · (2 · params)  +  n² · (4 · n_layer · n_embd)   FLOPs
    total for N tokens  ~ Σ n  =  O(N²) matmul work and O(N³) attention work

It is correct, and simple enough to trust, which is why the tests use it as
the reference. It is also the wrong way to serve: at 1,000 tokens of context
each new token redoes ~1,000 tokens' worth of work. Lesson 01 measures that
waste, and `kv_cache.py` removes it by remembering each token's keys and
values once computed: decode then pushes one token through the weights per step.

Invariant held by the tests: every other decoder's greedy tokens equal these.
"""
from __future__ import annotations

import torch

from .model import GPT2
from .request_checks import check_prompt
from .sampling import make_generator, sample
from .sampling_params import SamplingParams, finish_reason, one_sample


@torch.inference_mode()
def generate(model: GPT2, prompt_token_ids: list[int], params: SamplingParams | None = None,
             on_token=None) -> list[int]:
    """Generate up to `params.max_tokens` tokens after the prompt; returns only the new tokens.

    `on_token(i, token)` is called after each token is picked, so a caller can time steps.
    """
    params = one_sample(params or SamplingParams(temperature=0.0), "naive_decode.generate")
    cfg = model.config
    tokens = check_prompt(cfg, prompt_token_ids, params.max_tokens)
    generator = make_generator(params, model.device)
    out: list[int] = []
    while True:
        ids = torch.tensor([tokens], device=model.device)
        # The whole sequence, every step: that recomputation is the point of this file.
        logits = model(ids, logits_indices=torch.tensor([len(tokens) - 1], device=model.device))
        token = sample(logits, [params], [generator])[0]
        tokens.append(token)
        out.append(token)
        if on_token is not None:
            on_token(len(out) - 1, token)
        if finish_reason(token, len(out), len(tokens), params, cfg.eos_token_id, cfg.n_ctx):
            return out
