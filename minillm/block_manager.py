"""The block manager: KV memory in fixed-size blocks, handed out as sequences grow.

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

The idea (PagedAttention's bookkeeping half)
--------------------------------------------
Cut KV memory into a pool of equal *blocks* of `block_size` token slots. A
sequence owns a list of block ids, its *block table*, and grows one block at a
time, exactly like a process's pages of virtual memory:

    block table of seq 7:  [12, 3, 40]      block_size = 16
    token at position p    lives in block table[p // 16], offset p % 16

Any free block serves any sequence, so there is no external fragmentation, and
only a sequence's last block is partly empty:

    blocks for n tokens  = ⌈n / block_size⌉
    waste per sequence   < block_size slots (block_size / 2 on average)

Blocks are reference-counted, so that a block can be shared: by the samples of
one prompt (`fork`, `parallel_sampling.py`) and by sequences with a common
prefix (`prefix_caching.py`, lesson 13); it returns to the free list when its
last reference goes. A sequence about to write into a block that another table
also holds first gets a copy of its own (copy-on-write): `append_slots` swaps
the block for a fresh one and queues (source, copy) in `copies`, which the
engine copies in the pool before the step's forward pass writes.

This file is pure bookkeeping: integers in, integers out, no tensors. The
scheduler asks it for room (`can_append`, `append_slots`, `free`); where the
keys and values physically live, and how attention reads them through the
block tables, is `paged_attention.py`.

Why block_size = 16
-------------------
Smaller blocks waste less but mean longer block tables, more scattered reads
and more bookkeeping per token. Larger blocks read more efficiently and waste
more. 16 tokens is vLLM's default and sits where the waste is already a few
percent. Lesson 07 sweeps it.

Invariants held by the tests: after every step each block is either free or
referenced exactly as often as the block tables hold it, none lost and none
counted twice; every sequence's table covers its cached tokens; no step writes
a block that another table holds; when every sequence has finished or been
aborted, every block is free.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

DEFAULT_BLOCK_SIZE = 16


class HoldsKV(Protocol):
    """What the block manager needs to know of a sequence: its key, and how many of its tokens are cached."""
    seq_id: int
    num_computed_tokens: int


class BlockAllocator:
    """Hands out block ids from a free list and counts references to each block.

    The free list is a queue, first freed first reused, as vLLM's is (there it also orders eviction): a
    block is taken from its head and recycled to its tail, so the ids a run hands out follow from the
    order of its calls alone, and a test can name them.
    """

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
        """Take the block at the head of the free list, the one freed longest ago; its reference count becomes 1."""
        # >>> exercise paged-allocate (lesson 07, 2 pts): take a block from the free list with one reference
        # hint: an empty free list is an error the scheduler should have prevented: raise a RuntimeError that names the pool size; otherwise, which end of the queue holds the block that has waited longest, and how many owners does it start with?
        if not self.free_blocks:
            raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use; "
                               "the scheduler must preempt a sequence before allocating")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block
        # <<< exercise

    def free(self, block: int) -> None:
        """Drop one reference; when none are left, the block joins the tail of the free list."""
        # >>> exercise paged-free (lesson 07, 2 pts): drop a reference and recycle the block at zero
        # hint: a block with no references left cannot be freed again (a double free: raise RuntimeError before changing anything); a block still referenced elsewhere stays out of the free list; at which end does a recycled block wait its turn?
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"double free: block {block} has no references left")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
        # <<< exercise

    def check_invariants(self, block_tables: dict[int, list[int]]) -> None:
        """Every block is referenced exactly as often as the tables say, and in exactly one state of
        `block_states`: here free or referenced (a subclass adds its own states and checks)."""
        expected = [0] * self.num_blocks
        for table in block_tables.values():
            for block in table:
                expected[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == expected[block], \
                f"block {block}: ref count {self.ref_counts[block]} but {expected[block]} tables hold it"
            states = [name for name, holds in self.block_states(block, free).items() if holds]
            assert len(states) == 1, f"block {block} is {' and '.join(states) or 'nowhere'}"

    def block_states(self, block: int, free: set[int]) -> dict[str, bool]:
        """Which states `block` is in, by name; `free` is the free list as a set."""
        return {"free": block in free, "referenced": self.ref_counts[block] > 0}


class BlockManager:
    """Block tables for every sequence that holds KV, over one `BlockAllocator`.

    A sequence's length is not stored here: it is the sequence's own
    `num_computed_tokens` (one source of truth), read when room is asked for.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be ≥ 1 token")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.copies: list[tuple[int, int]] = []  # (shared block, its copy) for the engine to copy, in order
        self.num_copies = 0  # copy-on-write copies made so far

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def match_prefix(self, seq: HoldsKV) -> int:
        """Leading tokens of a sequence about to be admitted whose KV the pool already holds. None here:
        without prefix caching (`prefix_caching.py`) every admitted sequence starts from its first token."""
        return 0

    def blocks_for(self, num_tokens: int) -> int:
        """⌈num_tokens / block_size⌉: the blocks that hold that many tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: HoldsKV, num_new: int) -> int:
        """New blocks `append_slots(seq, num_new)` would take: a copy of a shared block it writes, and more."""
        have = len(self.block_tables.get(seq.seq_id, ()))
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new) - have) + (self._shared_tail(seq) is not None)

    def _shared_tail(self, seq: HoldsKV) -> int | None:
        """The index in `seq`'s table of the partly filled block its next token goes into, if another table holds
        it too; else None. Only that block can be written while shared: a full block never changes again."""
        table, i = self.block_tables.get(seq.seq_id, ()), seq.num_computed_tokens // self.block_size
        return i if i < len(table) and self.allocator.ref_counts[table[i]] > 1 else None

    def fork(self, parent: HoldsKV, child: HoldsKV) -> None:
        """`child` starts from `parent`'s computed tokens: it holds the very same blocks, one more reference to
        each, and no KV is copied until one of them writes into a block they share (`append_slots`)."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.allocator.ref_counts[block] += 1
        self.block_tables[child.seq_id] = list(table)

    def can_append(self, seq: HoldsKV, num_new: int) -> bool:
        return self.blocks_needed(seq, num_new) <= self.num_free_blocks

    def append_slots(self, seq: HoldsKV, num_new: int) -> None:
        """Make room for `num_new` more tokens of `seq` after its cached ones: add blocks to its table."""
        needed = self.blocks_needed(seq, num_new)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.seq_id} needs {needed} blocks but {self.num_free_blocks} are free; "
                               "check can_append first")
        shared, table = self._shared_tail(seq), self.block_tables.setdefault(seq.seq_id, [])
        if shared is not None:  # copy-on-write: the new tokens go into a copy of the block, the others keep it
            copy = self.allocator.allocate()
            self.copies.append((table[shared], copy))
            self.allocator.free(table[shared])
            table[shared] = copy
            self.num_copies += 1
        table.extend(self.allocator.allocate() for _ in range(needed - (shared is not None)))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) blocks whose KV must be copied before the planned step writes."""
        copies, self.copies = self.copies, []
        return copies

    def free(self, seq: HoldsKV) -> None:
        """Return a finished, aborted or preempted sequence's blocks to the pool."""
        for block in self.block_tables.pop(seq.seq_id, ()):
            self.allocator.free(block)

    def commit(self) -> None:
        """The step planned since the last commit wrote its keys and values. Nothing to settle here; with
        prefix caching the blocks it filled become shareable (`prefix_caching.py`)."""

    def rollback(self, seqs: list[HoldsKV]) -> list[HoldsKV]:
        """The step planned since the last commit failed; returns those of `seqs` that can no longer trust the
        KV of their computed tokens: those holding a copy not yet made. A failed step wrote only slots past them."""
        uncopied = {dst for _, dst in self.take_copies()}
        return [seq for seq in seqs if not uncopied.isdisjoint(self.block_tables.get(seq.seq_id, ()))]

    def forget_admission(self, seq: HoldsKV) -> bool:
        """A sequence first admitted by a failed step goes back to wait; nothing was counted for it here."""
        return False

    def check_invariants(self, seqs: list[HoldsKV] | None = None) -> None:
        """The allocator agrees with the tables; given the sequences that hold KV, each table covers its tokens
        and no table belongs to anyone else."""
        self.allocator.check_invariants(self.block_tables)
        if seqs is None:
            return
        holders = {s.seq_id: s for s in seqs}
        strays = set(self.block_tables) - set(holders)
        assert not strays, f"sequences {sorted(strays)} hold blocks but are not running"
        for seq_id, seq in holders.items():
            have = len(self.block_tables.get(seq_id, ()))
            assert have >= self.blocks_for(seq.num_computed_tokens), \
                f"sequence {seq_id} has {seq.num_computed_tokens} tokens cached in {have} blocks of {self.block_size}"
