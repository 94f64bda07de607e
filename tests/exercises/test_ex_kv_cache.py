"""Lesson 02 exercises in minillm/kv_cache.py: writing a step's keys and values, and reading them back.

`KVCache.prepare` (given) turns a step's segments into its metadata; these
tests call it, then test `write` and `read` separately. The read tests fill the
cache by hand, so they pass or fail on `read` alone.
"""
import pytest
import torch

from exercise_checks import assert_close, attend_one_query, attention_oracle
from minillm.config import PRESETS
from minillm.kv_cache import KVCache, Segment

WRITE = "minillm/kv_cache.py, KVCache.write"
READ = "minillm/kv_cache.py, KVCache.read"
CFG = PRESETS["tiny"]   # 2 layers, 4 heads, head_dim 16
CACHE_AXES = ("layer", "row", "head", "slot", "dim")


def prepared(lengths: list[int], rows: list[int], T: int, max_seq_len: int = 8) -> KVCache:
    """A cache for len(lengths) sequences, prepared for a step in which `rows`, holding lengths[row] tokens
    each, get T new tokens."""
    cache = KVCache(CFG, batch_size=len(lengths), max_seq_len=max_seq_len)
    cache.prepare([Segment(row, lengths[row], T) for row in rows])
    return cache


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ write

WRITE_CASES = {
    # name: (lengths before the step, rows in the step, new tokens per row)
    "prefill of every row": ([0, 0, 0], [0, 1, 2], 3),
    "prefill of rows 0 and 2 only": ([0, 0, 0], [0, 2], 4),
    "decode with equal lengths": ([3, 3, 3], [0, 1, 2], 1),
    "decode with ragged lengths": ([2, 5, 1], [0, 1, 2], 1),
    "two-token chunk with ragged lengths": ([1, 4, 0], [1, 0], 2),
}


@pytest.mark.exercise("kv-cache-write")
@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_write_puts_each_token_in_its_slot(case):
    lengths, rows, T = WRITE_CASES[case]
    cache = prepared(lengths, rows, T)
    layer = 1
    k = randn(len(rows), CFG.n_head, T, CFG.head_dim, seed=1)
    v = randn(len(rows), CFG.n_head, T, CFG.head_dim, seed=2)
    cache.write(layer, k, v)
    # Oracle: token t of the i-th row in the step lands in slot lengths[row] + t of that row, in this layer only.
    want_k, want_v = torch.zeros_like(cache.k), torch.zeros_like(cache.v)
    for i, row in enumerate(rows):
        for t in range(T):
            want_k[layer, row, :, lengths[row] + t] = k[i, :, t]
            want_v[layer, row, :, lengths[row] + t] = v[i, :, t]
    where = f"{WRITE} (step: rows {rows} holding {[lengths[r] for r in rows]} tokens get {T} new each)"
    assert_close(cache.k, want_k, f"cache.k after write, {case}", where, CACHE_AXES, atol=0, rtol=0)
    assert_close(cache.v, want_v, f"cache.v after write, {case}", where, CACHE_AXES, atol=0, rtol=0)


# ------------------------------------------------------------------ read

@pytest.fixture(autouse=True)
def attention_written(monkeypatch):
    """`read` ends in model.causal_attention, exercise model-causal-attention: these tests use an independent
    one in its place, so that they check `read` alone."""
    monkeypatch.setattr("minillm.kv_cache.causal_attention", attention_oracle)


READ_CASES = {
    "fresh prefill": ([0, 0], [0, 1], 4),
    "decode with equal lengths": ([3, 3, 3], [0, 1, 2], 1),
    "decode with ragged lengths": ([2, 5, 1], [0, 1, 2], 1),
    "chunk after a cached prefix": ([3, 3], [0, 1], 2),
    "ragged chunk, rows out of order": ([1, 4, 2], [2, 0], 3),
    "one row of three": ([2, 4, 3], [1], 1),
}


def step_with_cache_filled(lengths, rows, T, layer, seed=0):
    """prepare the step, then fill the whole cache by hand: the step's own new keys and values already in
    their slots (as `write` would leave them), and every slot past each sequence's end full of junk that
    `read` must not look at. Returns the cache, q and the step's k, v."""
    cache = prepared(lengths, rows, T)
    cache.k.copy_(randn(*cache.k.shape, seed=seed))
    cache.v.copy_(randn(*cache.v.shape, seed=seed + 1))
    q = randn(len(rows), CFG.n_head, T, CFG.head_dim, seed=seed + 2)
    k = torch.stack([cache.k[layer, row, :, lengths[row]:lengths[row] + T] for row in rows])
    v = torch.stack([cache.v[layer, row, :, lengths[row]:lengths[row] + T] for row in rows])
    return cache, q, k, v


@pytest.mark.exercise("kv-cache-read")
@pytest.mark.parametrize("case", list(READ_CASES))
def test_read_attends_over_the_sequence_so_far(case):
    lengths, rows, T = READ_CASES[case]
    layer = 1
    cache, q, k, v = step_with_cache_filled(lengths, rows, T, layer)
    out = cache.read(layer, q, k, v)
    # Oracle: the query for token t of row i sits at position lengths[row] + t and sees slots 0 .. that position.
    want = torch.zeros(q.shape, dtype=torch.float64)
    for i, row in enumerate(rows):
        for h in range(CFG.n_head):
            for t in range(T):
                seen = lengths[row] + t + 1
                want[i, h, t] = attend_one_query(q[i, h, t], cache.k[layer, row, h, :seen], cache.v[layer, row, h, :seen])
    where = f"{READ} (step: rows {rows} holding {[lengths[r] for r in rows]} tokens get {T} new each)"
    assert_close(out, want, f"read(layer, q, k, v), {case}", where, ("step row", "head", "query", "dim"))


@pytest.mark.exercise("kv-cache-read")
def test_read_uses_the_layer_it_is_given():
    cache, q, k, v = step_with_cache_filled([2, 2], [0, 1], 1, layer=0)
    out0 = cache.read(0, q, k, v)
    cache.k[1].copy_(cache.k[0] * -3.0)   # layer 1 now holds very different keys
    assert_close(cache.read(0, q, k, v), out0, "read(0, ...) after changing only layer 1's cached keys", READ,
                 ("step row", "head", "query", "dim"))
