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
its reservation empty. `paged_cache.py` fixes that waste; lesson 05 measures it.

Invariant held by the tests: greedy tokens are identical to naive decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import GPT2Config
from .model import GPT2
from .sampling import SamplingParams, finish_reason, make_generator, sample


class KVCache:
    """A contiguous K/V reservation for `batch_size` sequences of up to `max_seq_len` tokens.

    Protocol, once per forward pass:
        positions = cache.prepare(rows, num_new)   # rows: which sequences get num_new tokens each
        logits = model(input_ids, positions, cache=cache)
    `prepare` turns the plan into step metadata (where to write, what each query
    may see) once; `attend` then runs per layer with no further bookkeeping.
    """

    def __init__(self, config: GPT2Config, batch_size: int, max_seq_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if max_seq_len > config.n_ctx:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context n_ctx={config.n_ctx}; "
                             f"no sequence can be longer than {config.n_ctx} tokens")
        shape = (config.n_layer, batch_size, config.n_head, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.lengths = [0] * batch_size  # tokens stored per sequence; plain ints, so no device syncs
        self._step: _Step | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this cache owns (accounted, not measured): the whole reservation, used or not."""
        return self.k.nbytes + self.v.nbytes

    def used_bytes(self) -> int:
        """Bytes that hold a real token's K and V."""
        return self.nbytes * sum(self.lengths) // (len(self.lengths) * self.max_seq_len)

    def prepare(self, rows: list[int], num_new: int) -> torch.Tensor:
        """Plan a forward pass that appends `num_new` tokens to each sequence in `rows`.

        Returns the new tokens' positions (len(rows), num_new) for the model.
        """
        starts = [self.lengths[r] for r in rows]
        if max(starts) + num_new > self.max_seq_len:
            raise ValueError(f"sequence {rows[starts.index(max(starts))]} would grow to {max(starts) + num_new} "
                             f"tokens but the cache reserved max_seq_len={self.max_seq_len}; "
                             "build the cache with a larger max_seq_len")
        device = self.k.device
        self._step = _Step(rows, starts, num_new, device)
        for r in rows:
            self.lengths[r] += num_new
        return self._step.positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's seam: store the new k, v, then attend the new queries over the sequence so far."""
        self.write(layer_idx, k, v)
        return self.read(layer_idx, q, k, v)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values, (b, H, T, D), in each sequence's next T slots."""
        s = self._step
        # >>> exercise kv-cache-write (lesson 02, 2 pts): store the new keys and values in their slots
        # hint: sequence s.rows[i] writes its T tokens at slots s.starts[i] .. s.starts[i]+T-1 of self.k[layer_idx]; s.positions holds those slots
        if s.uniform:  # every row starts at the same slot: a plain slice write
            self.k[layer_idx, s.row_index, :, s.start:s.start + s.num_new] = k
            self.v[layer_idx, s.row_index, :, s.start:s.start + s.num_new] = v
        else:          # ragged: scatter each row's tokens to its own slots
            self.k[layer_idx, s.row_index[:, None], :, s.positions] = k.transpose(1, 2)
            self.v[layer_idx, s.row_index[:, None], :, s.positions] = v.transpose(1, 2)
        # <<< exercise

    def read(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend q (b, H, T, D) over the cached keys and values, after `write` stored this step's."""
        s = self._step
        # >>> exercise kv-cache-read (lesson 02, 2 pts): attend the new queries over the cached keys and values
        # hint: read slots 0 .. s.context_len-1 of the rows; a query at position p sees keys 0..p (s.mask; a fresh prefill can use is_causal on k, v)
        if s.fresh_prefill:  # nothing cached before: plain causal attention over the new tokens
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        keys = self.k[layer_idx, s.row_index, :, :s.context_len]     # (b, H, L, D)
        values = self.v[layer_idx, s.row_index, :, :s.context_len]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=s.mask)
        # <<< exercise


class _Step:
    """The metadata of one forward pass, computed once and read by every layer."""

    def __init__(self, rows: list[int], starts: list[int], num_new: int, device):
        self.rows, self.starts, self.num_new = rows, starts, num_new
        self.uniform = len(set(starts)) == 1
        self.start = starts[0]
        self.fresh_prefill = self.uniform and self.start == 0
        self.context_len = max(starts) + num_new
        # Rows as a slice when possible (reads are then views, no copy), else as an index tensor.
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        if self.uniform and contiguous:
            self.row_index = slice(rows[0], rows[0] + len(rows))
        else:
            self.row_index = torch.tensor(rows, device=device)
        start_t = torch.tensor(starts, device=device)[:, None]
        self.positions = start_t + torch.arange(num_new, device=device)  # (b, T)
        # Query at position p may see keys 0..p. Decode with equal lengths needs no mask at all.
        needs_mask = not self.fresh_prefill and (num_new > 1 or not self.uniform)
        self.mask = None
        if needs_mask:
            key_pos = torch.arange(self.context_len, device=device)
            self.mask = (key_pos[None, None, :] <= self.positions[:, :, None])[:, None]  # (b, 1, T, L)


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
    params = params or SamplingParams(temperature=0.0)
    cfg, device = model.config, model.device
    for p in prompts:
        cfg.check_prompt(p, params.max_tokens)
    B = len(prompts)
    max_seq_len = min(cfg.n_ctx, max(len(p) for p in prompts) + params.max_tokens)
    cache = KVCache(cfg, B, max_seq_len, device, model.dtype)
    generators = [make_generator(params, device) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]

    # Prefill: group prompts of equal length into one batched forward.
    by_len: dict[int, list[int]] = {}
    for b, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(b)
    first: dict[int, torch.Tensor] = {}
    for T, rows in by_len.items():
        positions = cache.prepare(rows, T)
        ids = torch.tensor([prompts[b] for b in rows], device=device)
        last = torch.arange(len(rows), device=device) * T + (T - 1)  # each row's last position
        logits = model(ids, positions, cache=cache, logits_indices=last)
        for i, b in enumerate(rows):
            first[b] = logits[i]
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
        positions = cache.prepare(active, 1)
        ids = torch.tensor([[outputs[b][-1]] for b in active], device=device)
        logits = model(ids, positions, cache=cache)[:, -1]
        tokens = sample(logits, [params] * len(active), [generators[b] for b in active])
        if on_step is not None:
            on_step(step, len(active))
        still = []
        for b, t in zip(active, tokens):
            outputs[b].append(t)
            if not finish_reason(t, len(outputs[b]), len(prompts[b]) + len(outputs[b]), params,
                                 cfg.eos_token_id, cfg.n_ctx):
                still.append(b)
        active = still
    return outputs
