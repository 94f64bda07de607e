"""The block manager on its own: the allocator's reference counts, block tables that grow with a sequence."""
from types import SimpleNamespace

import pytest

from minillm.block_manager import BlockAllocator, BlockManager


def seq(seq_id: int, cached: int = 0):
    """Anything with a seq_id and a count of cached tokens will do: the block manager keeps no lengths."""
    return SimpleNamespace(seq_id=seq_id, num_computed_tokens=cached)


def test_allocator_recycles_blocks_by_reference_count():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    assert alloc.num_free == 1 and alloc.ref_counts[a] == alloc.ref_counts[b] == 1
    alloc.ref_counts[a] += 1  # a second owner, as a shared prefix would be
    alloc.free(a)
    assert alloc.num_free == 1, "a shared block must stay allocated while one reference is left"
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 3
    alloc.check_invariants({})


def test_allocator_errors_are_clear():
    alloc = BlockAllocator(1)
    block = alloc.allocate()
    with pytest.raises(RuntimeError, match="out of KV blocks: all 1"):
        alloc.allocate()
    alloc.free(block)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(block)
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(0)


def test_invariant_check_catches_a_lost_block():
    alloc = BlockAllocator(2)
    alloc.allocate()
    with pytest.raises(AssertionError, match="block 0"):
        alloc.check_invariants({})  # allocated, but no table holds it: leaked


def test_a_table_grows_one_block_at_a_time_as_tokens_arrive():
    blocks = BlockManager(num_blocks=8, block_size=4)
    s = seq(7)
    assert blocks.blocks_needed(s, 5) == 2
    blocks.append_slots(s, 5)                       # tokens 0..4: blocks for slots 0..7
    assert len(blocks.block_tables[7]) == 2
    s.num_computed_tokens = 5
    assert blocks.blocks_needed(s, 3) == 0          # tokens 5..7 fit the second block
    blocks.append_slots(s, 3)
    s.num_computed_tokens = 8
    assert blocks.blocks_needed(s, 1) == 1          # token 8 starts a third block
    blocks.append_slots(s, 1)
    s.num_computed_tokens = 9
    assert len(blocks.block_tables[7]) == 3 and blocks.num_free_blocks == 5
    blocks.check_invariants([s])
    blocks.free(s)
    assert blocks.num_free_blocks == 8 and 7 not in blocks.block_tables
    blocks.check_invariants([])


def test_append_slots_refuses_what_does_not_fit():
    blocks = BlockManager(num_blocks=2, block_size=4)
    assert blocks.can_append(seq(0), 8) and not blocks.can_append(seq(0), 9)
    with pytest.raises(RuntimeError, match="needs 3 blocks but 2 are free"):
        blocks.append_slots(seq(0), 9)
    assert blocks.num_free_blocks == 2, "a refused request must not keep any block"


def test_invariants_see_a_table_too_short_or_without_an_owner():
    blocks = BlockManager(num_blocks=4, block_size=4)
    s = seq(1)
    blocks.append_slots(s, 4)
    s.num_computed_tokens = 5                        # claims a token its one block cannot hold
    with pytest.raises(AssertionError, match="5 tokens cached in 1 blocks"):
        blocks.check_invariants([s])
    with pytest.raises(AssertionError, match="hold blocks but are not running"):
        blocks.check_invariants([])


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size=0"):
        BlockManager(4, block_size=0)
