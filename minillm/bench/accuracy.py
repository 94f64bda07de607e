"""What fewer bytes cost: a variant's logits against the reference's, and the noise model that predicts it.

Measured, at every position of a token sequence (teacher-forced: each model reads the same tokens):

    max |Δlogit|        over every position and token
    KL(p ‖ p̂)           per position, in nats: p the reference's softmax, p̂ the variant's (mean and max)
    greedy agreement    the share of positions where the variant's argmax is the token the reference chose
    perplexity          exp(mean cross-entropy of the next token), on real text

Predicted, before the variant runs, by the additive-noise model of rounding: a rounded weight is the weight
plus an error that behaves like noise of the same size, uncorrelated with the weight. So the reference model
with each weight matrix's own rounding error added back *shuffled* (its columns permuted: every row keeps its
error's magnitudes, none its pattern) gives the same figures, the amplification through the layers included;
`noisy_copy(model, rounders)` builds it. Where the variant's error is the pattern (one structured mistake, not
noise) the measured figures leave the prediction behind.

Invariants held by the tests: identical logits give 0, 0 and agreement 1; a shifted copy of the logits gives
KL 0 and agreement 1 (a softmax ignores a constant); the noisy copy is not the reference and not the variant.
"""
from __future__ import annotations

import copy
import math
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import PRESETS
from ..cpu_layout import choose_layout
from ..model import GPT2, Conv1D
from ..quantize import dequantize, quantize, quantize_per_channel

ROUNDERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # W [out, in] fp32 → W as the variant stores it
    "bf16": lambda w: w.to(torch.bfloat16).float(),
    "int8": lambda w: dequantize(*quantize_per_channel(w)),
}


def logit_error(reference: torch.Tensor, other: torch.Tensor, chosen: torch.Tensor) -> dict:
    """reference and other [..., V] logits at the same positions, chosen [...] the reference's tokens there."""
    ref, got = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"max_abs_diff": (other.float() - reference.float()).abs().max().item(), "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(), "greedy_agreement": (other.argmax(-1) == chosen).float().mean().item()}


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean cross-entropy) of ids[1:] under logits[:-1] ([T, V] and [T])."""
    return math.exp(F.cross_entropy(logits[:-1].float(), ids[1:]).item())


@torch.no_grad()
def noisy_copy(model, rounders: list[Callable[[torch.Tensor], torch.Tensor]], seed: int = 0):
    """A copy of a plain fp32 `model` whose projections and wte carry each rounder's error, columns shuffled."""
    noisy, g = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    weights = [(m.weight, True) for m in noisy.modules() if isinstance(m, Conv1D)] + [(noisy.wte.weight, False)]
    for w, in_out in weights:
        w_oi = w.detach().float().t() if in_out else w.detach().float()
        for rounder in rounders:
            error = rounder(w_oi) - w_oi
            shuffled = error[:, torch.randperm(error.shape[1], generator=g)]
            w.add_((shuffled.t() if in_out else shuffled).to(w.dtype))
    return noisy


def greedy_runs(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `max_tokens` tokens, decoded by the engine (paged KV, batched)."""
    from ..engine import LLMEngine  # the engine's own decode path: what a served variant would give
    from ..kv_pool import CacheConfig
    from ..sampling_params import SamplingParams
    outs = LLMEngine(model, cache_config=CacheConfig(block_size=8)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def first_divergence(reference: list[list[int]], runs: list[list[int]]) -> list[int]:
    """Per run, the index of its first token that differs from the reference's (its length if none does)."""
    return [next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), len(r)) for r, o in zip(reference, runs)]


@torch.no_grad()
def context_sensitivity(model, prompts: torch.Tensor) -> float:
    """The share of prompts [N, T] whose greedy next token changes when their first token does: a model that
    reads its context changes it nearly always; GPT-2's 0.02 init, which repeats the last token, never."""
    changed = prompts.clone()
    changed[:, 0] = (changed[:, 0] + 1) % model.config.vocab_size
    return (model(prompts)[:, -1].argmax(-1) != model(changed)[:, -1].argmax(-1)).float().mean().item()


def accuracy_setup(n_prompts: int, std: float) -> dict:
    """fp32, bf16 and int8 copies of one context-sensitive model, fp32's greedy generations through the engine,
    and the noise model's prediction of each variant's figures (`noisy_copy`), before any variant runs."""
    base = GPT2(PRESETS["tiny"], seed=None).eval()
    base.init_weights(0, std=std)
    models = {"fp32": choose_layout(copy.deepcopy(base)),
              "bf16": choose_layout(copy.deepcopy(base).to(torch.bfloat16)),
              "int8": choose_layout(quantize(copy.deepcopy(base).to(torch.bfloat16)))}
    V, n = base.config.vocab_size, base.config.n_ctx - 8
    prompts = torch.randint(0, V, (n_prompts, 8), generator=torch.Generator().manual_seed(1))
    runs = greedy_runs(models["fp32"], prompts.tolist(), n)
    ids = torch.cat([prompts, torch.tensor(runs)], dim=1)
    with torch.inference_mode():
        ref = models["fp32"](ids)[:, 7:-1]
        predicted = {v: logit_error(ref, noisy_copy(base, [ROUNDERS[r] for r in rounders])(ids)[:, 7:-1], ids[:, 8:])
                     for v, rounders in (("bf16", ["bf16"]), ("int8", ["int8", "bf16"]))}
    return {"models": models, "prompts": prompts.tolist(), "runs": runs, "ids": ids, "ref": ref, "figures": {
        "positions": n * len(runs), "predicted": predicted, "vocab": V,
        "context_sensitivity": context_sensitivity(models["fp32"], prompts)}}


def variant_accuracy(a: dict) -> dict:
    """Each variant's logits along fp32's generations, and how far its own greedy generation follows fp32's."""
    out = a["figures"]
    for v in ("bf16", "int8"):
        with torch.inference_mode():
            out[v] = logit_error(a["ref"], a["models"][v](a["ids"])[:, 7:-1], a["ids"][:, 8:])
        mine = greedy_runs(a["models"][v], a["prompts"], len(a["runs"][0]))
        out[v]["first_divergence_median"] = statistics.median(first_divergence(a["runs"], mine))
    return out
