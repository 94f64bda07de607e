"""GPT-2 shapes, and the arithmetic every lesson leans on.

A GPT-2 is fully described by five numbers: layers, heads, width, context and
vocabulary. Everything a serving engineer needs to budget follows from them:

    parameters      ~ 12 · n_layer · n_embd²  +  (vocab + n_ctx) · n_embd
    weight bytes    = parameters · bytes per element
    KV bytes/token  = 2 · n_layer · n_embd · bytes per element   (a K and a V per layer)
    FLOPs/token     ~ 2 · parameters  +  4 · n_layer · n_embd · context   (matmuls + attention)

Worked example, fp16: `gpt2` has 124M parameters (249 MB) and its KV cache
costs 2 · 12 · 768 · 2 = 36 KiB per token; `gpt2-xl` has 1.56B parameters
(3.1 GB) and costs 2 · 48 · 1600 · 2 = 300 KiB per token, so 10,000 tokens of
context in flight already weigh as much as the model itself.

The presets are named exactly as the Hugging Face checkpoints are. `tiny` and
`mini` are made-up shapes for tests and quick runs: same architecture, small
enough that a CPU runs them in milliseconds.

Invariants held by the tests: `num_params` equals the published parameter
count of each checkpoint and the parameters of a built model; a config holds
only positive integer shapes with n_embd divisible by n_head, whether made in
code or read from a `config.json`.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EOS_TOKEN_ID = 50256  # "<|endoftext|>" in GPT-2's vocabulary
# Bounds far beyond any GPT-2 (gpt2-xl: 48 layers, 1600 wide): past them a value is a typo, not a model.
MAX_LAYERS, MAX_WIDTH, MAX_POSITIONS, MAX_VOCAB = 1_000, 100_000, 1_000_000, 10_000_000


def check_int(name: str, value, low: int, high: float = math.inf, hint: str = "") -> int:
    """`value` as a Python int in [low, high), NumPy's and torch's integers included; else a ValueError
    that names the field, the value and the limit."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is a {type(value).__name__}; it must be an integer{hint}") from None
    if not low <= value < high:
        limit = f"in [{low}, {high:.0f})" if high < math.inf else f"≥ {low}"
        raise ValueError(f"{name}={value} must be {limit}{hint}")
    return value


def check_real(name: str, value, hint: str = "") -> float:
    """`value` as a finite Python float; else a ValueError that names the field and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} is a {type(value).__name__}; it must be a number{hint}")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number{hint}")
    return float(value)


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_ctx: int = 1024  # the longest sequence the position table covers
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = EOS_TOKEN_ID

    def __post_init__(self):
        limits = {"n_layer": MAX_LAYERS, "n_head": MAX_WIDTH, "n_embd": MAX_WIDTH, "n_ctx": MAX_POSITIONS,
                  "vocab_size": MAX_VOCAB}
        for name, high in limits.items():
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1, high + 1))
        eps = check_real("layer_norm_epsilon", self.layer_norm_epsilon, " (GPT-2 uses 1e-05)")
        if not 0 < eps < 1:
            raise ValueError(f"layer_norm_epsilon={eps:g} must be in (0, 1): it keeps LayerNorm from dividing "
                             "by zero (GPT-2 uses 1e-05)")
        object.__setattr__(self, "layer_norm_epsilon", eps)
        if self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_id", check_int(
                "eos_token_id", self.eos_token_id, 0, self.vocab_size,
                hint=", inside the vocabulary; or None (null in config.json) for a vocabulary without one"))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             "every head must get the same width, so pick an n_head that divides n_embd")

    @classmethod
    def from_preset(cls, name: str) -> "GPT2Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}")
        return PRESETS[name]

    def with_(self, **changes) -> "GPT2Config":
        return replace(self, **changes)

    # ---- derived figures ---------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Exact parameter count; the LM head is tied to `wte`, so it adds nothing."""
        C, L = self.n_embd, self.n_layer
        per_block = (2 * C                 # ln_1
                     + C * 3 * C + 3 * C   # attn.c_attn
                     + C * C + C           # attn.c_proj
                     + 2 * C               # ln_2
                     + C * 4 * C + 4 * C   # mlp.c_fc
                     + 4 * C * C + C)      # mlp.c_proj
        return self.vocab_size * C + self.n_ctx * C + L * per_block + 2 * C

    def weight_bytes(self, dtype: torch.dtype | None = None) -> int:
        """num_params · bytes per element (fp32 when no dtype is given)."""
        return self.num_params() * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """2 (K and V) · n_layer · n_embd · bytes per element (fp32 when no dtype is given)."""
        return 2 * self.n_layer * self.n_embd * dtype_bytes(dtype)

    def flops_per_token(self, context_len: int = 0, lm_head: bool = True) -> int:
        """FLOPs to push one token through the model while it attends to `context_len` tokens.

        2 FLOPs (a multiply and an add) per weight in every projection, plus the
        attention itself: q·kᵀ and p·v each cost 2 · n_embd per context token per layer.
        """
        C = self.n_embd
        proj = 2 * self.n_layer * 12 * C * C
        attn = 4 * self.n_layer * C * context_len
        head = 2 * self.vocab_size * C if lm_head else 0
        return proj + attn + head


def dtype_bytes(dtype: torch.dtype | None) -> int:
    """Bytes per element: 4 for fp32 (and for None), 2 for fp16 and bf16."""
    return 4 if dtype is None else dtype.itemsize


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": GPT2Config(n_layer=6, n_head=12, n_embd=768),  # gpt2 distilled to half its depth
    # Made-up shapes for tests and quick runs. The vocabulary of 512 is what the
    # offline byte-level fallback tokenizer needs (256 bytes + end-of-text, padded).
    "tiny": GPT2Config(n_layer=2, n_head=4, n_embd=64, n_ctx=128, vocab_size=512, eos_token_id=256),
    "mini": GPT2Config(n_layer=4, n_head=4, n_embd=128, n_ctx=256, vocab_size=512, eos_token_id=256),
}

HF_CHECKPOINTS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2")  # presets with real weights

__all__ = ["GPT2Config", "PRESETS", "HF_CHECKPOINTS", "EOS_TOKEN_ID", "dtype_bytes", "check_int", "check_real"]
