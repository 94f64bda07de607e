"""The analytic cost of one forward step: the FLOPs it must do and the bytes it must move.

    For a step that pushes n_i new tokens through sequence i, which already holds
    c_i cached tokens, with L layers, width C, vocabulary V and b bytes per element:

        FLOPs  = 2 · 12·L·C² · Σ n_i                        (the block matmuls)
               + 4 · L · C · Σ_i Σ_{j<n_i} (c_i + j + 1)     (q·kᵀ and p·v, causal)
               + 2 · V · C · rows                            (LM head, only the rows we sample)
        bytes  = block weights + ln_f + (V·C if rows > 0)    (every weight read once)
               + 2 · L · C · b · Σ c_i                       (cached K and V read)
               + 2 · L · C · b · Σ n_i                       (new K and V written)
               + embedding rows gathered + logits written
        arithmetic intensity = FLOPs / bytes

    These are the *minimum* bytes: activations are assumed to stay in cache, so
    a real step moves at least this much. Decode (n = 1) does ~2 FLOPs per weight
    read, i.e. 0.5 FLOP/byte in fp32; a 512-token prefill does ~512 times that.

`weight_read_floor` is the fastest a decode step can be: every weight read
once at a measured bandwidth. `weight_bytes_read(model)` counts the weight bytes
a built model's step reads as it stores them (int8 projections with their scales,
`quantize.py`), where `step_cost` counts every weight in the model's dtype.

Invariants held by the tests: `step_cost` equals a hand count for the tiny
shape; a decode step's FLOPs equal `GPT2Config.flops_per_token`; half precision
halves the bytes, not the FLOPs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch

from ..config import GPT2Config, dtype_bytes


@dataclass
class StepCost:
    """Minimum work of one forward step; bytes split by what they are."""
    flops: int
    weight_bytes: int      # every weight the step touches, read once (LM head included when used)
    kv_read_bytes: int     # cached keys and values read by attention
    kv_write_bytes: int    # this step's new keys and values stored
    other_bytes: int       # embedding rows gathered, logits written
    tokens: int            # new tokens pushed through the model
    lm_head_rows: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.other_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per byte."""
        return self.flops / self.bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "intensity": self.intensity}


def step_cost(config: GPT2Config, new_tokens: Sequence[int], cached_lens: Sequence[int],
              dtype: torch.dtype = torch.float32, lm_head_rows: int | None = None) -> StepCost:
    """The analytic cost of one forward pass over a batch of sequences.

    new_tokens[i]  tokens sequence i pushes through the model this step
    cached_lens[i] tokens sequence i already holds in its KV cache
    lm_head_rows   rows the LM head is applied to (default: one per sequence,
                   as prefill with `logits_indices` and decode both do)
    """
    if len(new_tokens) != len(cached_lens) or not new_tokens:
        raise ValueError(f"new_tokens ({len(new_tokens)}) and cached_lens ({len(cached_lens)}) must "
                         "name the same, non-zero number of sequences")
    if any(n < 1 for n in new_tokens) or any(c < 0 for c in cached_lens):
        raise ValueError(f"new_tokens={list(new_tokens)} must be ≥ 1 and cached_lens={list(cached_lens)} ≥ 0")
    L, C, V = config.n_layer, config.n_embd, config.vocab_size
    b = dtype_bytes(dtype)
    rows = len(new_tokens) if lm_head_rows is None else lm_head_rows
    tokens = sum(new_tokens)
    # Keys each new token attends to: token j of sequence i sees c_i + j + 1 of them.
    attended = sum(n * c + n * (n + 1) // 2 for n, c in zip(new_tokens, cached_lens))
    flops = 2 * L * 12 * C * C * tokens + 4 * L * C * attended + 2 * V * C * rows

    block_params = config.num_params() - (V + config.n_ctx) * C  # blocks and ln_f
    head_params = V * C if rows else 0
    kv_per_token = config.kv_bytes_per_token(dtype)
    return StepCost(
        flops=flops,
        weight_bytes=(block_params + head_params) * b,
        kv_read_bytes=kv_per_token * sum(cached_lens),
        kv_write_bytes=kv_per_token * tokens,
        other_bytes=2 * C * b * tokens + V * b * rows,  # wte + wpe rows in, logits out
        tokens=tokens, lm_head_rows=rows)


def prefill_cost(config: GPT2Config, prompt_len: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32) -> StepCost:
    """A prefill of `batch` fresh prompts of `prompt_len` tokens, LM head on each last token."""
    return step_cost(config, [prompt_len] * batch, [0] * batch, dtype)


def decode_cost(config: GPT2Config, cached_len: int, batch: int = 1,
                dtype: torch.dtype = torch.float32) -> StepCost:
    """One decode step: `batch` sequences each add one token after `cached_len` cached ones."""
    return step_cost(config, [1] * batch, [cached_len] * batch, dtype)


def weight_bytes_read(model) -> int:
    """The weight bytes one step reads, as the model stores them: every tensor of its state_dict but the
    embeddings, whose lookup reads a few rows, and wte once more where the head is tied to it (no head of its
    own in the state_dict). For a plain model, `step_cost`'s weight_bytes with the head used."""
    state = model.state_dict()
    tied_head = model.wte.weight.nbytes if "lm_head.weight" not in state else 0
    return sum(t.nbytes for name, t in state.items() if name not in ("wte.weight", "wpe.weight")) + tied_head


def as_stored(cost: StepCost, model) -> StepCost:
    """`cost` with the weight bytes this built model reads (`weight_bytes_read`)."""
    return replace(cost, weight_bytes=weight_bytes_read(model))


def weight_read_floor(config: GPT2Config, dtype: torch.dtype, bandwidth: float, batch: int = 1) -> float:
    """Seconds a decode step cannot beat: every weight it uses (the LM head included) read once at
    `bandwidth` bytes/s, the measured bandwidth (`roofline.py`). Its KV reads come on top; at short contexts
    they are small."""
    return decode_cost(config, 0, batch, dtype).weight_bytes / bandwidth
