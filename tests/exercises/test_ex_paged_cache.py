"""Lesson 05 exercises in minillm/paged_cache.py: the block allocator, the slot mapping, the ragged gather.

The allocator tests set the free list and reference counts by hand, so
`allocate` and `free` are each tested alone. The oracles walk blocks one slot
at a time.
"""
from collections import deque

import pytest
import torch

from exercise_checks import assert_close, expect_error
from minillm.paged_cache import BlockAllocator, gather_kv, slot_mapping

ALLOCATE = "minillm/paged_cache.py, BlockAllocator.allocate"
FREE = "minillm/paged_cache.py, BlockAllocator.free"
SLOTS = "minillm/paged_cache.py, slot_mapping"
GATHER = "minillm/paged_cache.py, gather_kv"


def allocator(free: list[int], ref_counts: list[int]) -> BlockAllocator:
    """An allocator in a given state, set by hand."""
    alloc = BlockAllocator(len(ref_counts))
    alloc.free_blocks = deque(free)
    alloc.ref_counts = list(ref_counts)
    return alloc


# ------------------------------------------------------------------ allocate

@pytest.mark.exercise("paged-allocate")
def test_allocate_hands_out_every_block_once_with_one_reference():
    alloc = BlockAllocator(4)
    taken = []
    for i in range(4):
        block = alloc.allocate()
        assert isinstance(block, int) and 0 <= block < 4 and block not in taken, (
            f"allocate() call {i + 1} returned {block!r}; expected a free block id in 0..3 not handed out yet "
            f"(already taken: {taken}). Look at {ALLOCATE}.")
        taken.append(block)
        assert alloc.ref_counts[block] == 1, (f"after allocate() returned block {block}, its ref count is "
                                              f"{alloc.ref_counts[block]}, expected 1. Look at {ALLOCATE}.")
        assert block not in alloc.free_blocks and alloc.num_free == 3 - i, (
            f"after allocating block {block} the free list is {list(alloc.free_blocks)}; it must no longer hold "
            f"that block ({3 - i} blocks left). Look at {ALLOCATE}.")


@pytest.mark.exercise("paged-allocate")
def test_allocate_reuses_a_recycled_block():
    alloc = allocator(free=[2], ref_counts=[1, 3, 0])
    block = alloc.allocate()
    assert block == 2 and alloc.ref_counts == [1, 3, 1] and not alloc.free_blocks, (
        f"with only block 2 free (ref counts [1, 3, 0]), allocate() should return 2 and leave ref counts "
        f"[1, 3, 1] and an empty free list; got {block!r}, {alloc.ref_counts}, {list(alloc.free_blocks)}. "
        f"Look at {ALLOCATE}.")


@pytest.mark.exercise("paged-allocate")
def test_allocate_from_an_empty_pool_raises_naming_the_pool_size():
    alloc = allocator(free=[], ref_counts=[1, 2, 1])
    with expect_error(RuntimeError, "allocate() with no free block left", ALLOCATE) as err:
        alloc.allocate()
    assert "3" in str(err.value), (f"the error for an empty pool should name the pool size (3 blocks) so the "
                                   f"reader can act; it says {str(err.value)!r}. Look at {ALLOCATE}.")
    assert alloc.ref_counts == [1, 2, 1], f"a failed allocate() changed the ref counts to {alloc.ref_counts}"


# ------------------------------------------------------------------ free

@pytest.mark.exercise("paged-free")
def test_free_of_a_shared_block_only_drops_a_reference():
    alloc = allocator(free=[0], ref_counts=[0, 2, 1])
    alloc.free(1)
    assert alloc.ref_counts == [0, 1, 1] and list(alloc.free_blocks) == [0], (
        f"free(1) on block 1 held twice should leave ref counts [0, 1, 1] and the free list [0] (block 1 is still "
        f"in use); got {alloc.ref_counts} and {list(alloc.free_blocks)}. Look at {FREE}.")


