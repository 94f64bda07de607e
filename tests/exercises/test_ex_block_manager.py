"""Lesson 05 exercises in minillm/block_manager.py: the block allocator.

The allocator tests set the free list and reference counts by hand, so
`allocate` and `free` are each tested alone.
"""
from collections import deque

import pytest

from exercise_checks import expect_error
from minillm.block_manager import BlockAllocator

ALLOCATE = "minillm/block_manager.py, BlockAllocator.allocate"
FREE = "minillm/block_manager.py, BlockAllocator.free"


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
