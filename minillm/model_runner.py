"""The model runner: one step's plan as one forward pass, and the logits of the rows that sample.

A plan (`scheduler.py`) is a list of chunks: a decode feeds one token, a
prefill chunk any number of its prompt's. The runner lays them end to end as
one flat, ragged batch, no padding anywhere:

    ids        every chunk's tokens, in the plan's order     (1, Σ n_i)
    segments   (sequence, start, n, is_decode) per chunk      → cache.prepare → positions, slots, tables
    rows       the last row of each chunk that ends its sequence's pending tokens: only these sample

and asks the model for logits at those rows only (`logits_indices`), plus the
prompt rows a request scores (`logprobs.py`). A step of decodes alone takes the
decode runner's buffers allocated once (`cuda_graphs.py`: one CUDA graph per
batch bucket on a GPU) instead.

    cost: one forward pass over Σ n_i tokens; the LM head over the sampling rows (+ the scored ones)

Invariant held by the tests (through the engine's): each row's logits are those
of its sequence computed alone, whatever else shares the batch.
"""
from __future__ import annotations

import torch

from .cuda_graphs import DecodeRunner
from .device import to_device
from .kv_cache import Segment
from .logprobs import prompt_rows, record_prompt_logprobs
from .model import GPT2
from .paged_attention import PagedKVCache
from .scheduler import SchedulerOutput
from .sequence import Sequence


def forward_plan(model: GPT2, cache: PagedKVCache, decoder: DecodeRunner, plan: SchedulerOutput
                 ) -> tuple[torch.Tensor, list[Sequence]]:
    """The logits (one row per sequence that samples) of running `plan`, and whose rows they are."""
    if all(chunk.is_decode for chunk in plan.chunks):  # decode only: static buffers, a graph on CUDA
        samplers = [chunk.seq for chunk in plan.chunks]
        segments = [Segment(s.seq_id, s.num_computed_tokens, 1, True) for s in samplers]
        return decoder.run(segments, [s.output_token_ids[-1] for s in samplers]), samplers
    return forward_ragged(model, cache, plan)


def forward_ragged(model: GPT2, cache: PagedKVCache, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
    """A step with prefill chunks: one ragged forward pass over the flattened batch, shaped for this step."""
    ids, segments, sample_rows, samplers, scored = [], [], [], [], []
    for chunk in plan.chunks:
        seq, n, start = chunk.seq, chunk.num_tokens, chunk.seq.num_computed_tokens
        scored += [(row, seq, pos) for row, pos in prompt_rows(seq, start, n, len(ids))]  # prompt_logprobs
        # A decode feeds its last sampled token; only a prefill chunk needs the token list sliced.
        ids.extend(seq.output_token_ids[-1:] if chunk.is_decode else seq.token_ids[start:start + n])
        segments.append(Segment(seq.seq_id, start, n, chunk.is_decode))
        if start + n == seq.num_tokens:  # its last pending token is in: it samples this step
            sample_rows.append(len(ids) - 1)
            samplers.append(seq)
    device = model.device
    meta = cache.prepare(segments)
    logits = model(to_device([ids], device), meta.positions, cache=cache,
                   logits_indices=to_device(sample_rows + [row for row, _, _ in scored], device))
    if scored:  # rows beyond the samplers' hold the prompt positions some requests score
        record_prompt_logprobs([(seq, pos) for _, seq, pos in scored], logits[len(sample_rows):])
    return logits[:len(sample_rows)], samplers
