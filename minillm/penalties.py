"""Penalties and min_tokens: logits that depend on what the sequence already holds.

Sampling (sampling.py) reads one row of logits and nothing else. A penalty also
reads the sequence's history, and changes the logits before any token is chosen
(greedy included: a penalty can move the argmax). With c_t the count of token t
in the generated tokens, and "seen" meaning in the prompt or the output:

    repetition (vLLM's, r > 0, 1 is off)   seen t:  z_t / r  if z_t > 0,  else z_t · r
    frequency  (OpenAI's, f in [-2, 2])    z_t − f · c_t
    presence   (OpenAI's, p in [-2, 2])    z_t − p · [c_t > 0]
    min_tokens (vLLM's)                    while fewer are generated, the end-of-text
                                           and stop ids get −inf

applied in that order, as vLLM does. Frequency and presence read only the
output (OpenAI's definition); repetition reads the prompt too.

What it costs: for the M rows that ask, an (M, V) count of their tokens built
by one scatter, and the upload of their token ids, every step; a batch in which
no request asks pays one check of a flag per row and nothing else. The logits
are changed out of place, so the raw logits stay for the log-probabilities
(logprobs.py), which are the model's, before any of this.

Invariants held by the tests: each formula, on hand-built logits; rows that do
not ask are returned unchanged; greedy with a frequency penalty gives the
sequence the formula predicts, step by step.
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from .device import to_device
from .sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[Seq[int], Seq[int]]] | None,
                    eos_token_id: int | None = None) -> torch.Tensor:
    """The logits (N, V) with each row's penalties and min_tokens mask applied; `histories[i]` is row i's
    (prompt token ids, output token ids). Returns `logits` itself when no row asks, else a new tensor."""
    rows = [i for i, sp in enumerate(params) if sp.reads_history]
    if not rows:
        return logits
    if histories is None or len(histories) != len(params):
        raise ValueError("penalties and min_tokens read each row's tokens so far, which this caller did not pass "
                         "(histories: one (prompt_token_ids, output_token_ids) per row); LLMEngine applies them, "
                         "the single-sequence decoders (naive_decode, kv_cache, speculative) do not")
    V, device = logits.shape[-1], logits.device
    index = to_device(rows, device, torch.long)
    x = logits[index].float()  # (M, V): a copy, the raw logits stay as they are
    outputs = [list(histories[i][1]) for i in rows]
    counts = _counts(outputs, V, device)  # (M, V) c_t over the generated tokens
    sps = [params[i] for i in rows]
    rep = [sp.repetition_penalty for sp in sps]
    if any(r != 1.0 for r in rep):
        seen = _counts([list(histories[i][0]) for i in rows], V, device).add_(counts) > 0
        r = to_device(rep, device, torch.float32)[:, None].expand_as(x)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = to_device([sp.frequency_penalty for sp in sps], device, torch.float32)[:, None]
    pres = to_device([sp.presence_penalty for sp in sps], device, torch.float32)[:, None]
    x = x - freq * counts - pres * (counts > 0).float()
    for m, (sp, out) in enumerate(zip(sps, outputs)):
        if len(out) < sp.min_tokens:
            ends = list(sp.stop_token_ids) + ([] if sp.ignore_eos or eos_token_id is None else [eos_token_id])
            if ends:
                x[m, to_device(ends, device, torch.long)] = float("-inf")
    out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
    out[index] = x
    return out


def _counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """(M, V) float counts of each token id in each row's list: one padded upload, one scatter."""
    width = max(1, max(len(t) for t in token_lists))
    ids = to_device([t + [0] * (width - len(t)) for t in token_lists], device, torch.long)
    ones = to_device([[1.0] * len(t) + [0.0] * (width - len(t)) for t in token_lists], device, torch.float32)
    return torch.zeros(len(token_lists), vocab_size, device=device).scatter_add_(1, ids, ones)
