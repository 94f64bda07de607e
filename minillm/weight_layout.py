"""Weight layouts for a CPU, chosen once the weights are in: the same products, read from copies laid out for
the kernel that runs them.

The model keeps the copies (`GPT2.use_lm_head_copy`, `GPT2.pack_linears`),
made from the weights as they are: whoever loads or changes the weights makes
them afterwards (`checkpoints.load.choose_layout`); `lm_head_layout` and
`linears_layout` name the layout in use.

Which kernel runs a product depends on its rows: one row (a batch-1 decode) is
a matrix-vector product that streams each weight once, at the bandwidth;
several rows (a batch of decodes, a verification pass, a prefill chunk) are a
matmul. On the 2-core AVX2 EPYC (one thread, others' load 4 to 5):

    LM head, 1 row      F.linear(h, wte) 26.9 ms, h @ [C, V] copy 20.8 ms, oneDNN packed 31.3 ms
    LM head, 16 rows    126 ms, 104 ms, 61 ms
    12 × c_fc, 1 row    MKL over W 10.4 ms, oneDNN packed 18.2 ms
    12 × c_fc, 16 rows  119 ms, 65 ms

so each product keeps what serves it: the head's [C, V] copy and each W for one
row, the packed copies for several. Cost in memory: one more copy of each
matrix per layout (gpt2 fp32: 154 MB per head copy, 340 MB for the packed
blocks); in bytes read per step: none, a step reads one copy of each.
A packed copy is oneDNN's opaque blocked layout (what torch.compile's CPU
weight prepacking makes): it is never saved, never moved by `.to()` (a product
on another device or dtype falls back to W), and a deep copy of its module
makes its own. Invariant held by the tests: every layout gives W's logits
(fp32: 1e-5), in the model, the engine and against transformers' reference.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


def onednn_pack(weight_out_in: torch.Tensor) -> torch.Tensor:
    """A copy of W [out, in] reordered once into oneDNN's blocked layout for matmuls of several rows (tuned for
    16; what torch.compile's CPU weight prepacking makes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.contiguous(), 16)


def deepcopy_repacking(module: nn.Module, memo: dict, name: str, repack) -> nn.Module:
    """copy.deepcopy for a module holding a oneDNN copy in attribute `name` (opaque: it cannot be copied): copy
    the rest, then make the twin's own copy from its own weights, `repack(twin)`."""
    twin = module.__class__.__new__(module.__class__)
    memo[id(module)] = twin
    twin.__dict__.update({k: None if k == name else copy.deepcopy(v, memo) for k, v in module.__dict__.items()})
    if getattr(module, name) is not None:
        setattr(twin, name, repack(twin))
    return twin


def serves_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a packed copy computes this product: several rows, inference, on the CPU, in the copy's dtype."""
    return (packed is not None and x.numel() > x.shape[-1] and not torch.is_grad_enabled()
            and x.device.type == "cpu" and x.dtype == packed.dtype)
