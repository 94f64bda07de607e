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

A forward pass writes each new token's K and V to its slot, one copy for
the whole ragged batch; the list of slots is the step's *slot mapping*. The
pool holds one block more than the block manager hands out, the *pad block*:
padded block-table entries name it, and the padding rows of a static decode
step (for CUDA graphs, `fill_decode_inputs`) write into it. Nothing reads it
unmasked.

What paging costs the attention kernel
--------------------------------------
A sequence's keys are no longer one contiguous slab, so attention must follow
the block table. vLLM writes a CUDA kernel that reads the blocks in place (and
still measured 20–26% attention overhead). In pure PyTorch we *gather* the
blocks into a contiguous buffer and call the same `causal_attention` as the
contiguous cache; the gather is an extra copy of K and V:

    gathered bytes per step = 2 · n_layer · n_embd · bytes · Σ context_len_i      (read, then written)

which is the overhead lesson 08 measures. The pool keeps K and V of a slot
side by side, so that one index_select per layer gathers both, and the
gathered K and V are free views, never copied a second time.

The copy is made every layer of every step, and where it lands matters as
much as its bytes. A fresh buffer costs more than its bytes on a CPU: glibc's
allocator maps any block over its threshold (at most 32 MiB) afresh and unmaps
it when freed, so the kernel faults its pages in one by one, every time. And
each call costs a fixed price: every parallel kernel wakes torch's sleeping
OpenMP threads (bench/threads.py). So on a CPU the decodes are gathered and
attended in groups of rows whose copies stay within `gather_bytes`
(`GATHER_BYTES`, 4 MiB; a row whose context alone passes it goes alone), each
group into the same scratch buffer, which the cache keeps from layer to layer
and step to step: no page is faulted in twice, and a group's copy is still in
the cores' own caches (1–2 MiB of L2 a core) when attention reads it back; a
last-level cache shared with neighbours may not keep a larger one.
Grouping is a matter of speed: on one thread a row's output is the same bits
in any group; on several, torch's kernel may round a row's heads in its last
bit differently as they land on another thread. `python -m minillm.bench.gather
--gather-bytes N` serves a workload so; docs/serving.md and docs/bench.md have
what it measured. A GPU gathers in one call, into a fresh buffer: its allocator
caches blocks, and each group would cost launches.

