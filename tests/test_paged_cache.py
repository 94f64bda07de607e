"""The paged cache on its own: allocator, slot mapping, gather, ragged attention, fork and copy-on-write."""
import pytest
import torch

from minillm import GPT2, PRESETS
from minillm.kv_cache import KVCache
from minillm.paged_cache import BlockAllocator, PagedKVCache, gather_kv, slot_mapping

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    return GPT2(CFG, seed=0).eval()


def test_allocator_recycles_blocks_by_reference_count():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    assert alloc.num_free == 1 and alloc.ref_counts[a] == alloc.ref_counts[b] == 1
    alloc.share(a)
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


def test_slot_mapping_follows_the_block_table_across_boundaries():
    # Positions 2..5 with block_size 4 live in blocks 7 (slots 30, 31) and 2 (slots 8, 9).
    assert slot_mapping([7, 2, 9], start=2, num_tokens=4, block_size=4) == [30, 31, 8, 9]


def test_gather_reads_each_sequence_through_its_own_table():
    pool = torch.randn(6, 4, 2, 3, 5)  # (blocks, block_size, K|V, H, D)
    tables = torch.tensor([[4, 1], [0, 0]])
    k, v = gather_kv(pool, tables, context_len=6)
    assert k.shape == v.shape == (2, 3, 6, 5)
    torch.testing.assert_close(k[0, :, 4], pool[1, 0, 0])  # token 4 of seq 0 = block 1, slot 0
    torch.testing.assert_close(v[0, :, 2], pool[4, 2, 1])
    torch.testing.assert_close(k[1, :, 3], pool[0, 3, 0])


def _contiguous_logits(model, prompts_and_steps):
    """Logits of each sequence's step through the contiguous cache, one sequence at a time."""
    out = []
    for tokens, splits in prompts_and_steps:
        cache = KVCache(CFG, 1, len(tokens))
        start = 0
        for n in splits:
            pos = cache.prepare([0], n)
            logits = model(torch.tensor([tokens[start:start + n]]), pos, cache=cache)
            start += n
        out.append(logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@torch.inference_mode()
def test_ragged_step_matches_the_contiguous_cache(model, block_size):
    """Two decodes of different context lengths, a mid-prompt chunk and a fresh prompt in ONE forward pass."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (20, 7, 30, 9)]
    cache = PagedKVCache(CFG, num_blocks=64, block_size=block_size)
    history = {0: 19, 1: 6, 2: 11}  # tokens already cached; seq 3 is new
    for sid, n in history.items():
        cache.append_slots(sid, n)
        cache.prepare([(sid, n)])
        model(torch.tensor([seqs[sid][:n]]), torch.arange(n)[None], cache=cache)
    # The step: seq 0 and 1 decode, seq 2 feeds a 10-token chunk (ending mid-block), seq 3 its whole prompt.
    segments = [(0, 1), (1, 1), (2, 10), (3, 9)]
    ids = seqs[0][19:20] + seqs[1][6:7] + seqs[2][11:21] + seqs[3]
    for sid, n in segments:
        cache.append_slots(sid, n)
    positions = cache.prepare(segments)
    last = torch.tensor([0, 1, 11, 20])
    paged = model(torch.tensor([ids]), positions, cache=cache, logits_indices=last)
    expected = _contiguous_logits(model, [(seqs[0][:20], [19, 1]), (seqs[1][:7], [6, 1]),
                                          (seqs[2][:21], [11, 10]), (seqs[3], [9])])
    torch.testing.assert_close(paged, expected, atol=1e-4, rtol=1e-4)
    cache.check_invariants()


@torch.inference_mode()
def test_fork_shares_blocks_and_copies_on_write(model):
    cache = PagedKVCache(CFG, num_blocks=8, block_size=4)
    prompt = list(range(10, 16))  # 6 tokens: one full block and half of another
    cache.append_slots(0, 6)
    cache.prepare([(0, 6)])
    model(torch.tensor([prompt]), torch.arange(6)[None], cache=cache)
    cache.fork(0, 1)
    assert cache.block_tables[1] == cache.block_tables[0]
    assert cache.num_free_blocks == 6, "a fork copies no KV: both tables point at the same two blocks"
    parent_last = cache.block_tables[0][-1]
    before = cache.pool[:, parent_last].clone()
    cache.append_slots(1, 1)  # the child writes into the shared, half-full block: it must be copied first
    assert cache.block_tables[1][0] == cache.block_tables[0][0], "full blocks stay shared"
    assert cache.block_tables[1][-1] != parent_last
    cache.prepare([(1, 1)])
    child = model(torch.tensor([[99]]), torch.tensor([[6]]), cache=cache)
    torch.testing.assert_close(cache.pool[:, parent_last], before)  # the parent's KV is untouched
    reference = model(torch.tensor([prompt + [99]]))  # no cache: the whole sequence at once
    torch.testing.assert_close(child[0, -1], reference[0, -1], atol=1e-4, rtol=1e-4)
    cache.check_invariants()
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == 8


def test_append_slots_refuses_what_does_not_fit():
    cache = PagedKVCache(CFG, num_blocks=2, block_size=4)
    assert cache.can_append(0, 8) and not cache.can_append(0, 9)
    with pytest.raises(RuntimeError, match="needs 3 blocks but 2 are free"):
        cache.append_slots(0, 9)
    assert cache.num_free_blocks == 2, "a refused request must not keep any block"
