"""Lesson 14's draft models: which one it speculates with, and why.

A draft must propose the target's tokens, so it needs the target's vocabulary.
The classic pairs share GPT-2's tokenizer: distilgpt2 drafts for gpt2, gpt2 for
the larger ones. Without their weights on disk, the draft is the target's own
first quarter of blocks, sharing (not copying) its weights: cheap to make, and
right as often as those blocks already agree with the whole model.
"""
from __future__ import annotations

import contextlib

import torch

from minillm.checkpoints.load import load_model, locate
from minillm.model import GPT2


def shallow_draft(target: GPT2, n_layer: int) -> GPT2:
    """The target's first n_layer blocks, its embeddings, ln_f and tied head (in the layout the loader chose for the
    target): a draft sharing (not copying) them."""
    with torch.device("meta"):
        draft = GPT2(target.config.with_(n_layer=n_layer), seed=None)
    draft.wte, draft.wpe, draft.ln_f = target.wte, target.wpe, target.ln_f
    draft.lm_head = target.lm_head  # in the layout the loader chose for the target, shared
    draft.h = torch.nn.ModuleList(target.h[:n_layer])
    draft.weights_source = f"the target's first {n_layer} of {target.config.n_layer} blocks"
    return draft.eval()


CLASSIC_DRAFTS = {"gpt2": "distilgpt2", "gpt2-medium": "gpt2", "gpt2-large": "gpt2", "gpt2-xl": "gpt2"}


def has_weights(name: str) -> bool:
    """Whether `name` is a checkpoint whose weights are on disk (a preset folder holding safetensors)."""
    with contextlib.suppress(ValueError):
        folder, _ = locate(name)
        return folder.is_dir() and any(folder.glob("*.safetensors"))
    return False


def choose_draft(target: GPT2, target_name: str, asked: str, device, dtype) -> tuple[GPT2, str]:
    """The draft model and why: `asked` may name any checkpoint with the target's vocabulary; `auto` takes the
    classic pair (distilgpt2 for gpt2, gpt2 for the larger ones) when its weights are present, else the shallow
    draft; `shallow` always takes the target's first quarter of blocks."""
    shallow, classic = max(1, target.config.n_layer // 4), CLASSIC_DRAFTS.get(target_name)
    if asked == "shallow" or (asked == "auto" and not has_weights(classic or "")):
        why = ("asked for (--draft shallow)" if asked == "shallow" else f"no weights for the classic draft {classic} "
               f"of {target_name}" if classic else f"{target_name} has no classic draft")
        return shallow_draft(target, shallow), f"the target's first {shallow} block{'s' * (shallow > 1)} ({why})"
    name = classic if asked == "auto" else asked
    draft = load_model(name, device, dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise SystemExit(f"--draft {name}: its vocabulary has {draft.config.vocab_size} tokens and the target's "
                         f"{target.config.vocab_size}; a draft must propose the target's tokens: pick a checkpoint "
                         "of the same tokenizer, or --draft shallow")
    return draft, f"{name} ({draft.weights_source}{', the classic pair' if asked == 'auto' else ''})"
