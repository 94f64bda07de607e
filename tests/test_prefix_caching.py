"""Prefix caching: shared blocks, found by their hash chain, give every request exactly its own tokens and logits.

The block manager is tested alone with stand-in sequences (it needs only ids, tokens and a computed count);
the engine is tested on a model whose next token depends on its context (tests/models.py), so a block
read with the wrong keys, or a stale one, changes the tokens.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm import sampling as sampling_module  # the engine samples through sampling.sample
from minillm import kv_cache
from minillm.block_manager import BlockManager
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.prefix_caching import ROOT, PrefixCachingBlockManager, hash_block
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts
from test_engine import drive

CFG = PRESETS["tiny"]


def seq(seq_id: int, tokens: list[int], computed: int = 0):
    return SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), num_computed_tokens=computed,
                           prompt_token_ids=tuple(tokens), num_cached_tokens=None)


def compute(blocks: PrefixCachingBlockManager, s, n: int) -> None:
    """What one engine step does to a sequence's KV: room for n tokens, then they are computed."""
    blocks.append_slots(s, n)
    s.num_computed_tokens += n


def admit(blocks: PrefixCachingBlockManager, s) -> None:
    """What the scheduler does to a waiting sequence: start after its cached prefix, compute the rest."""
    s.num_computed_tokens = blocks.match_prefix(s)
    compute(blocks, s, len(s.token_ids) - s.num_computed_tokens)


# ---- the block manager alone ------------------------------------------------------------------


def test_a_block_hash_names_its_whole_prefix():
    first = hash_block(ROOT, [1, 2])
    assert hash_block(first, [3, 4]) == hash_block(hash_block(ROOT, [1, 2]), [3, 4])
    assert hash_block(first, [3, 4]) != hash_block(ROOT, [3, 4]), "the same tokens after another prefix"
    assert hash_block(first, [3, 4]) != hash_block(hash_block(ROOT, [9, 2]), [3, 4])
    assert hash_block(ROOT, [1, 2]) != hash_block(ROOT, [2, 1])


def test_a_hit_shares_whole_blocks_and_counts_references():
    blocks = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5])
    admit(blocks, a)                                   # blocks [1, 2] and [3, 4] are full and cached
    b = seq(1, [1, 2, 3, 4, 9, 9])
    assert blocks.match_prefix(b) == 4
    admit(blocks, b)
    shared = blocks.block_tables[0][:2]
    assert blocks.block_tables[1][:2] == shared and [blocks.allocator.ref_counts[x] for x in shared] == [2, 2]
    assert blocks.block_tables[1][2] not in blocks.block_tables[0], "the first uncached token starts a block of its own"
    blocks.check_invariants([a, b])
    c = seq(2, [1, 2, 7, 4, 5])                        # differs in the second block: only the first is reused
    assert blocks.match_prefix(c) == 2
    assert blocks.match_prefix(seq(3, [7, 2, 3, 4, 5])) == 0, "a miss in the first block ends the match"


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_the_last_token_is_always_computed(block_size):
    """An identical prompt hits every whole block short of its last token; that block is recomputed into a
    fresh block, so no shared block is ever written."""
    for length in range(1, 3 * block_size + 2):
        blocks = PrefixCachingBlockManager(num_blocks=16, block_size=block_size)
        tokens = list(range(10, 10 + length))
        a = seq(0, tokens)
        admit(blocks, a)
        b = seq(1, tokens)
        want = (length - 1) // block_size * block_size
        assert blocks.match_prefix(b) == want, f"a prompt of {length} tokens, blocks of {block_size}"
        admit(blocks, b)
        assert len(set(blocks.block_tables[0]) & set(blocks.block_tables[1])) == want // block_size
        blocks.check_invariants([a, b])


