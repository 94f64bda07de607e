"""Paged attention: keys and values in a pool of blocks, read through block tables.

The block manager (`block_manager.py`) decides which blocks a sequence owns.
This file is the other half of vLLM's PagedAttention: the memory itself, and
attention that finds a sequence's keys and values through its block table.

The pool and the slot mapping
-----------------------------
All KV memory is one tensor per layer, [num_blocks, block_size, K|V, head,
head_dim]. Flatten the first two axes and every token slot has a number, the
slots of one block numbered consecutively. A token's slot is found in two
steps: the block table entry that covers its position names the block, and
its offset inside that block picks the slot.

A forward pass writes each new token's K and V to its slot, one scatter for
the whole ragged batch; the list of slots is the step's *slot mapping*.

What paging costs the attention kernel
--------------------------------------
A sequence's keys are no longer one contiguous slab, so attention must follow
the block table. vLLM writes a CUDA kernel that reads the blocks in place (and
still measured 20–26% attention overhead). In pure PyTorch we *gather* the
blocks into a contiguous buffer and call the same `causal_attention` as the
contiguous cache; the gather is an extra copy of K and V:

    gathered bytes per step = 2 · n_layer · n_embd · bytes · Σ context_len_i      (read, then written)

which is the overhead lesson 05 measures. The pool keeps K and V of a slot
side by side, so that one index_select per layer gathers both, and the
gathered K and V are free views, never copied a second time.

One step
--------
The engine lists the step's segments, decodes first, then prefill chunks, and
calls `prepare` once (the same call, and the same `AttentionMetadata`, as the
contiguous cache). Every layer's `attend` then reads that metadata only:

    decodes        one batched call: each query attends over its own gathered
                   context, a mask hiding the padding of shorter ones
    prefill chunk  one call per chunk: a fresh prompt attends over its own new
                   keys; a later chunk gathers the earlier chunks too

Invariants held by the tests: a ragged step of decodes and chunks gives the
contiguous cache's logits; greedy tokens through the engine are identical to
`kv_cache.generate`.
"""
from __future__ import annotations

import torch

