"""Log-probabilities: how likely the model found each token, generated or given.

A request with `logprobs=k` gets, for each token it generates, log p(token |
everything before it) and the k most likely tokens at that position; one with
`prompt_logprobs=k` gets the same for every prompt token but the first (no
context predicts it). That is what scoring text needs: the log-likelihood of a
continuation is the sum of its tokens' prompt logprobs (lm-evaluation-harness
asks for it with `echo` and `logprobs`).

They are the model's own: log_softmax of the raw logits, before penalties,
temperature, top-k or top-p (vLLM's default `logprobs_mode`, "raw_logprobs"), so
a token scores the same whatever the request samples with.

What they cost. Generated tokens: a log_softmax and a top-k over the rows that
ask, one more transfer to the host per step, nothing for rows that do not.
Prompt tokens: the LM head at every prompt position, not only the last, so a
prefill chunk of n tokens computes n · V logits instead of one row's (the
largest matmul of a small GPT-2, and n · V · 4 bytes of memory at once; chunked
prefill bounds n by max_num_batched_tokens). Only requests that ask pay it:
their rows join the step's `logits_indices`, the others' do not. Positions whose
keys and values come from the prefix cache are never computed, so a request
asking for prompt logprobs takes nothing from the cache (the scheduler starts it
at 0, as vLLM does), though the blocks it fills are cached for others.

Invariants held by the tests: prompt logprobs equal log_softmax of the full
forward pass of the prompt, with chunked prefill and with prefix caching on;
each position is recorded once, however often a preempted request is recomputed.
"""
from __future__ import annotations

import torch

from .device import to_device
from .sequence import Sequence, TokenLogprobs


def gather_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """For each row of logits (M, V): the log-probability of token_ids[row] and its row's ks[row] most likely
    tokens, with one transfer to the host."""
    if not token_ids:
        return []
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, to_device(token_ids, lp.device)[:, None])  # (M, 1)
    k = max(ks)
    top = lp.topk(k, dim=-1) if k else None
    parts = [chosen] + ([top.values, top.indices.float()] if k else [])  # ids < 2^24 are exact in fp32
    rows = torch.cat(parts, dim=1).tolist()
    return [TokenLogprobs(t, row[0], tuple((int(i), v) for v, i in zip(row[1:1 + kk], row[1 + k:1 + k + kk])))
            for t, kk, row in zip(token_ids, ks, rows)]


def sample_logprobs(logits: torch.Tensor, samplers: list[Sequence], tokens: list[int]) -> list:
    """Each sampled token's TokenLogprobs, or None for a row whose request did not ask; `logits` are the raw
    logits the tokens were sampled from (before penalties and temperature)."""
    rows = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if not rows:
        return [None] * len(samplers)
    picked = logits if len(rows) == len(samplers) else logits[to_device(rows, logits.device)]
    found = gather_logprobs(picked, [tokens[i] for i in rows], [samplers[i].params.logprobs for i in rows])
    out = [None] * len(samplers)
    for i, lp in zip(rows, found):
        out[i] = lp
    return out


def prompt_rows(seq: Sequence, start: int, num_tokens: int, offset: int) -> list[tuple[int, int]]:
    """(row of the flattened batch, prompt position it predicts) for a chunk that feeds tokens [start, start +
    num_tokens) of `seq` from row `offset`: the row of token q gives the logits of token q + 1. Only prompt
    positions not yet recorded, and never the last token's row (that one samples)."""
    if seq.prompt_logprobs is None:
        return []
    first = max(start, len(seq.prompt_logprobs) - 1)
    last = min(start + num_tokens, len(seq.prompt_token_ids) - 1)
    return [(offset + q - start, q + 1) for q in range(first, last)]


def record_prompt_logprobs(wanted: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
    """Append to each sequence the logprobs of the prompt position it wanted, row by row of `logits`; a
    position is recorded once, in order (a recomputed prompt finds its positions done)."""
    found = gather_logprobs(logits, [seq.prompt_token_ids[pos] for seq, pos in wanted],
                            [seq.params.prompt_logprobs for seq, _ in wanted])
    for (seq, pos), lp in zip(wanted, found):
        if pos == len(seq.prompt_logprobs):
            seq.prompt_logprobs.append(lp)
