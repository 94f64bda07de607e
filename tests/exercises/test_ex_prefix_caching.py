"""Lesson 10 exercise in minillm/prefix_caching.py: which cached blocks a prompt can start from.

Each test builds the cache by hand: the chained key of every block it should hold (`hash_block`, given),
mapped to a made-up block id, so the expected answer is written out in the case itself.
"""
import pytest

from minillm.prefix_caching import ROOT, hash_block, prefix_match

MATCH = "minillm/prefix_caching.py, prefix_match"
PROMPT = list(range(100, 120))  # 20 distinct token ids


def keys_of(tokens: list[int], block_size: int) -> list[bytes]:
    """The chained key of every whole block of `tokens`, first block first."""
    keys, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def cache_of(tokens: list[int], block_size: int, block_ids: dict[int, int]) -> dict[bytes, int]:
    """A cache holding block i of `tokens` (by its chained key) in block id block_ids[i]."""
    keys = keys_of(tokens, block_size)
    return {keys[i]: block for i, block in block_ids.items()}


CASES = {
    # name: (prompt, block_size, cache, expected blocks)
    "nothing cached": (PROMPT[:10], 4, {}, []),
    "two cached blocks, the prompt goes on": (PROMPT[:10], 4, cache_of(PROMPT, 4, {0: 7, 1: 3}), [7, 3]),
    "one token past a block edge": (PROMPT[:9], 4, cache_of(PROMPT, 4, {0: 7, 1: 3}), [7, 3]),
    "the whole prompt cached: its last block holds the last token and is recomputed":
        (PROMPT[:8], 4, cache_of(PROMPT, 4, {0: 7, 1: 3}), [7]),
    "a miss ends the walk, even if later blocks are cached": (PROMPT[:13], 4, cache_of(PROMPT, 4, {0: 7, 2: 5}), [7]),
    "a miss in the first block": (PROMPT[:13], 4, cache_of(PROMPT, 4, {1: 3, 2: 5}), []),
    "the same tokens after another prefix are another block":
        (PROMPT[:13], 4, {**cache_of(PROMPT, 4, {0: 7}), hash_block(ROOT, PROMPT[4:8]): 9}, [7]),
    "a partly filled block is never matched": (PROMPT[:6], 4, cache_of(PROMPT, 4, {0: 7}), [7]),
    "block_size 1": (PROMPT[:3], 1, cache_of(PROMPT, 1, {0: 4, 1: 0, 2: 2}), [4, 0]),
    "a one-token prompt": (PROMPT[:1], 1, cache_of(PROMPT, 1, {0: 4}), []),
    "a prompt shorter than a block": (PROMPT[:3], 4, {}, []),
}


@pytest.mark.exercise("prefix-match")
@pytest.mark.parametrize("case", list(CASES))
def test_prefix_match_returns_the_cached_blocks_a_prompt_starts_with(case):
    prompt, bs, cached, want = CASES[case]
    before = dict(cached)
    got = prefix_match(list(prompt), bs, cached)
    described = {f"block {i}": cached[k] for i, k in enumerate(keys_of(prompt, bs)) if k in cached}
    assert isinstance(got, list) and got == want, (
        f"{case}: prefix_match(a prompt of {len(prompt)} tokens, block_size={bs}, a cache holding "
        f"{described or 'none of its blocks'}) should return the block ids {want}; got {got!r}. "
        f"Look at {MATCH}.")
    assert cached == before, f"{case}: prefix_match changed the cache it was given. Look at {MATCH}."


@pytest.mark.exercise("prefix-match")
def test_a_cached_block_is_found_by_its_key_not_by_its_position():
    """Another prompt with the same first 8 tokens shares those blocks, whatever comes after them."""
    other = PROMPT[:8] + [1, 2, 3, 4, 5]
    cached = cache_of(PROMPT, 4, {0: 11, 1: 12, 2: 13})
    got = prefix_match(other, 4, cached)
    assert got == [11, 12], (f"a prompt sharing its first 8 tokens with a cached one (blocks 11, 12, 13) should "
                             f"reuse [11, 12] and stop where it differs; got {got!r}. Look at {MATCH}.")
