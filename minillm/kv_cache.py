"""The KV cache: compute each token's keys and values once, then only read them.

Why it exists
-------------
A token's key and value at layer l depend only on the tokens up to it, so once
computed they never change. Naive decode (`naive_decode.py`) throws them away
and recomputes all n of them to emit token n+1: O(n) work per step, O(n²) in
total. Keep them in a cache instead and a decode step pushes *one* token
through the weights, then reads the n cached keys and values to attend:

    naive step n:   n tokens through every matmul       → O(n) compute per step
    cached step n:  1 token through every matmul + read n cached K/V  → O(1) compute, O(n) reads

Why that makes decode memory-bound
----------------------------------
A cached decode step does ~2 FLOPs per weight (one multiply-add for the one
token) but must read every weight from memory: about 1 FLOP per byte in fp16.
A modern GPU does hundreds of FLOPs in the time it reads one byte, a CPU tens.
So the step waits on memory, and its time is roughly

    (weight bytes + KV bytes read) / memory bandwidth

Batching B sequences reuses each weight read B times, which is why serving
engines batch decodes (lesson 04).

What it costs
-------------
    KV bytes per token = 2 (K and V) · n_layer · n_embd · bytes per element

    gpt2    (fp16): 2 · 12 · 768  · 2 =  36,864 B ≈  36 KiB per token → 36 MiB per 1,024-token sequence
    gpt2-xl (fp16): 2 · 48 · 1600 · 2 = 307,200 B ≈ 300 KiB per token → 300 MiB per 1,024-token sequence

This file's cache is *contiguous*: every sequence reserves `max_seq_len` slots
up front, [n_layer, batch, n_head, max_seq_len, head_dim] for K and for V. It
is simple and reads K and V in place, but a sequence that stops early leaves
its reservation empty. `paged_attention.py` fixes that waste; lesson 07 measures it.

One step, described once
------------------------
Before each forward pass the cache's owner says what the step holds: a list of
`Segment`s, one per sequence, each "sequence s already has `start` tokens
cached and feeds `num_new` more". The owner keeps each sequence's length (the
cache keeps none: one source of truth), and `prepare` turns the segments into
a `KVCacheMetadata`, positions, masks and the rows every token goes to, built
once and then read, unchanged, by every layer's `attend`. The model reads only
its positions; each cache declares the metadata it reads (the paged cache's
is `PagedMetadata`).

A decode step can also run on buffers allocated once, as a CUDA graph needs:
`cuda_graphs.StaticInputs` owns them, and asks the cache only to fill in its
rows (`fill_decode_inputs`) and to describe a shape once (`decode_metadata`).

Invariants held by the tests: greedy tokens are identical to naive decode, and
the logits of a cached step equal the logits of recomputing the whole sequence;
a static decode step gives the logits of the step `prepare` describes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .config import GPT2Config
from .model import GPT2, causal_attention, causal_mask
from .device import to_device
from .request_checks import check_prompt
from .sampling import make_generator, sample
from .sampling_params import SamplingParams, finish_reason, one_sample


class Segment(NamedTuple):
    """One sequence's share of a forward pass."""
    seq_id: int              # a row of the contiguous cache; a block-table key of the paged one
    start: int               # tokens of this sequence already cached: the first new token's position
    num_new: int             # tokens it feeds in this pass
    is_decode: bool = False  # one token after a cached context; the scheduler decides, the caches only read it


@dataclass
class KVCacheMetadata:
    """What the contiguous cache reads in one forward pass, built once by `prepare`."""
    positions: torch.Tensor            # every new token's position, (B, T) like the model's input ids
    rows: slice | torch.Tensor         # the cache rows of the step: a slice when consecutive, else an index
    max_context_len: int               # keys the longest row attends over; a static step's padded width
    is_fresh_prefill: bool = False     # nothing cached before this pass: the new keys are the whole context
    mask: torch.Tensor | None = None   # for a ragged batched call (causal_mask); None where rows end together
    segments: list[Segment] = field(default_factory=list)  # empty for a static decode step (cuda_graphs.py)