One step
--------
The engine lists the step's segments, decodes first, then prefill chunks, and
calls `prepare` once (the same call as the contiguous cache's, returning this
cache's own `PagedMetadata`). Every layer's `attend` then reads that metadata only:

    decodes        batched calls, one per group of rows (one group on a GPU):
                   each query attends over its own gathered context, a mask
                   hiding the padding of shorter ones (a static step always
                   masks: its width is padded to a bucket)
    prefill chunk  one call per chunk: a fresh prompt attends over its own new
                   keys; a later chunk gathers the earlier chunks too

Invariants held by the tests: a ragged step of decodes and chunks gives the
contiguous cache's logits; greedy tokens through the engine are identical to
`kv_cache.generate`, with decode steps exact or padded; padding writes only
the pad block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .config import GPT2Config
from .kv_cache import Segment
from .model import causal_attention, causal_mask
from .device import to_device

# On a CPU, the most bytes of gathered K and V one decode attention call copies, into a buffer the cache keeps:
# few calls (each wakes torch's threads), and a copy that the cores' own caches still hold when attention reads it.
GATHER_BYTES = 4 * 2**20


@dataclass
class PagedMetadata:
    """What the paged cache reads in one forward pass, built once by `prepare`.

    The segments come decodes first, then prefill chunks, and their new tokens
    lie side by side in that order (the "flattened step"). A static decode step
    (cuda_graphs.py) has no segments: its shape and its tensors say all.
    """
    positions: torch.Tensor          # (1, N) every new token's position, like the flattened input ids
    slot_mapping: torch.Tensor       # (N,) the pool slot of every new token
    block_tables: torch.Tensor       # (segments, width) block ids, padded with the pad block
    num_decodes: int                 # the first num_decodes segments (and tokens) are decodes
    decode_tables: torch.Tensor | None = None  # (num_decodes, blocks) the decodes' tables, cut to what they read
    decode_len: int = 0              # keys each decode row reads (then masked to its own)
    mask: torch.Tensor | None = None  # (num_decodes, 1, 1, decode_len) where decode contexts differ
    segments: list[Segment] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # per segment: start + num_new, the keys its last query sees
    query_starts: list[int] = field(default_factory=list)  # per segment: where its tokens begin in the step; then N


def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Slots of the tokens at positions start .. start+num_tokens-1 of one sequence.

    A token's block is found through the block table, and its slot in the
    flattened pool is that block's first slot plus the token's offset inside it.
    """
    # >>> exercise paged-slot-mapping (lesson 07, 2 pts): map token positions to pool slots through the block table
    # hint: which entry of the block table holds position p, and how far into that block is p? A block's slots are numbered consecutively in the flattened pool
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + num_tokens)]
    # <<< exercise


def gather_kv(layer_pool: torch.Tensor, block_tables: torch.Tensor, context_len: int,
              out: torch.Tensor | None = None):
    """Keys and values of a ragged batch, read through the block tables.

    layer_pool: (num_blocks, block_size, 2, H, D) for one layer; block_tables:
    (b, max_blocks) block ids, padded with any valid id. Returns k and v as
    (b, H, context_len, D) views of one gathered buffer: `out`, shaped
    (b · max_blocks, block_size, 2, H, D), where the caller keeps one, else a
    fresh one. Slots past a sequence's own length hold padding that the caller
    masks out.
    """
    # >>> exercise paged-gather (lesson 07, 3 pts): gather a ragged batch's K and V through its block tables
    # hint: for row r and token p, which block of the pool and which slot inside it hold its K and V? Can one indexing of the pool by the block tables fetch every row's blocks at once (torch.index_select takes out=), and how do blocks and slots then become one token axis of which only the first context_len count? Each of K and V comes back as (rows, H, context_len, D)
    b, max_blocks = block_tables.shape
    _, block_size, _, H, D = layer_pool.shape
    blocks = torch.index_select(layer_pool, 0, block_tables.reshape(-1), out=out)  # one copy for K and V together
    tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
    return tokens.permute(2, 0, 3, 1, 4).unbind(0)  # K and V, each (b, H, L, D): views, no copy
    # <<< exercise


class PagedKVCache:
    """The pool of KV blocks whose tables `blocks` keeps, and attention through them.

    Once per step: `meta = cache.prepare(segments)`, then the model's forward
    over the flattened (1, N) batch calls `attend` per layer.
    """

    def __init__(self, config: GPT2Config, blocks: BlockManager,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 gather_bytes: int | None | str = "auto"):
        self.config, self.blocks, self.block_size = config, blocks, blocks.block_size
        H, D = config.n_head, config.head_dim
        # (layer, block, slot, K|V, head, head_dim): K and V of a slot side by side, one gather per layer. One
        # block more than the block manager hands out: the pad block, which padded table entries name and
        # where the padding rows of a static decode step write; nothing reads it unmasked.
        self.pool = torch.zeros(config.n_layer, blocks.num_blocks + 1, blocks.block_size, 2, H, D,
                                device=device, dtype=dtype)
        self.pad_block = blocks.num_blocks
        self.layers = [self.pool[i] for i in range(config.n_layer)]  # one (blocks, slot, K|V, H, D) view per layer
        # Each layer's slots seen as (K|V, 1, H, slot, D): the shape of torch.stack((k, v)) with the step's
        # tokens on the slot axis, so one index_copy_ stores a whole step's keys and values.
        self.slots = [layer.view(-1, 2, H, D).permute(1, 2, 0, 3).unsqueeze(1) for layer in self.layers]
        self.metadata: PagedMetadata | None = None
        self.bytes_per_key = 2 * config.n_embd * self.pool.element_size()  # K and V of one token, one layer
        # Decodes gather and attend in groups of at most this many bytes of K and V (None: all in one call);
        # "auto": GATHER_BYTES on a CPU, one call elsewhere.
        self.gather_bytes = (GATHER_BYTES if self.pool.device.type == "cpu" else None) \
            if gather_bytes == "auto" else gather_bytes

    @property
    def gather_bytes(self) -> int | None:
        return self._gather_bytes

    @gather_bytes.setter
    def gather_bytes(self, bound: int | None) -> None:
        """Set the bound, and size the scratch the groups gather into, every layer of every step: room for the
        bound's worth of whole blocks, or one row of the longest context if that is more. Sized here once, so
        a compiled step sees one shape. No scratch with no bound: one call, into a fresh buffer."""
        if bound is not None and (type(bound) is not int or bound < 1):
            raise ValueError(f"gather_bytes={bound!r} must be a number of bytes ≥ 1, None (every decode in "
                             "one gather) or 'auto' (GATHER_BYTES on a CPU, one gather elsewhere)")
        self._gather_bytes = bound
        self.scratch = None if bound is None else torch.empty(
            max(bound // (self.block_size * self.bytes_per_key), self.max_decode_width), *self.layers[0].shape[1:],
            device=self.pool.device, dtype=self.pool.dtype)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def width_unit(self) -> int:
        """A decode step reads whole blocks: its width is counted in blocks."""
        return self.block_size

    @property
    def max_decode_width(self) -> int:
        """The most blocks a sequence can hold: its table's width in a static step."""
        return self.blocks.blocks_for(self.config.n_ctx)

    def prepare(self, segments: list[Segment]) -> PagedMetadata:
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
        block_tables = to_device([t + [self.pad_block] * (width - len(t)) for t in tables], device)
        decode_lens = context_lens[:num_decodes]
        decode_len = max(decode_lens, default=0)
        mask = None
        if num_decodes and min(decode_lens) != decode_len:  # ragged decodes: hide each row's padding
            mask = causal_mask(to_device(decode_lens, device)[:, None] - 1, decode_len)  # (n, 1, 1, L)
        self.metadata = PagedMetadata(
            positions=to_device([positions], device), slot_mapping=to_device(slots, device),
            block_tables=block_tables, num_decodes=num_decodes, decode_len=decode_len, mask=mask,
            decode_tables=block_tables[:num_decodes, :self.blocks.blocks_for(decode_len)] if num_decodes else None,
            segments=list(segments), context_lens=context_lens, query_starts=query_starts)
        return self.metadata

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write (`parallel_sampling.py`): each (source, destination) block's K and V, every layer, in
        one gather and one scatter on the device: 2 · n_layer · block_size · n_embd · bytes per copy."""
        src, dst = (to_device(list(blocks), self.pool.device) for blocks in zip(*copies))
        self.pool.index_copy_(1, dst, self.pool.index_select(1, src))

    # ---- a static decode step (cuda_graphs.StaticInputs owns its buffers) -------------

    def decode_keys(self, width: int) -> int:
        """Key slots each row of a static decode step reads: its `width` blocks whole."""
        return width * self.block_size

    def decode_inputs_size(self, max_batch: int) -> int:
        """Integers of this cache's own a static decode step needs beside positions and context lengths:
        a slot per row, then the rows' tables, packed at each step's own width."""
        return max_batch + max_batch * self.max_decode_width

    def fill_decode_inputs(self, host, segments: list[Segment], batch: int, width: int) -> int:
        """Write the slot mapping and block tables of a static decode step into `host`; returns how many
        entries it filled. Padding rows write
        to the pad block, and padded table entries name it: nothing reads it unmasked."""
        bs, pad, T = self.block_size, self.pad_block, len(host) // (1 + self.max_decode_width)  # tables start at T
        for i, s in enumerate(segments):
            table = self.blocks.block_tables[s.seq_id]
            used = self.blocks.blocks_for(s.start + 1)
            host[T + i * width:T + i * width + used] = table[:used]
            host[T + i * width + used:T + (i + 1) * width] = pad
            host[i] = slot_mapping(table, s.start, 1, bs)[0]
        host[T + len(segments) * width:T + batch * width] = pad
        host[len(segments):batch] = pad * bs
        return T + batch * width

    def decode_metadata(self, positions: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor,
                        batch: int, width: int) -> PagedMetadata:
        """The metadata of one static decode shape, on views of the buffers `fill_decode_inputs` fills."""
        T = len(inputs) // (1 + self.max_decode_width)
        tables = inputs[T:T + batch * width].view(batch, width)
        return PagedMetadata(positions=positions.view(1, batch), slot_mapping=inputs[:batch], block_tables=tables,
                             num_decodes=batch, decode_tables=tables, decode_len=self.decode_keys(width), mask=mask)

    # ---- attention ----------------------------------------------------------------

    def decode_groups(self, num_decodes: int, keys_per_row: int) -> list[slice]:
        """A step's decode rows in the groups one gather takes each: as many rows as keep the group's K and V
        within `gather_bytes`, at least one (a row's context is copied whole, whatever its size); every row
        in one group with no bound. `keys_per_row`: the slots a row's gather copies, its table's whole blocks."""
        rows = num_decodes if self.gather_bytes is None else max(
            1, self.gather_bytes // (keys_per_row * self.bytes_per_key))
        return [slice(a, a + rows) for a in range(0, num_decodes, rows)]

    def gather_buffer(self, num_blocks: int) -> torch.Tensor | None:
        """Where a group of decodes gathers its `num_blocks` blocks: the first of the kept scratch's blocks
        when the decodes go in groups; None (a fresh buffer) when they go in one call."""
        return None if self.scratch is None else self.scratch[:num_blocks]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: (1, H, N, D) for the N tokens of the step, decodes first, then prefill chunks."""
        m, pool = self.metadata, self.layers[layer_idx]
        # Store every new token's K and V in its slot: one copy for the whole ragged batch.
        self.slots[layer_idx].index_copy_(3, m.slot_mapping, torch.stack((k, v)))  # (2, 1, H, N, D)
        outputs = []
        n = m.num_decodes
        if n:  # each decode query over its own gathered context, a group of rows per call
            q_dec = (q if n == q.shape[2] else q[:, :, :n]).transpose(0, 2)  # queries (n, H, 1, D)
            tables, groups = m.decode_tables, []
            for rows in self.decode_groups(n, tables.shape[1] * self.block_size):
                keys, values = gather_kv(pool, tables[rows], m.decode_len, self.gather_buffer(tables[rows].numel()))
                mask = None if m.mask is None else m.mask[rows]
                groups.append(causal_attention(q_dec[rows], keys, values, mask))
            out = groups[0] if len(groups) == 1 else torch.cat(groups)
            outputs.append(out.transpose(0, 2))                                  # (1, H, n, D)
        for i in range(n, len(m.segments)):  # one call per prefill chunk (a sequence, not a token)
            a, b, seg = m.query_starts[i], m.query_starts[i + 1], m.segments[i]
            if seg.start == 0:  # fresh prompt: its keys are exactly the new ones
                out = causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
            else:               # a later chunk also sees the earlier chunks, through the block table
                context = m.context_lens[i]
                keys, values = gather_kv(pool, m.block_tables[i:i + 1, :self.blocks.blocks_for(context)], context)
                out = causal_attention(q[:, :, a:b], keys, values)     # queries are the last b − a of the keys
            outputs.append(out)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
