"""The paged KV cache: fixed-size blocks and block tables, as in vLLM's PagedAttention.

The problem it solves
---------------------
A server does not know how long a request will run. The contiguous cache
(`kv_cache.py`) must therefore reserve `max_seq_len` slots per sequence up
front, and memory is wasted in two ways:

    internal fragmentation   reserved slots that no token ever fills
                             (a request that stops after 40 tokens of a 1,024 reservation)
    external fragmentation   free memory in pieces too small for the next reservation

vLLM measured that earlier systems kept real tokens in only 20–38% of their KV
memory. Since decode is memory-bound and batch size is capped by KV memory
(lesson 04), that waste is throughput thrown away.

The idea
--------
Cut KV memory into a pool of equal *blocks* of `block_size` token slots (per
layer: K and V for block_size tokens). A sequence owns a list of block ids, its
*block table*, and grows one block at a time, exactly like virtual memory pages:

    block table of seq 7:  [12, 3, 40]      block_size = 16
    token at position p    lives in block table[p // 16], offset p % 16
    its "slot"             = table[p // 16] · 16 + p % 16   (the slot mapping)

Any free block serves any sequence, so there is no external fragmentation, and
only a sequence's last block is partly empty: internal waste is under one
block per sequence. Blocks are reference-counted, so two sequences can share a
block (a forked sequence, a shared prompt prefix); a write to a shared block
first copies it (copy-on-write).

Why block_size = 16
-------------------
Smaller blocks waste less (on average block_size/2 slots per sequence) but mean
longer block tables, more scattered reads and more bookkeeping per token.
Larger blocks read more efficiently and waste more. 16 tokens is vLLM's default
and sits where the waste is already a few percent. Lesson 05 sweeps it.

What paging costs the attention kernel
--------------------------------------
A sequence's keys are no longer one contiguous slab, so attention must follow
the block table. vLLM writes a CUDA kernel that reads the blocks in place (and
still measured 20–26% attention overhead). In pure PyTorch we *gather* the
blocks into a contiguous buffer and call the same attention as the contiguous
cache; the gather is an extra copy of K and V, which is the overhead lesson 05
measures. The pool is laid out [block, slot, K|V, head, head_dim] so that a
single index_select per layer gathers K and V together and the gathered K and
V are then free views, never copied a second time.

Invariants held by the tests: greedy tokens are identical to the contiguous
cache; after every step each block is either free or referenced, none lost;
when every sequence has finished or been aborted, every block is free.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from .config import GPT2Config

DEFAULT_BLOCK_SIZE = 16


class BlockAllocator:
    """Hands out block ids from a free list and counts references to each block."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the pool needs at least one block; pass num_blocks ≥ 1")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        # >>> exercise paged-allocate (lesson 05, 2 pts): take a block from the free list with one reference
        # hint: raise a RuntimeError naming the pool size when the free list is empty; otherwise pop a block id, set its ref count to 1
        if not self.free_blocks:
            raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use; "
                               "the scheduler must preempt a sequence before allocating")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block
        # <<< exercise

    def share(self, block: int) -> None:
        """One more sequence refers to `block` (a fork, or a shared prefix)."""
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free; only an allocated block can be shared")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none are left."""
        # >>> exercise paged-free (lesson 05, 2 pts): drop a reference and recycle the block at zero
        # hint: freeing a block whose count is already 0 is a bug (raise RuntimeError); append it to the free list only when its count reaches 0
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"double free: block {block} has no references left")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
        # <<< exercise

    def check_invariants(self, block_tables: dict[int, list[int]]) -> None:
        """Every block is either free or referenced exactly as often as the tables say."""
        expected = [0] * self.num_blocks
        for table in block_tables.values():
            for block in table:
                expected[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == expected[block], \
                f"block {block}: ref count {self.ref_counts[block]} but {expected[block]} tables hold it"
            assert (block in free) == (expected[block] == 0), \
                f"block {block} is {'free' if block in free else 'not free'} with {expected[block]} references"


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Slots of the tokens at positions start .. start+num_tokens-1 of one sequence.

    A token at position p lives in block block_table[p // block_size] at offset
    p % block_size; its slot in the flattened pool is block · block_size + offset.
    """
    # >>> exercise paged-slot-mapping (lesson 05, 2 pts): map token positions to pool slots through the block table
    # hint: for each position p: block_table[p // block_size] * block_size + p % block_size
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
    # hint: index the pool with the (b, max_blocks) table → (b, max_blocks, block_size, 2, H, D); merge blocks and slots into one token axis; keep the first context_len tokens; split K|V; put heads before tokens
    b, max_blocks = block_tables.shape
    _, block_size, _, H, D = layer_pool.shape
    blocks = layer_pool.index_select(0, block_tables.reshape(-1))          # one copy for K and V together
    tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
    return tokens[:, :, 0].transpose(1, 2), tokens[:, :, 1].transpose(1, 2)  # (b, H, L, D) views
    # <<< exercise


class PagedKVCache:
    """A pool of KV blocks shared by many sequences, plus each sequence's block table.

    Memory side: `can_append`, `append_slots` and `free` (what the scheduler uses), and `fork`.
    Attention side (used by the model): once per step the engine calls
        positions = cache.prepare([(seq_id, num_new_tokens), ...])
    with the decodes (1 token each) first and prefill chunks after; then the model's
    forward calls `attend` per layer on the flattened (1, N) batch.
    """

    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be ≥ 1 token")
        self.config, self.block_size = config, block_size
        self.allocator = BlockAllocator(num_blocks)
        # (layer, block, slot, K|V, head, head_dim): K and V of a slot side by side, one gather per layer.
        self.pool = torch.zeros(config.n_layer, num_blocks, block_size, 2, config.n_head, config.head_dim,
                                device=device, dtype=dtype)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}  # tokens whose K/V are stored, per sequence
        self._step: _PagedStep | None = None

    # ---- memory side --------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def bytes_per_block(self) -> int:
        return self.pool.nbytes // self.num_blocks

    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        """New blocks `append_slots(seq_id, num_new)` would take, copy-on-write included."""
        table = self.block_tables.get(seq_id, [])
        length = self.seq_lens.get(seq_id, 0)
        needed = -(-(length + num_new) // self.block_size) - len(table)
        if length % self.block_size and self.allocator.ref_counts[table[-1]] > 1:
            needed += 1  # the shared, partly filled last block must be copied before we write into it
        return needed

    def can_append(self, seq_id: int, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= self.num_free_blocks

    def append_slots(self, seq_id: int, num_new: int) -> None:
        """Make room for `num_new` more tokens of `seq_id`: copy a shared last block, add blocks."""
        if not self.can_append(seq_id, num_new):
            raise RuntimeError(f"sequence {seq_id} needs {self.blocks_needed(seq_id, num_new)} blocks "
                               f"but {self.num_free_blocks} are free; check can_append first")
        table = self.block_tables.setdefault(seq_id, [])
        length = self.seq_lens.setdefault(seq_id, 0)
        if length % self.block_size and self.allocator.ref_counts[table[-1]] > 1:
            table[-1] = self._copy_on_write(table[-1])
        while len(table) * self.block_size < length + num_new:
            table.append(self.allocator.allocate())

    def _copy_on_write(self, block: int) -> int:
        fresh = self.allocator.allocate()
        self.pool[:, fresh] = self.pool[:, block]
        self.allocator.free(block)  # drops our reference; the other owner keeps it
        return fresh

    def free(self, seq_id: int) -> None:
        """Return a finished, aborted or preempted sequence's blocks to the pool."""
        for block in self.block_tables.pop(seq_id, []):
            self.allocator.free(block)
        self.seq_lens.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts as the parent's exact copy, sharing every block (no KV is copied)."""
        for block in self.block_tables[parent_id]:
            self.allocator.share(block)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]

    def check_invariants(self) -> None:
        self.allocator.check_invariants(self.block_tables)
        for seq_id, table in self.block_tables.items():
            assert len(table) * self.block_size >= self.seq_lens[seq_id], f"sequence {seq_id} outgrew its blocks"

    # ---- attention side -----------------------------------------------------

    def prepare(self, segments: list[tuple[int, int]]) -> torch.Tensor:
        """Plan one forward pass over `segments` [(seq_id, num_new), ...], decodes first.

        Blocks must already be there (`append_slots`). Returns the positions
        (1, N) of the flattened batch and records what every layer needs.
        """
        self._step = _PagedStep(self, segments)
        for seq_id, num_new in segments:
            self.seq_lens[seq_id] += num_new
        return self._step.positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: (1, H, N, D) for the N tokens of the step, decodes first, then prefill chunks."""
        s, pool = self._step, self.pool[layer_idx]
        # Write every new token's K and V into its slot: one scatter for the whole ragged batch.
        slots = pool.view(-1, 2, *pool.shape[-2:])                     # (num_blocks·block_size, 2, H, D)
        slots[s.slot_mapping] = torch.stack((k[0], v[0]), dim=0).permute(2, 0, 1, 3)  # (N, 2, H, D)
        outputs = []
        if s.num_decodes:  # one batched call: each decode query attends over its own gathered context
            n = s.num_decodes
            keys, values = gather_kv(pool, s.decode_block_tables, s.decode_context_len)
            q_dec = q[0, :, :n].transpose(0, 1).unsqueeze(2)           # (n, H, 1, D)
            out = F.scaled_dot_product_attention(q_dec, keys, values, attn_mask=s.decode_mask)
            outputs.append(out.squeeze(2).transpose(0, 1))              # (H, n, D)
        for chunk in s.prefills:  # one call per prefill chunk (a sequence, not a token)
            q_c = q[:, :, chunk.offset:chunk.offset + chunk.num_new]    # (1, H, T, D)
            if chunk.start == 0:  # fresh prompt: its keys are exactly the new ones
                k_c, v_c = k[:, :, chunk.offset:chunk.offset + chunk.num_new], v[:, :, chunk.offset:chunk.offset + chunk.num_new]
                out = F.scaled_dot_product_attention(q_c, k_c, v_c, is_causal=True)
            else:                 # a later chunk also sees the earlier chunks, through the block table
                k_c, v_c = gather_kv(pool, chunk.block_table, chunk.start + chunk.num_new)
                out = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=chunk.mask)
            outputs.append(out[0])
        return torch.cat(outputs, dim=1).unsqueeze(0) if len(outputs) > 1 else outputs[0].unsqueeze(0)


class _PrefillChunk:
    def __init__(self, offset: int, start: int, num_new: int, block_table: torch.Tensor, mask):
        self.offset, self.start, self.num_new = offset, start, num_new
        self.block_table, self.mask = block_table, mask


class _PagedStep:
    """Step metadata, built once per forward and read by every layer: slot mapping,
    padded block tables and context lengths of the decodes, and each prefill chunk."""

    def __init__(self, cache: PagedKVCache, segments: list[tuple[int, int]]):
        device, bs = cache.pool.device, cache.block_size
        positions, slots = [], []
        decode_tables, decode_lens = [], []
        self.prefills: list[_PrefillChunk] = []
        offset = 0
        for seq_id, num_new in segments:
            start, table = cache.seq_lens[seq_id], cache.block_tables[seq_id]
            positions.extend(range(start, start + num_new))
            slots.extend(slot_mapping(table, start, num_new, bs))
            if num_new == 1 and start > 0 and not self.prefills:  # the leading run of decodes
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                self.prefills.append(self._chunk(offset, start, num_new, table, bs, device))
            offset += num_new
        self.positions = torch.tensor([positions], device=device)
        self.slot_mapping = torch.tensor(slots, device=device)
        self.num_decodes = len(decode_tables)
        if self.num_decodes:
            self.decode_context_len = max(decode_lens)
            width = -(-self.decode_context_len // bs)
            padded = [t[:width] + [t[0]] * (width - len(t)) for t in decode_tables]  # pad with a valid id
            self.decode_block_tables = torch.tensor(padded, device=device)
            self.decode_mask = None
            if min(decode_lens) != self.decode_context_len:  # ragged: hide each row's padding
                lens = torch.tensor(decode_lens, device=device)
                key_pos = torch.arange(self.decode_context_len, device=device)
                self.decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # (n, 1, 1, L)

    @staticmethod
    def _chunk(offset, start, num_new, table, bs, device) -> _PrefillChunk:
        if start == 0:
            return _PrefillChunk(offset, 0, num_new, None, None)
        end = start + num_new
        block_table = torch.tensor([table[:-(-end // bs)]], device=device)
        key_pos = torch.arange(end, device=device)
        query_pos = torch.arange(start, end, device=device)
        mask = key_pos[None, :] <= query_pos[:, None]  # (T, L): query at p sees keys 0..p
        return _PrefillChunk(offset, start, num_new, block_table, mask)