class KVCache:
    """A contiguous K/V reservation for `batch_size` sequences (rows) of up to `max_seq_len` tokens.

    Protocol, once per forward pass:
        meta = cache.prepare([Segment(row, start, num_new), ...])   # every row feeds the same num_new
        logits = model(input_ids, meta.positions, cache=cache)
    `attend` then runs per layer, reading `cache.metadata` and nothing else.
    """

    width_unit = 16  # a static decode step reads a multiple of this many key slots per row

    def __init__(self, config: GPT2Config, batch_size: int, max_seq_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if max_seq_len > config.n_ctx:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context n_ctx={config.n_ctx}; "
                             f"no sequence can be longer than {config.n_ctx} tokens")
        shape = (config.n_layer, batch_size, config.n_head, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.metadata: KVCacheMetadata | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this cache owns (accounted, not measured): the whole reservation, used or not."""
        return self.k.nbytes + self.v.nbytes

    @property
    def max_decode_width(self) -> int:
        """The widest a decode step reads, in `width_unit`s."""
        return -(-self.max_seq_len // self.width_unit)

    def prepare(self, segments: list[Segment]) -> KVCacheMetadata:
        """Describe a forward pass in which row `seq_id` of each segment appends `num_new` tokens after `start`.

        Every row feeds the same number of tokens (the batch is (B, T)). Returns
        the metadata, whose `positions` (B, T) the model takes beside the ids.
        """
        T = segments[0].num_new
        if any(s.num_new != T for s in segments):
            raise ValueError(f"a contiguous step feeds the same number of tokens to every row, got "
                             f"{[s.num_new for s in segments]}; run rows of different lengths in separate passes")
        longest = max(segments, key=lambda s: s.start)
        if longest.start + T > self.max_seq_len:
            raise ValueError(f"row {longest.seq_id} would grow to {longest.start + T} tokens but the cache reserved "
                             f"max_seq_len={self.max_seq_len}; build the cache with a larger max_seq_len")
        device = self.k.device
        rows, starts = [s.seq_id for s in segments], [s.start for s in segments]
        positions = to_device(starts, device)[:, None] + torch.arange(T, device=device)  # (B, T)
        ragged = len(set(starts)) > 1
        # Rows as a slice when every row starts at the same slot and the rows are consecutive: the write is
        # then a plain slice and the read a view, never a copy. Otherwise an index tensor.
        if not ragged and rows == list(range(rows[0], rows[0] + len(rows))):
            row_index: slice | torch.Tensor = slice(rows[0], rows[0] + len(rows))
        else:
            row_index = to_device(rows, device)
        longest_context = max(starts) + T
        self.metadata = KVCacheMetadata(
            positions=positions, rows=row_index, max_context_len=longest_context,
            is_fresh_prefill=all(s == 0 for s in starts),
            mask=causal_mask(positions, longest_context) if ragged else None,  # (B, 1, T, L)
            segments=list(segments))
        return self.metadata

    # ---- a static decode step (cuda_graphs.StaticInputs owns its buffers) -------------

    def decode_keys(self, width: int) -> int:
        """Key slots each row of a static decode step `width` units wide reads."""
        return min(width * self.width_unit, self.max_seq_len)

    def decode_inputs_size(self, max_batch: int) -> int:
        """Integers of this cache's own a static decode step needs beside positions and context lengths."""
        if max_batch > self.batch_size:
            raise ValueError(f"max_batch={max_batch} exceeds the cache's batch_size={self.batch_size} rows; "
                             "a static step pads into rows of the cache, so build it with more rows")
        return max_batch  # the rows

    def fill_decode_inputs(self, host, segments: list[Segment], batch: int, width: int) -> int:
        """Write the rows of a static decode step into `host`; returns how many entries it filled. Padding rows borrow rows of the cache that are
        not in the step: they compute a token nobody samples, and what they write there is scratch. A row
        that is parked, neither in the step nor finished, must not be padded over: give the step all live rows."""
        taken = {s.seq_id for s in segments}
        spare = [r for r in range(self.batch_size) if r not in taken][:batch - len(segments)]
        host[:batch] = [s.seq_id for s in segments] + spare
        return batch

    def decode_metadata(self, positions: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor,
                        batch: int, width: int) -> KVCacheMetadata:
        """The metadata of one static decode shape, on views of the buffers `fill_decode_inputs` fills."""
        return KVCacheMetadata(positions=positions.view(batch, 1), rows=inputs[:batch],
                               max_context_len=self.decode_keys(width), mask=mask)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's seam: store the new k, v, then attend the new queries over the sequence so far."""
        self.write(layer_idx, k, v)
        return self.read(layer_idx, q, k, v)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values, (B, H, T, D), in each row's next T slots."""
        m = self.metadata
        # >>> exercise kv-cache-write (lesson 01, 2 pts): store the new keys and values in their slots
        # hint: row m.rows[i] gets its T new tokens in the slots right after what it has cached (m.positions says which); a slice of rows means every row starts at the same slot, which a plain slice assignment handles
        if isinstance(m.rows, slice):  # every row starts at the same slot: a plain slice write
            start = m.segments[0].start
            self.k[layer_idx, m.rows, :, start:start + k.shape[2]] = k
            self.v[layer_idx, m.rows, :, start:start + k.shape[2]] = v
        else:                          # ragged: scatter each row's tokens to its own slots
            self.k[layer_idx, m.rows[:, None], :, m.positions] = k.transpose(1, 2)
            self.v[layer_idx, m.rows[:, None], :, m.positions] = v.transpose(1, 2)
        # <<< exercise

    def read(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend q (B, H, T, D) over the cached keys and values, after `write` stored this step's."""
        m = self.metadata
        # >>> exercise kv-cache-read (lesson 01, 2 pts): attend the new queries over the cached keys and values
        # hint: what must these queries see: only the new keys and values (when is that all there is?), or what each row has cached? How many of a row's slots hold real keys, and what hides the rest, and the future, from each query? (m is this step's metadata)
        if m.is_fresh_prefill:  # nothing cached before: plain causal attention over the new tokens
            return causal_attention(q, k, v)
        keys = self.k[layer_idx, m.rows, :, :m.max_context_len]     # (B, H, L, D)
        values = self.v[layer_idx, m.rows, :, :m.max_context_len]
        return causal_attention(q, keys, values, m.mask)
        # <<< exercise


@torch.inference_mode()
def generate(model: GPT2, prompts: list[list[int]], params: SamplingParams | None = None,
             on_step=None) -> list[list[int]]:
    """Generate for a batch of prompts (any lengths) with one contiguous cache.

    One prefill per distinct prompt length (a single batched one when all are
    equal), then one batched decode step per token. Returns the new tokens of
    each prompt. `on_step(step, num_tokens)` is called once after the prefill
    (step 0, all its passes and every prompt token together), then after every
    decode step, so lessons can time TTFT and ITL from outside.
    """
    params = one_sample(params or SamplingParams(temperature=0.0), "kv_cache.generate")
    cfg, device = model.config, model.device
    prompts = [check_prompt(cfg, p, params.max_tokens) for p in prompts]
    if not prompts:
        return []
    B = len(prompts)
    # The last sampled token is never fed, so a sequence holds at most prompt + max_tokens − 1 tokens of KV.
    cache = KVCache(cfg, B, max(len(p) for p in prompts) + params.max_tokens - 1, device, model.dtype)
    lengths = [0] * B  # tokens cached per row: this function, the cache's owner, keeps them
    generators = [make_generator(params, device) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]

    # Prefill: group prompts of equal length into one batched forward.
    by_len: dict[int, list[int]] = {}
    for b, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(b)
    first: dict[int, torch.Tensor] = {}
    for T, rows in by_len.items():
        meta = cache.prepare([Segment(b, 0, T) for b in rows])
        ids = torch.tensor([prompts[b] for b in rows], device=device)
        last = torch.arange(len(rows), device=device) * T + (T - 1)  # each row's last position
        logits = model(ids, meta.positions, cache=cache, logits_indices=last)
        for i, b in enumerate(rows):
            first[b] = logits[i]
            lengths[b] = T
    tokens = sample(torch.stack([first[b] for b in range(B)]), [params] * B, generators)
    if on_step is not None:
        on_step(0, sum(len(p) for p in prompts))

    active = []
    for b, t in enumerate(tokens):
        outputs[b].append(t)
        if not finish_reason(t, 1, len(prompts[b]) + 1, params, cfg.eos_token_id, cfg.n_ctx):
            active.append(b)
    step = 0
    while active:
        step += 1
        meta = cache.prepare([Segment(b, lengths[b], 1, is_decode=True) for b in active])
        ids = torch.tensor([[outputs[b][-1]] for b in active], device=device)
        logits = model(ids, meta.positions, cache=cache)[:, -1]
        tokens = sample(logits, [params] * len(active), [generators[b] for b in active])
        if on_step is not None:
            on_step(step, len(active))
        still = []
        for b, t in zip(active, tokens):
            lengths[b] += 1
            outputs[b].append(t)
            if not finish_reason(t, len(outputs[b]), len(prompts[b]) + len(outputs[b]), params,
                                 cfg.eos_token_id, cfg.n_ctx):
                still.append(b)
        active = still
    return outputs
