"""GPT-2, from scratch, in the order you would explain it.

    input_ids (B, T) ─ wte + wpe ─► [ Block × n_layer ] ─► ln_f ─► x · wteᵀ ─► logits
    Block:  x + attn(ln_1(x)),  then  x + mlp(ln_2(x))          (pre-LayerNorm)
    attn:   c_attn → q, k, v per head → attention → c_proj
    mlp:    c_fc → GELU (tanh approximation) → c_proj

Module names and weight layouts are the checkpoint's (`wte`, `h.3.attn.c_attn`,
`ln_f`, ...; projections stored [in, out]), so loading the official weights is
reading tensors by name, nothing more.

The seam between the model and memory
-------------------------------------
Attention is the only place where one token looks at another, so it is the
only place where *how keys and values are stored* matters. The model does not
decide that. Each attention layer computes its q, k, v for the new tokens and
hands them to the cache it was given:

    out = cache.attend(layer_idx, q, k, v)      # q, k, v: (B, n_head, T, head_dim)

The cache stores k and v however it likes, attends q over everything the
sequence has seen so far, and returns the output in q's shape. With no cache
the model runs plain causal self-attention over the tokens it was given.
`naive_decode`, `kv_cache` and `paged_attention` are three answers to that one
call; adding a fourth never means editing this file. Anything a cache needs to
know about the step (where each sequence's tokens go, how long each context
is) it is told by its owner before the forward pass, never by the model.
Every answer ends in the same `causal_attention` below: the math is written
once (`attention_by_hand` spells it out), and the caches differ only in where
the keys and values come from.

Logits for chosen positions only
--------------------------------
The LM head is the single largest matmul in a small GPT-2 (50257 × 768).
Prefill needs the next-token distribution only at each sequence's last
position, so `forward(..., logits_indices=idx)` applies `ln_f` and the head to
those rows of the flattened (B·T) batch and nothing else.

Kernels for a CPU are not chosen here: once the weights are in, the loader may
replace each `Conv1D` and the `LMHead` with a module that computes the same
product from a copy laid out for a CPU's kernels (`cpu_layout.py`, as
gpt-fast's quantize.py swaps modules in). This file stays as written.

What it costs: about 2 FLOPs per weight per token (`config.py` has the exact
count), and one read of every weight per forward pass, whatever T is.

Invariants held by the tests: a batch gives each row the logits it gets alone;
a later token never changes an earlier token's logits; logits at chosen
positions equal the same rows of the full output; the official checkpoints
give the reference implementation's logits (tests/test_reference.py).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPT2Config


class AttentionCache(Protocol):
    """What the model asks of any KV store: attend these new queries over the
    sequence so far, after storing these new keys and values."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's attention: `attention_by_hand`'s contract, computed by torch's fused kernel.

    Queries (B, H, T, D) over keys and values (B, H, L, D); the queries are the
    last T of the L tokens unless `mask` says otherwise (the contract is
    written out, as math, in `attention_by_hand`). One call to
    F.scaled_dot_product_attention computes the same numbers; its fused
    backends (FlashAttention's idea) take the keys a block at a time with a
    running softmax, so the (T, L) scores never exist in memory: at
    T = L = 1,024 in fp32 that is 4 MiB per head neither written nor read
    back. Every cache ends here; tests/test_model.py holds it equal to
    `attention_by_hand`.
    """
    T, L = q.shape[-2], k.shape[-2]
    if mask is None and T not in (1, L):  # queries at the end of a longer context: the triangle starts at L − T
        mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1)


# The kernel every cache's attention ends in: torch's fused one. Another with its arguments and its numbers may
# take its place where it runs faster (cpu_layout.py swaps one in for a CPU); this file never chooses.
scaled_dot_product_attention = F.scaled_dot_product_attention


def attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√D, masked)·v, written out: queries (B, H, T, D) over keys and values (B, H, L, D).

    Each query scores every key with a dot product, divided by √D so that the
    scores of D-dimensional vectors stay near unit size and the softmax does
    not saturate; the scores of keys it may not see become -inf, so that their
    weight is exactly zero; the softmax over the keys turns each query's
    scores into weights that sum to one, and its output is the weighted sum
    of the values. The result has q's shape.

    Which keys a query sees: the queries are the last T of the L tokens whose
    keys are given, so query t sits at position L − T + t and may look at keys
    0 .. L − T + t, never at a later one: that is what lets a model trained on
    whole texts generate them one token at a time. With T == L this is the
    familiar lower triangle; with T == 1 (a decode step) the one query sees
    every key. A ragged batch, whose rows end at different positions, passes
    `mask` instead: a bool tensor that broadcasts to (B, H, T, L), True where
    a query may look at a key (`causal_mask` builds it from positions).

    This holds the whole (B, H, T, L) score tensor in memory; `causal_attention`
    gets the same numbers from a fused kernel that never does.
    """
    # >>> exercise model-causal-attention (lesson 01, 2 pts): masked scaled dot-product attention, written out
    # hint: where among the L keys does query t sit when no mask is given, and which keys may it see? How large do dot products of D-dimensional vectors grow, and what keeps the softmax from saturating? Over which dimension must each query's weights sum to one, and what score makes a hidden key's weight exactly zero? Off limits: scaled_dot_product_attention, causal_attention, multi_head_attention_forward, transformers.
    T, L = q.shape[-2], k.shape[-2]
    if mask is None:  # the queries are the last T positions: query t sees keys 0 .. L − T + t
        mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])    # (B, H, T, L)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return weights @ v
    # <<< exercise


