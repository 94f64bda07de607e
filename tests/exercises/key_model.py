"""The answer key of lesson 02's model exercises (model-causal-attention, model-heads), and the answers of
their classic mistakes, so that a message can name the one a student made.

Instructor only: `make` leaves every key_*.py out of a student copy. The oracles work in float64 from the
definitions (which keys a query may see, as a table of booleans; the softmax as exponentials over their sum;
head h as a block of columns), never through minillm. key_kv_cache.py attends with `attention` too.
"""
from __future__ import annotations

import torch

# ---------------------------------------------------------------- keys


def same(a, b) -> bool:
    """Two answers alike within fp32 tolerance: tensors, or dicts of them (alike in what `a` holds)."""
    if isinstance(a, dict):
        return all(n in b and same(a[n], b[n]) for n in a)
    return a.shape == b.shape and bool(torch.isclose(a.double(), b.double(), atol=1e-6, rtol=1e-5).all())


def key(want, mistakes: dict) -> dict:
    """An answer key: the answer, and the mistakes whose answers differ from it and from each other's (a
    mistake that gives the right answer on a case cannot be named there, and need not travel)."""
    kept: dict = {}
    for name, answer in mistakes.items():
        if not same(answer, want) and not any(same(answer, other) for other in kept.values()):
            kept[name] = answer
    return {"want": want, "mistakes": kept}


# ---------------------------------------------------------------- attention


def visible_keys(T: int, L: int, offset: int | None = None, extra: int = 0) -> torch.Tensor:
    """(T, L) bools: query t sits at position offset + t (offset L − T: the queries are the last T of the
    L tokens) and sees keys 0 .. offset + t + extra. `offset=0` is the top-left triangle, `extra=1` one key
    too many: two classic mistakes."""
    offset = L - T if offset is None else offset
    return torch.tensor([[s <= offset + t + extra for s in range(L)] for t in range(T)])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None,
              scale: float | None = None, over: str = "keys", hide_after: bool = False) -> torch.Tensor:
    """Σ_s w_ts · v_s with w_t = softmax over the keys s that query t may see (`allowed` broadcasts to
    (B, H, T, L); None: the causal rule of `visible_keys`) of q_t·k_s · scale (None: 1/√D). Two mistakes'
    answers: `over="queries"` normalises each key's column over the queries instead; `hide_after` takes the
    softmax over every key, then zeroes the hidden ones. float64, in q's dtype at the end."""
    B, H, T, D = q.shape
    L = k.shape[-2]
    allowed = (visible_keys(T, L) if allowed is None else allowed.bool()).expand(B, H, T, L)
    scale = D ** -0.5 if scale is None else scale
    scores = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * scale
    axis = -1 if over == "keys" else -2
    counted = torch.ones_like(allowed) if hide_after else allowed   # the keys the softmax normalises over
    top = scores.masked_fill(~counted, float("-inf")).amax(dim=axis, keepdim=True).clamp(min=-1e300)
    exps = torch.where(counted, (scores - top).exp(), torch.zeros((), dtype=torch.float64))
    total = exps.sum(dim=axis, keepdim=True)
    weights = exps / torch.where(total > 0, total, torch.ones((), dtype=torch.float64))
    weights = weights.masked_fill(~allowed, 0.0)
    return torch.einsum("bhts,bhsd->bhtd", weights, v.double()).to(q.dtype)


def causal_attention_key(inputs: dict) -> dict:
    """The key of one model-causal-attention case: the answer, and what each classic mistake returns."""
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs.get("mask")
    T, L, D = q.shape[-2], k.shape[-2], q.shape[-1]
    rule = visible_keys(T, L) if mask is None else mask
    mistakes = {
        "the scores are not scaled by 1/√D (the dot products of D-dimensional vectors grow with D, "
        "and the softmax saturates)": attention(q, k, v, rule, scale=1.0),
        "the scores are divided by D, not by √D": attention(q, k, v, rule, scale=1.0 / D),
        "the softmax runs over the queries, not over the keys: each query's weights must sum to one":
            attention(q, k, v, rule, over="queries"),
        "the hidden keys' weights were zeroed after the softmax: their scores must be -inf before it, so that "
        "the weights of the keys a query sees sum to one": attention(q, k, v, rule, hide_after=True),
    }
    if mask is None:
        mistakes.update({
            "the mask ignores the L − T offset of the cached keys: query t sits at position L − T + t, "
            "not at position t": attention(q, k, v, visible_keys(T, L, offset=0)),
            "the mask is off by one: each query sees one key after its own position":
                attention(q, k, v, visible_keys(T, L, extra=1)),
            "nothing is hidden: a query sees the keys after its own position": attention(q, k, v, torch.ones(T, L)),
        })
    else:
        mistakes["the given mask is ignored: a ragged batch's mask says which keys each query may see"] = \
            attention(q, k, v, visible_keys(T, L))
    return key(attention(q, k, v, rule), mistakes)


# ---------------------------------------------------------------- heads


def fused_projection(inputs: dict) -> torch.Tensor:
    """c_attn(x) = x·W + b, (B, T, 3C): q's C columns, then k's, then v's."""
    return inputs["x"].double() @ inputs["weight"].double() + inputs["bias"].double()


def split_heads(block: torch.Tensor, H: int) -> torch.Tensor:
    """(B, T, C) → (B, H, T, D): head h is columns h·D .. (h+1)·D, taken for every token."""
    D = block.shape[-1] // H
    return torch.stack([block[:, :, h * D:(h + 1) * D] for h in range(H)], dim=1)


def heads_key(inputs: dict) -> dict:
    """The key of one model-heads case: the q, k, v handed to the cache, and what each classic mistake hands."""
    fused, H = fused_projection(inputs), inputs["n_head"]
    B, T, C3 = fused.shape
    C = C3 // 3
    D = C // H
    thirds = [fused[:, :, i * C:(i + 1) * C] for i in range(3)]
    want = {name: split_heads(third, H).float() for name, third in zip("qkv", thirds)}
    straight = {"q": thirds[0].reshape(B, H, T, D).float()}   # a split done wrong is done wrong for all three:
    interleaved = {"q": thirds[0].reshape(B, T, D, H).permute(0, 3, 1, 2).float()}   # q alone names it
    return key(want, {
        "heads reshaped straight to (B, H, T, D): in c_attn(x) each token's row holds its heads side by side, "
        "so a reshape that puts the heads before the tokens mixes tokens into heads": straight,
        "the heads' columns are interleaved: head h is the h-th block of D consecutive columns, not every "
        "H-th column": interleaved,
        "q and k are taken in the wrong order: c_attn(x) holds q's C columns first, then k's, then v's":
            {"q": want["k"], "k": want["q"]},
    })
