"""LLMEngine: continuous batching over the paged cache gives every request exactly its own tokens."""
import random

import pytest
import torch

from minillm import GPT2, PRESETS, SamplingParams
from minillm import kv_cache
from minillm.chunked_prefill import SchedulerConfig
from minillm.engine import LLMEngine

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return GPT2(CFG, seed=0).eval()


def random_prompts(n, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(CFG.vocab_size) for _ in range(rng.choice(lengths))] for _ in range(n)]


def reference(model, prompts, params=GREEDY):
    return [kv_cache.generate(model, [p], params)[0] for p in prompts]


def run_checked(engine, arrivals):
    """Feed {step: [prompts]} at the given steps; check the allocator after every step; return outputs by id."""
    finals, ids, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, p in arrivals.get(step, []):
            ids[i] = engine.add_request(p, GREEDY)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.cache.check_invariants()
        step += 1
    assert engine.cache.num_free_blocks == engine.cache.num_blocks, "blocks leaked after every request finished"
    return {i: finals[r] for i, r in ids.items()}


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_mixed_batch_matches_per_request_generation(model, block_size, chunked):
    bs = block_size
    prompts = random_prompts(6, [1, 2, 9, 23]) + [[3] * (bs - 1 or 1), [4] * bs, [5] * (bs + 1)]
    engine = LLMEngine(model, SchedulerConfig(256, 8, chunked), block_size=bs, num_blocks=400)
    outs = run_checked(engine, {0: list(enumerate(prompts))})
    assert [outs[i].output_token_ids for i in range(len(prompts))] == reference(model, prompts)


def test_requests_arriving_at_different_steps(model):
    prompts = random_prompts(8, [3, 11, 30], seed=1)
    arrivals = {0: [(0, prompts[0]), (1, prompts[1])], 2: [(2, prompts[2])], 3: [(3, prompts[3]), (4, prompts[4])],
                9: [(5, prompts[5])], 10: [(6, prompts[6]), (7, prompts[7])]}
    engine = LLMEngine(model, SchedulerConfig(64, 4), block_size=4, num_blocks=64)
    outs = run_checked(engine, arrivals)
    assert [outs[i].output_token_ids for i in range(8)] == reference(model, prompts)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_pool_small_enough_to_force_preemption(model, chunked):
    prompts = random_prompts(8, [10, 20, 30], seed=2)
    # Room for about two requests at a time: the rest must be preempted and recomputed.
    engine = LLMEngine(model, SchedulerConfig(64, 8, chunked), block_size=4, num_blocks=12)
    outs = run_checked(engine, {0: list(enumerate(prompts))})
    assert sum(o.num_preemptions for o in outs.values()) > 0, "the pool was meant to force a preemption"
    assert [outs[i].output_token_ids for i in range(8)] == reference(model, prompts)


def test_metrics_and_timeline(model):
    engine = LLMEngine(model, SchedulerConfig(32, 4), block_size=4, num_blocks=64)
    prompt = random_prompts(1, [40], seed=3)[0]
    (out,) = engine.generate([prompt], GREEDY)
    m = out.metrics
    assert out.finished and out.finish_reason == "length"
    assert len(m.token_times) == len(out.output_token_ids) == GREEDY.max_tokens
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.ttft > 0 and len(m.itls) == GREEDY.max_tokens - 1 and min(m.itls) >= 0
    # 40 prompt tokens under a budget of 32: two prefill steps, the first token after the second.
    assert [s.num_prefill_tokens for s in engine.timeline[:2]] == [32, 8]
    assert sum(s.num_decode_tokens for s in engine.timeline) == GREEDY.max_tokens - 1
    assert all(s.duration > 0 for s in engine.timeline)


def test_a_stop_token_ends_a_request(model):
    prompt = [7, 8, 9]
    free_running = reference(model, [prompt])[0]
    stop = free_running[-1]
    engine = LLMEngine(model, num_blocks=32)
    (stopped,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    assert stopped.output_token_ids == free_running[:free_running.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def test_abort_frees_blocks_and_reports_the_request(model):
    engine = LLMEngine(model, SchedulerConfig(8, 2), block_size=4, num_blocks=32)
    running = engine.add_request([1, 2, 3], GREEDY)
    waiting = engine.add_request([4] * 30, GREEDY)
    engine.step()
    engine.abort_request(running)
    engine.abort_request(waiting)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[running].finish_reason == outs[waiting].finish_reason == "abort"
    assert outs[running].finished and not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    engine.abort_request(running)  # aborting a finished request is harmless
    with pytest.raises(KeyError, match="no request with id 'nope'"):
        engine.abort_request("nope")


def test_aborting_the_last_request_is_still_reported(model):
    """A `while has_unfinished_requests(): step()` loop must see the abort, even of the only request."""
    engine = LLMEngine(model, num_blocks=8)
    rid = engine.add_request([1, 2, 3], GREEDY)
    engine.abort_request(rid)
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step()
    assert [(o.request_id, o.finish_reason) for o in reported] == [(rid, "abort")]


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    prompts = random_prompts(3, [5, 9], seed=4)
    a = [o.output_token_ids for o in LLMEngine(model, num_blocks=64).generate(prompts, params)]
    b = [o.output_token_ids for o in LLMEngine(model, num_blocks=64).generate(prompts[::-1], params)][::-1]
    assert a == b, "a seeded request must not depend on what else shares its batch"


def test_pool_size_from_a_byte_budget(model):
    block_bytes = 16 * CFG.kv_bytes_per_token(torch.float32)
    engine = LLMEngine(model, kv_cache_memory_bytes=10 * block_bytes + 1)
    assert engine.cache.num_blocks == 10
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(model, kv_cache_memory_bytes=block_bytes - 1)


@pytest.mark.parametrize("prompt, params, match", [
    ([], GREEDY, "prompt is empty"),
    ([1] * 129, GREEDY, "n_ctx=128"),
    ([1, CFG.vocab_size], GREEDY, "outside the vocabulary"),
    ([1] * 100, SamplingParams(max_tokens=40), "exceeds the context"),
    ([1] * 60, SamplingParams(max_tokens=20), "whole pool has 4 blocks"),
])
def test_bad_requests_are_rejected_at_add_request(model, prompt, params, match):
    engine = LLMEngine(model, block_size=16, num_blocks=4)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests(), "a rejected request must leave no trace"


def test_max_tokens_below_one_is_an_error():
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


def test_duplicate_request_id(model):
    engine = LLMEngine(model, num_blocks=8)
    engine.add_request([1], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request([2], GREEDY, request_id="a")


def test_automatic_ids_skip_ids_a_caller_chose(model):
    engine = LLMEngine(model, num_blocks=8)
    engine.add_request([1], GREEDY, request_id="0")
    assert engine.add_request([2], GREEDY) == "1"


def test_an_explicit_pool_of_zero_blocks_is_an_error(model):
    with pytest.raises(ValueError, match="num_blocks=0"):
        LLMEngine(model, num_blocks=0)


def test_generate_needs_one_params_per_prompt(model):
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        LLMEngine(model, num_blocks=8).generate([[1], [2]], [GREEDY])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_sizes_its_pool_from_gpu_memory_utilization():
    model = GPT2(CFG, seed=0).cuda().eval()
    engine = LLMEngine(model, gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    assert 0 < engine.cache.nbytes <= 0.3 * total
    prompts = random_prompts(4, [3, 17, 40], seed=7)
    got = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == reference(model, prompts)