from .block_manager import BlockManager
from .config import GPT2Config
from .kv_cache import AttentionMetadata, Segment
from .model import causal_attention, causal_mask


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Slots of the tokens at positions start .. start+num_tokens-1 of one sequence.

    A token's block is found through the block table, and its slot in the
    flattened pool is that block's first slot plus the token's offset inside it.
    """
    # >>> exercise paged-slot-mapping (lesson 05, 2 pts): map token positions to pool slots through the block table
    # hint: which entry of the block table holds position p, and how far into that block is p? A block's slots are numbered consecutively in the flattened pool
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + num_tokens)]
    # <<< exercise


def gather_kv(layer_pool: torch.Tensor, block_tables: torch.Tensor, context_len: int):
    """Keys and values of a ragged batch, read through the block tables.

    layer_pool: (num_blocks, block_size, 2, H, D) for one layer; block_tables:
    (b, max_blocks) block ids, padded with any valid id. Returns k and v as
    (b, H, context_len, D) views of one gathered buffer; slots past a
    sequence's own length hold padding that the caller masks out.
    """
    # >>> exercise paged-gather (lesson 05, 3 pts): gather a ragged batch's K and V through its block tables
    # hint: one indexing of the pool with the tables gives (b, max_blocks, block_size, 2, H, D); blocks and slots then merge into one token axis, of which the first context_len count; the K|V axis splits, and heads go before tokens
    b, max_blocks = block_tables.shape
    _, block_size, _, H, D = layer_pool.shape
    blocks = layer_pool.index_select(0, block_tables.reshape(-1))          # one copy for K and V together
    tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
    return tokens[:, :, 0].transpose(1, 2), tokens[:, :, 1].transpose(1, 2)  # (b, H, L, D) views
    # <<< exercise


class PagedKVCache:
    """The pool of KV blocks whose tables `blocks` keeps, and attention through them.

    Once per step: `meta = cache.prepare(segments)`, then the model's forward
    over the flattened (1, N) batch calls `attend` per layer.
    """

    def __init__(self, config: GPT2Config, blocks: BlockManager,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.config, self.blocks, self.block_size = config, blocks, blocks.block_size
        # (layer, block, slot, K|V, head, head_dim): K and V of a slot side by side, one gather per layer.
        self.pool = torch.zeros(config.n_layer, blocks.num_blocks, blocks.block_size, 2, config.n_head,
                                config.head_dim, device=device, dtype=dtype)
        self.metadata: AttentionMetadata | None = None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def prepare(self, segments: list[Segment]) -> AttentionMetadata:
        """Describe one forward pass over `segments`, decodes first; their blocks must be there already.

        Returns the metadata, whose `positions` (1, N) the model takes beside the flattened ids.
        """
        device, bs = self.pool.device, self.block_size
        num_decodes = sum(s.is_decode for s in segments)
        if any(s.is_decode for s in segments[num_decodes:]):
            raise ValueError("a step lists its decodes first, then its prefill chunks; got "
                             f"{['decode' if s.is_decode else 'prefill' for s in segments]}")
        positions, slots, query_starts, context_lens, tables = [], [], [0], [], []
        for s in segments:
            table = self.blocks.block_tables[s.seq_id]
            end = s.start + s.num_new
            positions.extend(range(s.start, end))
            slots.extend(slot_mapping(table, s.start, s.num_new, bs))
            query_starts.append(query_starts[-1] + s.num_new)
            context_lens.append(end)
            tables.append(table[:self.blocks.blocks_for(end)])
        width = max(len(t) for t in tables)
        padded = [t + [t[0]] * (width - len(t)) for t in tables]  # pad with a valid id; attention never reads it
        mask = None
        decode_lens = context_lens[:num_decodes]
        if num_decodes and min(decode_lens) != max(decode_lens):  # ragged decodes: hide each row's padding
            mask = causal_mask(torch.tensor(decode_lens, device=device)[:, None] - 1, max(decode_lens))  # (n, 1, 1, L)
        self.metadata = AttentionMetadata(
            segments=list(segments), positions=torch.tensor([positions], device=device), context_lens=context_lens,
            query_starts=query_starts, num_decodes=num_decodes, mask=mask,
            slot_mapping=torch.tensor(slots, device=device), block_tables=torch.tensor(padded, device=device))
        return self.metadata

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: (1, H, N, D) for the N tokens of the step, decodes first, then prefill chunks."""
        m, pool = self.metadata, self.pool[layer_idx]
        # Write every new token's K and V into its slot: one scatter for the whole ragged batch.
        slots = pool.view(-1, 2, *pool.shape[-2:])                     # (num_blocks·block_size, 2, H, D)
        slots[m.slot_mapping] = torch.stack((k[0], v[0]), dim=0).permute(2, 0, 1, 3)  # (N, 2, H, D)
        outputs = []
        n = m.num_decodes
        if n:  # one batched call: each decode query attends over its own gathered context
            context = max(m.context_lens[:n])
            keys, values = gather_kv(pool, m.block_tables[:n, :self.blocks.blocks_for(context)], context)
            q_dec = q[0, :, :n].transpose(0, 1).unsqueeze(2)           # (n, H, 1, D)
            out = causal_attention(q_dec, keys, values, m.mask)
            outputs.append(out.squeeze(2).transpose(0, 1))              # (H, n, D)
        for i in range(n, len(m.segments)):  # one call per prefill chunk (a sequence, not a token)
            a, b, seg = m.query_starts[i], m.query_starts[i + 1], m.segments[i]
            if seg.start == 0:  # fresh prompt: its keys are exactly the new ones
                out = causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
            else:               # a later chunk also sees the earlier chunks, through the block table
                context = m.context_lens[i]
                keys, values = gather_kv(pool, m.block_tables[i:i + 1, :self.blocks.blocks_for(context)], context)
                out = causal_attention(q[:, :, a:b], keys, values)     # queries are the last b − a of the keys
            outputs.append(out[0])
        return torch.cat(outputs, dim=1).unsqueeze(0) if len(outputs) > 1 else outputs[0].unsqueeze(0)