@pytest.mark.exercise("paged-free")
def test_free_of_the_last_reference_recycles_the_block_once():
    alloc = allocator(free=[0], ref_counts=[0, 2, 1])
    alloc.free(2)
    assert alloc.ref_counts == [0, 2, 0] and sorted(alloc.free_blocks) == [0, 2], (
        f"free(2) on block 2 held once should leave ref counts [0, 2, 0] and blocks 0 and 2 free; "
        f"got {alloc.ref_counts} and free list {list(alloc.free_blocks)}. Look at {FREE}.")
    alloc.free(1)
    alloc.free(1)
    assert alloc.ref_counts == [0, 0, 0] and sorted(alloc.free_blocks) == [0, 1, 2], (
        f"freeing block 1 twice (it had 2 references) should return it to the free list exactly once; "
        f"got ref counts {alloc.ref_counts} and free list {list(alloc.free_blocks)}. Look at {FREE}.")


@pytest.mark.exercise("paged-free")
def test_double_free_raises_and_changes_nothing():
    alloc = allocator(free=[0, 2], ref_counts=[0, 1, 0])
    with expect_error(RuntimeError, "free(2) on block 2, which is already free (a double free)", FREE):
        alloc.free(2)
    assert alloc.ref_counts == [0, 1, 0] and list(alloc.free_blocks) == [0, 2], (
        f"a double free must raise before changing anything; ref counts are now {alloc.ref_counts}, "
        f"free list {list(alloc.free_blocks)}. Look at {FREE}.")


# ------------------------------------------------------------------ slot mapping

SLOT_CASES = {
    # name: (block table, start, num_tokens, block_size)
    "prompt in the first block": ([7, 2], 0, 3, 4),
    "prompt across blocks": ([7, 2, 5], 0, 10, 4),
    "chunk starting mid-block": ([7, 2, 5], 3, 6, 4),
    "one decode token at a block edge": ([7, 2, 5], 8, 1, 4),
    "block_size 1": ([3, 0, 2], 1, 2, 1),
}


@pytest.mark.exercise("paged-slot-mapping")
@pytest.mark.parametrize("case", list(SLOT_CASES))
def test_slot_mapping_follows_the_block_table(case):
    table, start, n, bs = SLOT_CASES[case]
    # Oracle: list every slot the sequence owns, block after block, and take the wanted positions.
    owned = [block * bs + offset for block in table for offset in range(bs)]
    want = owned[start:start + n]
    got = slot_mapping(list(table), start, n, bs)
    assert list(got) == want, (
        f"slot_mapping(block_table={table}, start={start}, num_tokens={n}, block_size={bs}) should be {want} "
        f"(position p lives in block table[p // {bs}] at offset p % {bs}); got {got!r}. Look at {SLOTS}.")


# ------------------------------------------------------------------ gather

def gather_by_hand(pool, tables, context_len):
    """Oracle: token p of row r is in block tables[r][p // block_size], slot p % block_size; K at 0, V at 1."""
    b, bs, H, D = len(tables), pool.shape[1], pool.shape[3], pool.shape[4]
    k, v = torch.zeros(b, H, context_len, D), torch.zeros(b, H, context_len, D)
    for r, table in enumerate(tables):
        for p in range(context_len):
            k[r, :, p] = pool[table[p // bs], p % bs, 0]
            v[r, :, p] = pool[table[p // bs], p % bs, 1]
    return k, v


GATHER_CASES = {
    # name: (block tables, padded with a valid id, context_len)
    "ragged batch ending mid-block": ([[4, 1, 5], [2, 0, 2]], 10),
    "one row, one token": ([[3]], 1),
    "whole blocks, shared block": ([[0, 3], [5, 3], [1, 1]], 8),
}


@pytest.mark.exercise("paged-gather")
@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gather_reads_each_rows_tokens_through_its_table(case):
    tables, context_len = GATHER_CASES[case]
    num_blocks, block_size, H, D = 6, 4, 2, 3
    pool = torch.randn(num_blocks, block_size, 2, H, D, generator=torch.Generator().manual_seed(0))
    got = gather_kv(pool, torch.tensor(tables), context_len)
    assert isinstance(got, tuple) and len(got) == 2, f"gather_kv should return (k, v); got {type(got).__name__}. Look at {GATHER}."
    want_k, want_v = gather_by_hand(pool, tables, context_len)
    axes = ("row", "head", "token", "dim")
    where = f"{GATHER} (block_size {block_size}, tables {tables}, context_len {context_len})"
    assert_close(got[0], want_k, "k from gather_kv, (b, H, context_len, D)", where, axes, atol=0, rtol=0)
    assert_close(got[1], want_v, "v from gather_kv, (b, H, context_len, D)", where, axes, atol=0, rtol=0)