def test_freed_blocks_stay_cached_and_allocation_takes_free_blocks_first():
    blocks = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    a = seq(0, [1, 2, 3, 4])
    admit(blocks, a)
    head, tail = blocks.block_tables[0]
    blocks.free(a)
    assert blocks.num_free_blocks == 4 and list(blocks.allocator.evictable) == [tail, head], \
        "a freed sequence's blocks stay cached, its tail the first to go"
    other = seq(1, [8, 8, 8])
    admit(blocks, other)                               # two blocks: the truly free ones
    assert set(blocks.block_tables[1]).isdisjoint({head, tail}) and len(blocks.allocator.cached) == 3
    assert blocks.match_prefix(seq(2, [1, 2, 3, 4, 5])) == 4, "nothing was evicted while free blocks were left"
    blocks.free(other)
    third = seq(3, [5, 6, 7, 8, 9, 10, 11])           # four blocks: the free ones, then the evicted
    admit(blocks, third)
    assert blocks.allocator.evictable == {} and head in blocks.block_tables[3] and tail in blocks.block_tables[3]
    assert blocks.match_prefix(seq(4, [1, 2, 3, 4, 5])) == 0
    blocks.check_invariants([third])


def test_eviction_is_least_recently_used_and_a_hit_renews_a_block():
    blocks = PrefixCachingBlockManager(num_blocks=3, block_size=2)
    a, b = seq(0, [1, 2, 0]), seq(1, [3, 4, 0])
    for s in (a, b):
        admit(blocks, s)
        blocks.free(s)                                 # cached: [1, 2] (older), then [3, 4]
    again = seq(2, [1, 2, 5])
    admit(blocks, again)                               # a hit renews [1, 2]
    blocks.free(again)
    newcomer = seq(3, [7, 7, 7, 7])
    compute(blocks, newcomer, 2)                       # the one free block
    compute(blocks, newcomer, 2)                       # then the least recently used: [3, 4], not the renewed [1, 2]
    assert blocks.match_prefix(seq(4, [1, 2, 0])) == 2 and blocks.match_prefix(seq(5, [3, 4, 0])) == 0


def test_a_reused_block_loses_its_old_hash_and_the_check_sees_a_stale_one():
    blocks = PrefixCachingBlockManager(num_blocks=2, block_size=2)
    a = seq(0, [1, 2, 3])
    admit(blocks, a)
    old = blocks.block_tables[0][0]
    old_hash = blocks.allocator.block_hash[old]
    blocks.free(a)
    b = seq(1, [9, 9, 9, 9])
    admit(blocks, b)                                   # takes both blocks: the cached one is evicted
    assert old in blocks.block_tables[1]
    assert old_hash not in blocks.allocator.cached
    blocks.check_invariants([b])
    # Put the stale hash back by hand: the check must see a block whose hash names other tokens.
    alloc = blocks.allocator
    del alloc.cached[alloc.block_hash[old]]
    alloc.block_hash[old], alloc.cached[old_hash] = old_hash, old
    with pytest.raises(AssertionError, match="another prefix's hash"):
        blocks.check_invariants([b])


def test_the_invariant_check_sees_a_block_in_two_states():
    blocks = PrefixCachingBlockManager(num_blocks=3, block_size=2)
    a = seq(0, [1, 2, 3])
    admit(blocks, a)
    blocks.free(a)
    evictable = next(iter(blocks.allocator.evictable))
    blocks.allocator.free_blocks.append(evictable)
    with pytest.raises(AssertionError, match=f"block {evictable} is free and evictable"):
        blocks.check_invariants([])


def test_a_shared_evictable_block_no_longer_counts_as_free():
    """Two cached blocks and nothing else: admitting a sequence that shares one of them and needs one more
    leaves no room for anything, and one that needs two more does not fit."""
    blocks = PrefixCachingBlockManager(num_blocks=2, block_size=2)
    a = seq(0, [1, 2, 3, 4])
    admit(blocks, a)
    blocks.free(a)                                     # both blocks evictable, [1, 2] and [3, 4]
    fits, too_long = seq(1, [1, 2, 6]), seq(2, [1, 2, 6, 6, 6])
    for s in (fits, too_long):
        s.num_computed_tokens = blocks.match_prefix(s)
    assert fits.num_computed_tokens == too_long.num_computed_tokens == 2
    assert blocks.blocks_needed(fits, 1) == 2 and blocks.can_append(fits, 1)
    assert not blocks.can_append(too_long, 3), "the shared block cannot also be evicted for the new ones"
    with pytest.raises(RuntimeError, match="needs 3 blocks but 2 are free"):
        blocks.append_slots(too_long, 3)
    assert blocks.block_tables == {} and blocks.num_free_blocks == 2, "a refused admission must change nothing"


