"""What `bench` refuses before it loads or measures anything: numbers out of range, an output it cannot write,
a batch whose KV cache and activations cannot fit, lengths past the model's context. Each error names the value,
the limit and the fix."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..config import dtype_bytes
from ..device import available_memory


def check_arguments(args: argparse.Namespace) -> None:
    """Every number on the command line in its range, before anything is loaded or measured."""
    for flag, low in (("batch", 1), ("prompt_len", 1), ("repeats", 1), ("warmup", 0), ("context_len", 0),
                      ("threads", 1), ("sweep_context", 0)):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be at least {low}")


def check_output_path(flag: str, path: str | None) -> None:
    """An output file's folder exists (made now if need be) and is writable, before any work is done."""
    if path is None:
        return
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(21, "it is a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise PermissionError(13, "its folder is not writable")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror}); give a path in a writable folder") \
            from None


def check_memory(cfg, dtype: torch.dtype, device: torch.device, prompt_len: int, context: int, batch: int) -> None:
    """Refuse, before measuring, a batch whose KV cache and activations cannot fit in the device's memory.

    The larger of the two phases, counted from below: the prefill holds the KV of batch × prompt_len tokens
    and, at its peak, about 8 activations of n_embd per token (the residual, the layer norm, q, k, v and the
    MLP's 4 · n_embd); the decode step holds the KV of batch × (context + 1) tokens."""
    per_token = cfg.kv_bytes_per_token(dtype)
    prefill_tokens = batch * prompt_len
    prefill = prefill_tokens * (per_token + 8 * cfg.n_embd * dtype_bytes(dtype))
    decode = batch * (context + 1) * per_token
    need, have = max(prefill, decode), available_memory(device)
    if need > have:
        phase = (f"the prefill of {batch} × {prompt_len} tokens, KV and activations" if prefill >= decode else
                 f"the decode step's KV of {batch} × {context + 1} tokens")
        raise ValueError(f"--batch {batch} needs at least {need / 2**30:,.1f} GiB ({phase}) but {device} has "
                         f"{have / 2**30:,.1f} GiB available; lower --batch (at most about "
                         f"{max(1, int(batch * have / need)):,} fits) or --prompt-len / --context-len")


def _check(args: argparse.Namespace, n_ctx: int) -> int:
    context = args.prompt_len if args.context_len is None else args.context_len
    if args.prompt_len > n_ctx or context + 1 > n_ctx:
        raise ValueError(f"--prompt-len {args.prompt_len} / --context-len {context} (+1 new token) exceed the "
                         f"model's n_ctx={n_ctx}; use at most {n_ctx} and {n_ctx - 1}")
    return context
