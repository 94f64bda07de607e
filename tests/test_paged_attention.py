"""Paged attention on its own: slot mapping, gather, and a ragged step against the contiguous cache, on logits."""
import pytest
import torch

from minillm import PRESETS
from minillm.block_manager import BlockManager
from minillm.kv_cache import KVCache, Segment
import minillm.paged_attention as paged_attention
from minillm.paged_attention import GATHER_BYTES, PagedKVCache, gather_kv, slot_mapping
from models import context_model

CFG = PRESETS["tiny"]


class Holder:
    def __init__(self, seq_id, cached=0):
        self.seq_id, self.num_computed_tokens = seq_id, cached


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
    """Logits of each sequence's last step through the contiguous cache, one sequence at a time."""
    out = []
    for tokens, splits in prompts_and_steps:
        cache = KVCache(CFG, 1, len(tokens))
        start = 0
        for n in splits:
            meta = cache.prepare([Segment(0, start, n)])
            logits = model(torch.tensor([tokens[start:start + n]]), meta.positions, cache=cache)
            start += n
        out.append(logits[0, -1])
    return torch.stack(out)


def _fill(model, cache, blocks, seq_id, tokens):
    holder = Holder(seq_id)
    blocks.append_slots(holder, len(tokens))
    meta = cache.prepare([Segment(seq_id, 0, len(tokens))])
    model(torch.tensor([tokens]), meta.positions, cache=cache)
    holder.num_computed_tokens = len(tokens)
    return holder


@pytest.mark.parametrize("block_size", [1, 3, 16])
@torch.inference_mode()
def test_ragged_step_matches_the_contiguous_cache(block_size):
    """Two decodes of different context lengths, a mid-prompt chunk and a fresh prompt in ONE forward pass."""
    model = context_model()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (20, 7, 30, 9)]
    blocks = BlockManager(num_blocks=64, block_size=block_size)
    cache = PagedKVCache(CFG, blocks)
    holders = {sid: _fill(model, cache, blocks, sid, seqs[sid][:n]) for sid, n in {0: 19, 1: 6, 2: 11}.items()}
    holders[3] = Holder(3)
    # The step: seq 0 and 1 decode, seq 2 feeds a 10-token chunk (ending mid-block), seq 3 its whole prompt.
    segments = [Segment(0, 19, 1, True), Segment(1, 6, 1, True), Segment(2, 11, 10), Segment(3, 0, 9)]
    ids = seqs[0][19:20] + seqs[1][6:7] + seqs[2][11:21] + seqs[3]
    for s in segments:
        blocks.append_slots(holders[s.seq_id], s.num_new)
    meta = cache.prepare(segments)
    assert meta.num_decodes == 2 and meta.query_starts == [0, 1, 2, 12, 21] and meta.context_lens == [20, 7, 21, 9]
    last = torch.tensor([0, 1, 11, 20])
    paged = model(torch.tensor([ids]), meta.positions, cache=cache, logits_indices=last)
    expected = _contiguous_logits(model, [(seqs[0][:20], [19, 1]), (seqs[1][:7], [6, 1]),
                                          (seqs[2][:21], [11, 10]), (seqs[3], [9])])
    torch.testing.assert_close(paged, expected, atol=1e-4, rtol=1e-4)
    for s in segments:
        holders[s.seq_id].num_computed_tokens += s.num_new
    blocks.check_invariants(list(holders.values()))


