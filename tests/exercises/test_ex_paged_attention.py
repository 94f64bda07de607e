"""Lesson 05 exercises in minillm/paged_attention.py: the slot mapping and the ragged gather.

The oracles walk blocks one slot at a time.
"""
import pytest
import torch

from exercise_checks import assert_close
from minillm.paged_attention import gather_kv, slot_mapping

SLOTS = "minillm/paged_attention.py, slot_mapping"
GATHER = "minillm/paged_attention.py, gather_kv"


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