def causal_mask(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """(..., T) query positions → a bool mask (..., 1, T, num_keys): a query at position p sees keys 0..p.

    The extra dimension broadcasts over heads. Keys past a sequence's own
    length are hidden too, since they sit after its last query: that is how a
    ragged batch of decodes hides the padding of its shorter rows.
    """
    keys = torch.arange(num_keys, device=query_positions.device)
    return (keys <= query_positions[..., None]).unsqueeze(-3)


class Conv1D(nn.Module):
    """y = x·W + b, with W stored [in_features, out_features] as GPT-2's checkpoints store it.

    (The name is historical: OpenAI's code called this projection a 1-wide
    convolution.) Why not nn.Linear, which stores [out, in]? A decode step has
    one token per sequence, so every projection is a matrix-vector product that
    streams W from memory once, and keeping the checkpoint's layout means
    loading is a copy, never a transpose. Which layout a CPU's BLAS streams
    faster depends on the library and the machine; time both with
    `timing.time_fn` before preferring one.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        w = torch.empty(in_features, out_features)  # GPT-2's init, except on the meta device (no values to draw)
        self.weight = nn.Parameter(w if w.is_meta else w.normal_(std=0.02))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # linear computes x·Aᵀ + b; A = Wᵀ is a free view, so this is one addmm over W as stored, and one
        # op dispatched from Python where a reshape, an addmm and a view would be three.
        return F.linear(x, self.weight.t(), self.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)  # q, k and v in one matmul
        self.c_proj = Conv1D(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # >>> exercise model-heads (lesson 01, 2 pts): split the fused qkv projection into heads
        # hint: c_attn(x) holds q, k and v side by side in its last dimension: where does each one's block of columns start, and which of its columns belong to head h? Attention wants (B, n_head, T, head_dim): in what order must the dimensions be split so that a head's columns stay together, before heads move ahead of tokens?
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # <<< exercise
        y = causal_attention(q, k, v) if cache is None else cache.attend(self.layer_idx, q, k, v)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 was trained with the tanh approximation of GELU; the exact erf form drifts by ~1e-3.
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """logits = x·wteᵀ: the head is tied to the token embedding, so the same matrix embeds a token and scores it.

    It owns no weight: the model hands it wte [V, C] at each call. A module of its own only so that a kernel
    layout can take its place (`cpu_layout.py`); state_dict holds wte once, as the checkpoint does.
    """

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        return F.linear(x, wte)  # (..., C) → (..., V)


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config, seed: int | None = 0):
        """Build the model with GPT-2's initialisation, seeded; seed=None skips it: the weights are about to be
        loaded or drawn (`init_weights`), and until then the embeddings hold no chosen values."""
        super().__init__()
        self.config = config
        # Embeddings built from empty tensors: their values come from init_weights or a checkpoint. (Letting
        # nn.Embedding draw its own init on the meta device, where the loader builds, imports torch's compiler: seconds.)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd))
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd, _weight=torch.empty(config.n_ctx, config.n_embd))
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = LMHead()  # tied to wte
        if seed is not None and not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """GPT-2's scheme: N(0, std) weights (GPT-2 used 0.02), zero biases, unit
        LayerNorms, and the residual projections (`c_proj`) scaled by 1/√(2·n_layer)
        so the residual stream's variance does not grow with depth.

        With std 0.02 a random model ignores its context: it repeats the last
        prompt token whatever came before. Timing does not care, but a test that
        compares two decoding paths does, so the tests use std ≈ 0.3, whose next
        token depends on the whole context."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                scale = residual_std if name.endswith("c_proj.weight") else std
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) → logits (B, T, vocab), or (N, vocab) for the N rows of
        the flattened (B·T) batch named by `logits_indices`.

        `positions` (B, T) defaults to 0..T-1; a cache's owner passes the real
        positions of the new tokens. Inputs are trusted here: validate prompts
        once per request with `sampling.check_prompt`, not once per step.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.wte(input_ids) + self.wpe(positions)  # (B, T, C)
        for block in self.h:
            x = block(x, cache)
        if logits_indices is not None:
            x = x.reshape(B * T, -1)[logits_indices]  # (N, C): only the rows we will sample from
        x = self.ln_f(x)
        return self.lm_head(x, self.wte.weight)

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype
