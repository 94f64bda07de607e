"""The allocator of prefix caching: freed blocks stay cached until their memory is needed.

Every block is in exactly one state: free (no hash), referenced (held by a
block table, as often as the tables hold it) or evictable (no reference, its
contents and hash kept, least recently used first). Allocation takes a free
block first and evicts only when none is left; an evicted block loses its hash
at once, because its slots are about to hold other tokens. Why the order of
eviction decides the hit rate, and who gives a block its hash, is in
`prefix_caching.py`.
"""
from __future__ import annotations

from collections import OrderedDict

from .block_manager import BlockAllocator


class CachingAllocator(BlockAllocator):
    """A block allocator whose freed blocks stay cached until their memory is needed.

    Every block is in exactly one state: free (on `free_blocks`, no hash), referenced (ref count ≥ 1) or
    evictable (ref count 0, its hash kept, on `evictable` in least-recently-used order).
    """

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.cached: dict[bytes, int] = {}       # hash → the block holding those tokens
        self.block_hash: dict[int, bytes] = {}   # the inverse: a block's hash, while it has one
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take: the free ones and the evictable ones."""
        return len(self.free_blocks) + len(self.evictable)

    def allocate(self) -> int:
        """A truly free block if there is one; otherwise the least recently used cached block, its hash gone."""
        if not self.free_blocks and self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash.pop(block)]
            self.free_blocks.append(block)
        return super().allocate()

    def free(self, block: int) -> None:
        """Drop one reference; a cached block whose last reference goes becomes evictable, the newest."""
        if self.ref_counts[block] == 1 and block in self.block_hash:
            self.ref_counts[block] = 0
            self.evictable[block] = None
        else:
            super().free(block)

    def share(self, block: int) -> None:
        """A cache hit: one more reference to a cached block, which stops being evictable."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Make a referenced, full block findable by its hash, unless another block already holds that hash;
        returns whether it did."""
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        return True

    def uncache(self, block: int) -> None:
        """Forget a block's hash, if it has one: its contents are not to be trusted. Evictable, it is free now."""
        block_hash = self.block_hash.pop(block, None)
        if block_hash is not None:
            del self.cached[block_hash]
            if block in self.evictable:
                del self.evictable[block]
                self.free_blocks.append(block)

    def block_states(self, block: int, free: set[int]) -> dict[str, bool]:
        """The base states and `evictable`; a free block has no hash, an evictable one has one."""
        states = {**super().block_states(block, free), "evictable": block in self.evictable}
        if not states["referenced"]:
            assert (block in self.block_hash) == states["evictable"], \
                f"block {block} is {'evictable' if states['evictable'] else 'free'} " \
                f"{'with' if block in self.block_hash else 'without'} a hash"
        return states

    def check_invariants(self, block_tables: dict[int, list[int]]) -> None:
        """The base checks, with the evictable state; and hashes and blocks match."""
        super().check_invariants(block_tables)
        assert len(self.cached) == len(self.block_hash) and \
            all(self.cached.get(h) == b for b, h in self.block_hash.items()), "hashes and blocks do not match"