@pytest.mark.parametrize("rows_per_gather", [1, 2, 5])
@torch.inference_mode()
def test_decodes_gathered_in_groups_give_the_contiguous_logits(rows_per_gather, monkeypatch):
    """Five ragged decodes and a chunk in one step, the decodes' K and V gathered a group of rows at a time
    (the last group short): every row's logits are the contiguous cache's, and no group of several rows
    copies more than the bound."""
    model = context_model()
    g = torch.Generator().manual_seed(1)
    lens = (20, 7, 33, 12, 26)
    seqs = [torch.randint(0, CFG.vocab_size, (n + 1,), generator=g).tolist() for n in lens + (9,)]
    blocks = BlockManager(num_blocks=64, block_size=4)
    slots = 36  # what each decode row's gather copies: the longest context, 34 keys, in whole blocks of 4
    key_bytes = 2 * CFG.n_embd * 4
    cache = PagedKVCache(CFG, blocks, gather_bytes=rows_per_gather * slots * key_bytes)
    holders = {sid: _fill(model, cache, blocks, sid, seqs[sid][:n]) for sid, n in enumerate(lens)}
    holders[5] = _fill(model, cache, blocks, 5, seqs[5][:4])
    segments = [Segment(i, n, 1, True) for i, n in enumerate(lens)] + [Segment(5, 4, 6)]
    for s in segments:
        blocks.append_slots(holders[s.seq_id], s.num_new)
    meta = cache.prepare(segments)
    assert meta.decode_tables.shape == (5, slots // 4)
    gathered, buffers = [], []
    monkeypatch.setattr(paged_attention, "gather_kv", lambda pool, tables, n, out=None: gathered.append(
        tables.numel()) or buffers.append(None if out is None else out.data_ptr()) or gather_kv(pool, tables, n, out))
    ids = [seqs[i][n] for i, n in enumerate(lens)] + seqs[5][4:10]
    paged = model(torch.tensor([ids]), meta.positions, cache=cache, logits_indices=torch.tensor([0, 1, 2, 3, 4, 10]))
    expected = _contiguous_logits(model, [(seqs[i][:n + 1], [n, 1]) for i, n in enumerate(lens)]
                                  + [(seqs[5][:10], [4, 6])])
    torch.testing.assert_close(paged, expected, atol=1e-4, rtol=1e-4)
    per_layer = [min(rows_per_gather, len(lens) - a) * slots // 4 for a in range(0, len(lens), rows_per_gather)]
    assert gathered == (per_layer + [10 // 4 + 1]) * CFG.n_layer, "the decodes' groups, then the chunk's blocks"
    assert all(n * 4 * key_bytes <= cache.gather_bytes for n in per_layer)
    # Every group, in every layer, copies into the one buffer the cache keeps; the chunk into a fresh one.
    assert buffers == ([cache.scratch.data_ptr()] * len(per_layer) + [None]) * CFG.n_layer
    assert cache.scratch.shape == (max(rows_per_gather * slots // 4, blocks.blocks_for(CFG.n_ctx)), 4, 2,
                                   CFG.n_head, CFG.head_dim)  # a group's blocks, or one row's longest context


def test_a_cpu_cache_bounds_its_gathers_and_other_devices_gather_at_once():
    blocks = BlockManager(num_blocks=8, block_size=4)
    cpu = PagedKVCache(CFG, blocks)
    assert cpu.gather_bytes == GATHER_BYTES and cpu.bytes_per_key == 2 * 64 * 4
    assert [(r.start, r.stop) for r in cpu.decode_groups(200, 100)] == [(0, 81), (81, 162), (162, 243)]  # 4 MiB
    assert cpu.decode_groups(3, 100) == [slice(0, 81)]
    gpt2 = PagedKVCache(PRESETS["gpt2"], BlockManager(num_blocks=1, block_size=16))  # 6 KiB of K and V a key
    assert [(r.start, r.stop) for r in gpt2.decode_groups(32, 160)] == [(a, a + 4) for a in range(0, 32, 4)], \
        "32 rows of 160 keys: groups of 4 rows (3.75 MiB), a copy the cores' own caches keep, not 2 of 15 MiB"
    assert len(cpu.decode_groups(7, GATHER_BYTES)) == 7  # a row past the bound goes alone, copied whole
    assert PagedKVCache(CFG, blocks, dtype=torch.bfloat16).bytes_per_key == 2 * 64 * 2
    assert PagedKVCache(CFG, blocks, device="meta").gather_bytes is None  # a GPU's allocator keeps its blocks
    assert PagedKVCache(CFG, blocks, gather_bytes=None).decode_groups(10_000, 100) == [slice(0, 10_000)]
    # The groups gather into one scratch the cache keeps, sized with the bound; with none, into a fresh buffer.
    assert cpu.scratch.shape == (GATHER_BYTES // (4 * 512), 4, 2, CFG.n_head, CFG.head_dim)
    assert cpu.gather_buffer(3).data_ptr() == cpu.scratch.data_ptr() and cpu.gather_buffer(3).shape[0] == 3
    cpu.gather_bytes = None
    assert cpu.scratch is None and cpu.gather_buffer(3) is None
    cpu.gather_bytes = 1  # one row a group: room for the longest context's blocks
    assert cpu.scratch.shape[0] == cpu.max_decode_width
    with pytest.raises(ValueError, match="gather_bytes=0 must be"):
        cpu.gather_bytes = 0


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4MiB"])
def test_a_gather_bound_must_be_a_positive_number_of_bytes(bad):
    with pytest.raises(ValueError, match=f"gather_bytes={bad!r} must be a number of bytes ≥ 1"):
        PagedKVCache(CFG, BlockManager(num_blocks=8, block_size=4), gather_bytes=bad)


@torch.inference_mode()
def test_a_step_must_list_its_decodes_first():
    blocks = BlockManager(num_blocks=8, block_size=4)
    cache = PagedKVCache(CFG, blocks)
    blocks.append_slots(Holder(0), 3)
    blocks.append_slots(Holder(1), 2)
    with pytest.raises(ValueError, match="decodes first"):
        cache.prepare([Segment(0, 0, 2), Segment(1, 1, 1, True)])


@pytest.mark.parametrize("rows_per_gather", [1, 2])
@torch.inference_mode()
def test_on_one_thread_the_groups_change_no_bit(rows_per_gather):
    """Grouping is speed only: on one thread five ragged decodes give the same bits gathered a group of rows at
    a time as in one copy (on several, torch's kernel may round a row's heads differently on another thread)."""
    model = context_model()
    g = torch.Generator().manual_seed(2)
    lens = (20, 7, 33, 12, 26)
    seqs = [torch.randint(0, CFG.vocab_size, (n + 1,), generator=g).tolist() for n in lens]
    blocks = BlockManager(num_blocks=64, block_size=4)
    cache = PagedKVCache(CFG, blocks, gather_bytes=None)
    holders = [_fill(model, cache, blocks, sid, seqs[sid][:n]) for sid, n in enumerate(lens)]
    segments = [Segment(i, n, 1, True) for i, n in enumerate(lens)]
    for h in holders:
        blocks.append_slots(h, 1)
    ids, threads = torch.tensor([[seqs[i][n] for i, n in enumerate(lens)]]), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = []
        for bound in (None, rows_per_gather * 36 * 2 * CFG.n_embd * 4):  # 36: the longest context in blocks of 4
            cache.gather_bytes = bound
            meta = cache.prepare(segments)  # the same slots each time: the step rewrites its own K and V
            logits.append(model(ids, meta.positions, cache=cache))
    finally:
        torch.set_num_threads(threads)
    assert len(cache.decode_groups(5, 36)) == -(-5 // rows_per_gather)
    assert torch.equal(logits[0], logits[1])