def test_admitting_at_more_than_is_cached_is_an_error():
    blocks = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    assert blocks.match_prefix(seq(0, [1, 2, 3])) == 0
    with pytest.raises(RuntimeError, match="holds 0 of them; ask match_prefix"):
        blocks.append_slots(seq(0, [1, 2, 3], computed=2), 1)


def test_without_prefix_caching_nothing_is_cached():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = seq(0, [1, 2, 3])
    blocks.append_slots(a, 3)
    a.num_computed_tokens = 3
    assert blocks.match_prefix(seq(1, [1, 2, 3])) == 0


# ---- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return context_model()


def greedy(max_tokens: int = 8, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def reference(model, prompt, params):
    return kv_cache.generate(model, [prompt], params)[0]


def drain(engine: LLMEngine) -> dict:
    """Step until every request has finished, checking the blocks after every step; outputs by request id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    return finals


def test_prefix_caching_is_off_unless_asked_for(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    prompt = random_prompts(1, [20])[0]
    outs = [engine.generate([prompt], greedy(2))[0] for _ in range(2)]
    assert type(engine.block_manager) is BlockManager and [o.num_cached_tokens for o in outs] == [0, 0]
    assert engine.prefix_cache_hit_rate == 0.0


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_prefixes_around_a_block_boundary_and_a_full_prompt_hit(model, block_size, chunked):
    """One request leaves its blocks; then prompts sharing bs − 1, bs, bs + 1 and 2·bs + 1 of its tokens, and the
    whole prompt again, each find exactly the whole blocks of the shared part short of their last token."""
    bs = block_size
    first = random_prompts(1, [2 * bs + 6], seed=1)[0]
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=bs, num_gpu_blocks_override=64, enable_prefix_caching=True))
    assert engine.generate([first], greedy())[0].num_cached_tokens == 0
    tails = random_prompts(5, [3], seed=2)
    prompts = [first[:n] + tail for n, tail in zip([bs - 1, bs, bs + 1, 2 * bs + 1], tails)] + [list(first)]
    for prompt, shared in zip(prompts, [bs - 1, bs, bs + 1, 2 * bs + 1, len(first)]):
        (out,) = engine.generate([prompt], greedy())
        assert out.num_cached_tokens == min(shared, len(prompt) - 1) // bs * bs, f"{shared} shared tokens"
        assert out.output_token_ids == reference(model, prompt, greedy())
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_hit_rate_counts_every_admitted_prompt_token(model):
    system = random_prompts(1, [32], seed=3)[0]
    prompts = [system + tail for tail in random_prompts(3, [8], seed=4)]
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=32, enable_prefix_caching=True))
    outs = [engine.generate([p], greedy(4))[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    assert engine.prefix_cache_hit_rate == pytest.approx(64 / 120)
    assert sum(s.num_prefill_tokens for s in engine.timeline) == 40 + 8 + 8, "a hit prefills only its suffix"


@pytest.mark.parametrize("chunked", [True, False])
def test_requests_admitted_in_the_same_step_share_at_once(model, chunked):
    """A block is cached as soon as a step is planned to fill it: a request admitted later in the same step
    shares it, and reads keys that the same forward pass writes."""
    system = random_prompts(1, [40], seed=5)[0]
    prompts = [system + tail for tail in random_prompts(3, [5], seed=6)]
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=8, num_gpu_blocks_override=32, enable_prefix_caching=True))
    outs = engine.generate(prompts, greedy())
    assert engine.timeline[0].num_prefill_tokens == 45 + 5 + 5, "the three prompts were meant to share one step"
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40]
    assert [o.output_token_ids for o in outs] == [reference(model, p, greedy()) for p in prompts]


def test_the_next_turn_of_a_conversation_reuses_the_blocks_its_answer_filled(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32, enable_prefix_caching=True))
    turn, cached = random_prompts(1, [13], seed=7)[0], 0
    for user in random_prompts(3, [6], seed=8):
        (out,) = engine.generate([turn], greedy())
        assert out.num_cached_tokens == cached and out.output_token_ids == reference(model, turn, greedy())
        history = turn + out.output_token_ids
        cached = (len(history) - 1) // 4 * 4           # whole blocks of the prompt and answer; the last token never fed
        turn = history + user


@pytest.mark.parametrize("chunked", [True, False])
def test_logits_with_caching_equal_a_full_recompute_under_eviction_and_preemption(model, chunked, monkeypatch):
    """Every row the engine samples from, with a pool small enough to evict cached blocks and to preempt, equals
    the logits of the whole sequence computed from scratch (fp32: 1e-4)."""
    seen = []
    real_sample = sampling_module.sample

    def recording_sample(logits, params, generators):
        seen.extend(zip([p.seed for p in params], logits.clone()))
        return real_sample(logits, params, generators)
    monkeypatch.setattr(sampling_module, "sample", recording_sample)
    system = random_prompts(1, [21], seed=9)[0]
    prompts = [system[:n] + tail for n, tail in zip([21, 12, 21, 4, 21, 20], random_prompts(6, [3, 9], seed=10))]
    params = [greedy(10, seed=i) for i in range(len(prompts))]
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=6, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=16, enable_prefix_caching=True))
    evictions = count_evictions(engine)
    outs = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0 and evictions[0] > 0 and engine.prefix_cache_hit_rate > 0, \
        "the pool was meant to force preemption and eviction, and prompts to hit"
    position = [0] * len(prompts)
    with torch.inference_mode():
        for i, logits in seen:
            j = position[i]
            position[i] += 1
            full = model(torch.tensor([prompts[i] + outs[i].output_token_ids[:j]]))[0, -1]
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    assert position == [len(o.output_token_ids) for o in outs]


def count_evictions(engine: LLMEngine) -> list[int]:
    """Wrap the engine's allocator to count the allocations that had to evict a cached block."""
    allocator, count = engine.block_manager.allocator, [0]
    real = allocator.allocate

    def allocate():
        count[0] += not allocator.free_blocks and bool(allocator.evictable)
        return real()
    allocator.allocate = allocate
    return count


# ---- the fuzz ------------------------------------------------------------------------------------


def shared_prefix_trace(model, seed: int) -> dict:
    """A random engine and arrival trace whose prompts share prefixes: cut at bs − 1, bs, bs + 1 (and twice
    that), at random lengths, whole earlier prompts, and earlier prompts with their answers (a next turn)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 5, 16, 3])
    chunked = rng.random() < 0.6
    max_seqs = rng.randint(1, 6)
    budget = max(max_seqs, rng.choice([max_seqs, 3, 7, 16, 64, 2048]) if chunked else 2048)
    systems = [[rng.randrange(CFG.vocab_size) for _ in range(50)] for _ in range(rng.randint(1, 2))]
    prompts, params = [], []
    for i in range(rng.randint(3, 9)):
        kind = rng.choice(["boundary", "boundary", "random", "whole", "next turn", "fresh"])
        tail = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(0, 8))]
        if kind == "boundary":
            n = max(1, rng.choice([bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1]))
            prompt = rng.choice(systems)[:n] + tail
        elif kind == "random":
            prompt = rng.choice(systems)[:rng.randint(1, 50)] + tail
        elif kind == "whole" and prompts:
            prompt = list(rng.choice(prompts))
        elif kind == "next turn" and prompts:
            j = rng.randrange(len(prompts))
            prompt = prompts[j] + reference(model, prompts[j], params[j]) + tail
        else:
            prompt = tail + [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = prompt[:90] or [1]
        prompts.append(prompt)
        params.append(greedy(rng.randint(1, 12), seed=i))
    longest = max(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    num_blocks = -(-longest // bs) + rng.randint(0, 120 // bs)
    arrivals = sorted(rng.randint(0, 12) for _ in prompts)
    aborts = {rng.randrange(len(prompts)): rng.randint(0, 15) for _ in range(rng.randint(0, 1))}
    return dict(bs=bs, chunked=chunked, config=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                                               enable_chunked_prefill=chunked), prompts=prompts,
                params=params, num_blocks=num_blocks, arrivals=arrivals, aborts=aborts)


def run_trace(model, t: dict, caching: bool, monkeypatch) -> tuple[dict, dict, LLMEngine, list[int]]:
    """Outputs and sampled logits by request index; the blocks are checked after every step."""
    seen: dict[int, list] = {i: [] for i in range(len(t["prompts"]))}
    real_sample = sampling_module.sample

    def recording_sample(logits, params, generators):
        for p, row in zip(params, logits):
            seen[p.seed].append(row.clone())
        return real_sample(logits, params, generators)
    monkeypatch.setattr(sampling_module, "sample", recording_sample)
    engine = LLMEngine(model, t["config"],
                       cache_config=CacheConfig(block_size=t["bs"], num_gpu_blocks_override=t["num_blocks"],
                                                enable_prefix_caching=caching))
    evictions = count_evictions(engine) if caching else [0]
    ids, finals = drive(engine, t, "the trace")
    monkeypatch.setattr(sampling_module, "sample", real_sample)
    return {i: finals[r] for i, r in ids.items()}, seen, engine, evictions


def fuzz(model, seeds, monkeypatch) -> dict:
    totals = dict(cached_tokens=0, full_prompt_hits=0, evictions=0, preemptions=0)
    for seed in seeds:
        t = shared_prefix_trace(model, seed)
        off, logits_off, _, _ = run_trace(model, t, False, monkeypatch)
        on, logits_on, engine, evictions = run_trace(model, t, True, monkeypatch)
        for i in range(len(t["prompts"])):
            a, b = off[i].output_token_ids, on[i].output_token_ids
            aborted = "abort" in (off[i].finish_reason, on[i].finish_reason)  # at a step count, so not at a token count
            n = min(len(a), len(b)) if aborted else len(a)
            assert a[:n] == b[:n] and (aborted or a == b), f"trace {seed}, request {i}: caching changed the tokens: {t}"
            assert aborted or len(logits_off[i]) == len(logits_on[i]) == n
            for x, y in zip(logits_off[i][:n], logits_on[i][:n]):
                torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4, msg=f"trace {seed}, request {i}: {t}")
        prompts, bs = t["prompts"], t["bs"]
        totals["cached_tokens"] += sum(o.num_cached_tokens or 0 for o in on.values())
        for i, p in enumerate(prompts):
            whole_blocks = (len(p) - 1) // bs * bs
            totals["full_prompt_hits"] += prompts.index(p) < i and whole_blocks > 0 and on[i].num_cached_tokens == whole_blocks
        totals["evictions"] += evictions[0]
        totals["preemptions"] += sum(o.num_preemptions for o in on.values())
    return totals


def test_fuzz_caching_on_equals_caching_off(model, monkeypatch):
    """Random traces of prompts that share prefixes, block sizes 1, 3, 5 and 16, chunked and not, pools small
    enough to evict and to preempt, aborts: the same tokens and logits with caching as without, the blocks
    checked after every step, none leaked."""
    totals = fuzz(model, range(20), monkeypatch)
    assert all(totals.values()), f"the fuzz was meant to reach hits, full-prompt hits, evictions and preemptions: {totals}"


@pytest.mark.slow
def test_fuzz_many_traces(model, monkeypatch):
    totals = fuzz(model, range(20, 200), monkeypatch)
    assert all(totals.values()), totals
