"""LLMEngine: continuous batching over the paged cache gives every request exactly its own tokens.

Every equivalence here runs on a model whose next token depends on its context
(tests/models.py), so a path that reads the wrong keys gives other tokens.
"""
import gc
import random
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm import cpu_layout as cpu_layout_module
from minillm import sampling as sampling_module  # the engine samples through sampling.sample
from minillm import kv_cache, naive_decode
from minillm.cuda_graphs import DecodeRunner
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.sampling import NonFiniteLogitsError
from minillm.scheduler import SchedulerConfig
from minillm.sequence import Sequence
from minillm.cpu_layout import choose_layout, use_decode_attention_by_hand
from models import context_model, random_prompts

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return context_model()


def reference(model, prompts, params=GREEDY):
    return [kv_cache.generate(model, [p], params)[0] for p in prompts]


def run_checked(engine, arrivals, params=GREEDY):
    """Feed {step: [(i, prompt)]} at the given steps; check the blocks after every step; return outputs by i."""
    finals, ids, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, p in arrivals.get(step, []):
            ids[i] = engine.add_request(p, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, \
        "blocks leaked after every request finished"
    return {i: finals[r] for i, r in ids.items()}


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("chunked", [True, False])
def test_mixed_batch_matches_per_request_generation(model, block_size, chunked):
    bs = block_size
    prompts = random_prompts(6, [1, 2, 9, 23]) + [[3] * (bs - 1 or 1), [4] * bs, [5] * (bs + 1)]
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=bs, num_gpu_blocks_override=400))
    outs = run_checked(engine, {0: list(enumerate(prompts))})
    assert [outs[i].output_token_ids for i in range(len(prompts))] == reference(model, prompts)


def test_requests_arriving_at_different_steps(model):
    prompts = random_prompts(8, [3, 11, 30], seed=1)
    arrivals = {0: [(0, prompts[0]), (1, prompts[1])], 2: [(2, prompts[2])], 3: [(3, prompts[3]), (4, prompts[4])],
                9: [(5, prompts[5])], 10: [(6, prompts[6]), (7, prompts[7])]}
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64))
    outs = run_checked(engine, arrivals)
    assert [outs[i].output_token_ids for i in range(8)] == reference(model, prompts)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_pool_small_enough_to_force_preemption(model, chunked):
    prompts = random_prompts(8, [10, 20, 30], seed=2)
    # Room for about two requests at a time: the rest must be preempted and recomputed.
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=12))
    outs = run_checked(engine, {0: list(enumerate(prompts))})
    assert sum(o.num_preemptions for o in outs.values()) > 0, "the pool was meant to force a preemption"
    assert [outs[i].output_token_ids for i in range(8)] == reference(model, prompts)


@pytest.mark.parametrize("cpu_layout", [None, "torch's BLAS", "numpy's BLAS", "bf16", "bf16, fused attention"])
@pytest.mark.parametrize("chunked", [True, False])
def test_engine_logits_equal_the_contiguous_cache(model, chunked, cpu_layout, monkeypatch):
    """On logits, not only tokens: every row the engine samples from, under preemption and chunking, equals the
    logits that a full recompute of the same sequence gives (fp32: 1e-4), in each layout the loader can choose
    (on a CPU: the LM head's [C, V] copy, packed projections, and on an AMD one numpy's BLAS for one-row steps,
    which this run must take), against a recompute through the weights as stored.

    bf16 (its decode attention written out, `cpu_layout.decode_attention`, and torch's fused kernel, which the
    CPU's flags choose between; the head's [C, V] copy, unpacked, since oneDNN packs bf16 only on AVX-512 CPUs) is
    held to a recompute in bf16 within 2% of the row's largest logit: bf16 keeps 8 bits of mantissa, so each rounding moves a value by up to 2⁻⁹ of itself, and the
    engine's steps (decodes, chunks, other rows beside them) round at other places than one recompute does;
    a logit near the largest (11 here) is itself rounded by up to 0.03, ~0.3% of it. Measured: 0.11 at most,
    1% of 11; the same weights in fp32 differ from bf16's by 0.22, and a step over the wrong keys by far more."""
    reference_model, tol = model, lambda full: {"atol": 1e-4, "rtol": 1e-4}
    if cpu_layout and cpu_layout.startswith("bf16"):
        reference_model = context_model().to(torch.bfloat16)
        tol = lambda full: {"atol": 0.02 * full.abs().max().item(), "rtol": 0}  # noqa: E731
        model = choose_layout(context_model().to(torch.bfloat16), numpy_one_row=False, packed=False)
        use_decode_attention_by_hand(cpu_layout == "bf16")  # after the loader's choice (conftest restores it)
    elif cpu_layout:
        model = choose_layout(context_model(), numpy_one_row=cpu_layout == "numpy's BLAS")
    one_row_steps, written_out = [], []
    real_product, real_attention = cpu_layout_module.numpy_product, cpu_layout_module.decode_attention
    monkeypatch.setattr(cpu_layout_module, "numpy_product", lambda *a: one_row_steps.append(1) or real_product(*a))
    monkeypatch.setattr(cpu_layout_module, "decode_attention", lambda *a: written_out.append(1) or real_attention(*a))
    seen = []
    real_sample = sampling_module.sample

    def recording_sample(logits, params, generators):
        seen.extend(zip(params, logits.clone()))
        return real_sample(logits, params, generators)
    monkeypatch.setattr(sampling_module, "sample", recording_sample)
    prompts = random_prompts(6, [5, 17, 26], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, seed=i) for i in range(6)]  # one each
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=6, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=20))
    outs = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force a preemption"
    by_request = {id(p): (prompt, out.output_token_ids) for p, prompt, out in zip(params, prompts, outs)}
    position = {id(p): 0 for p in params}
    with torch.inference_mode():
        for p, logits in seen:
            prompt, output = by_request[id(p)]
            j = position[id(p)]
            position[id(p)] += 1
            full = reference_model(torch.tensor([prompt + output[:j]]))[0, -1]
            torch.testing.assert_close(logits, full, **tol(full))
    assert all(position[id(p)] == len(o.output_token_ids) for p, o in zip(params, outs))
    assert bool(one_row_steps) == (cpu_layout == "numpy's BLAS") and bool(written_out) == (cpu_layout == "bf16")


def fuzz_trace(seed: int):
    """A random engine configuration and arrival trace, small enough to preempt, with aborts."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 5, 8, 16])
    chunked = rng.random() < 0.7
    max_seqs = rng.randint(1, 6)
    budget = rng.choice([max_seqs, 2, 3, 7, 16, 64, 2048]) if chunked else 2048
    budget = max(budget, max_seqs)
    n = rng.randint(2, 9)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 14), ignore_eos=True) for _ in range(n)]
    longest = max(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params))
    num_blocks = -(-longest // bs) + rng.randint(0, 3 * 40 // bs)
    arrivals = sorted(rng.randint(0, 12) for _ in range(n))
    aborts = {rng.randrange(n): rng.randint(0, 15) for _ in range(rng.randint(0, 2))}
    return dict(bs=bs, chunked=chunked, max_seqs=max_seqs, budget=budget, prompts=prompts, params=params,
                num_blocks=num_blocks, arrivals=arrivals, aborts=aborts)


def drive(engine: LLMEngine, t: dict, label: str) -> tuple[dict, dict]:
    """Replay trace `t` step by step (arrivals and aborts at their step), checking the engine's invariants after
    every step and that no block leaked at the end; returns request ids by index and the finished outputs by id."""
    ids, finals, step = {}, {}, 0
    while len(ids) < len(t["prompts"]) or engine.has_unfinished_requests():
        for i, at in enumerate(t["arrivals"]):
            if at == step:
                ids[i] = engine.add_request(t["prompts"][i], t["params"][i])
        for i, at in t["aborts"].items():
            if at == step and i in ids:
                engine.abort_request(ids[i])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < 2000, f"{label} did not finish: {t}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, f"{label} leaked blocks: {t}"
    return ids, finals


def run_fuzz(model, seed, decode_mode="eager"):
    t = fuzz_trace(seed)
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=t["budget"], max_num_seqs=t["max_seqs"],
                                       enable_chunked_prefill=t["chunked"]),
                       cache_config=CacheConfig(block_size=t["bs"], num_gpu_blocks_override=t["num_blocks"]))
    if decode_mode != "eager":  # tests/test_cuda_graphs.py: the same traces with padded decode steps
        engine.decoder = DecodeRunner(model, engine.cache, t["max_seqs"], decode_mode)
    ids, finals = drive(engine, t, f"trace {seed}")
    for i, rid in ids.items():
        out = finals[rid]
        want = kv_cache.generate(model, [t["prompts"][i]], t["params"][i])[0]
        if out.finish_reason == "abort":
            assert out.output_token_ids == want[:len(out.output_token_ids)], f"trace {seed}, request {i}: {t}"
        else:
            assert out.output_token_ids == want, f"trace {seed}, request {i} diverged: {t}"
    return sum(o.num_preemptions for o in finals.values())


def test_engine_fuzz_random_traces(model):
    """Random arrivals, aborts, block sizes 1–16, budgets from max_num_seqs up, pools small enough to preempt:
    no wrong token, no leaked block, invariants after every step."""
    preemptions = sum(run_fuzz(model, seed) for seed in range(25))
    assert preemptions > 0, "the fuzz was meant to reach preemption"


@pytest.mark.slow
def test_engine_fuzz_many_traces(model):
    assert sum(run_fuzz(model, seed) for seed in range(25, 300)) > 0


def test_a_step_that_preempts_admits_no_one(model):
    """vLLM's rule: memory is short in a step that preempted, so no waiting request joins in it; a victim
    waits at least one step before it is recomputed."""
    prompts = random_prompts(3, [30, 40], seed=6)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=20))  # small chunks could fit
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    preempting_steps, plan_seqs = 0, []
    engine.on_plan = plan_seqs.append  # the hook that sees each step's plan
    while engine.has_unfinished_requests():
        waiting_before = list(engine.scheduler.waiting)
        plan_seqs.clear()
        engine.step()
        if plan_seqs and plan_seqs[0].preempted:
            preempting_steps += 1
            plan = plan_seqs[0]
            planned = {id(c.seq) for c in plan.chunks}
            assert not planned & {id(s) for s in plan.preempted}, "a victim ran in the step that preempted it"
            assert not planned & {id(s) for s in waiting_before}, "a step that preempted admitted a request"
    assert preempting_steps > 0


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_of_exactly_n_ctx_tokens_generates_one_token(model, chunked):
    """The last sampled token is never fed, so prompt + max_tokens − 1 ≤ n_ctx is what must fit; the same
    in every path."""
    prompt = random_prompts(1, [CFG.n_ctx], seed=11)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    want = naive_decode.generate(model, prompt, one)
    assert kv_cache.generate(model, [prompt], one) == [want] and len(want) == 1
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=16))
    assert engine.generate([prompt], one)[0].output_token_ids == want
    five = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)  # 124 + 5 − 1 = 128 tokens of KV
    short = prompt[:CFG.n_ctx - 4]
    want = naive_decode.generate(model, short, five)
    assert len(want) == 5 and kv_cache.generate(model, [short], five) == [want]
    assert engine.generate([short], five)[0].output_token_ids == want
    with pytest.raises(ValueError, match="lower max_tokens to at most 5"):
        engine.add_request(short, SamplingParams(max_tokens=6))


def test_numpy_and_torch_integer_ids_are_token_ids(model):
    prompt = [3, 14, 15, 92]
    want = reference(model, [prompt])[0]
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    got = engine.generate([list(np.array(prompt, dtype=np.int64)), list(torch.tensor(prompt))], GREEDY)
    assert [o.output_token_ids for o in got] == [want, want]
    assert all(type(t) is int for o in got for t in o.prompt_token_ids)


def test_metrics_and_timeline(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64))
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
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=32))
    (stopped,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    assert stopped.output_token_ids == free_running[:free_running.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def test_abort_frees_blocks_and_reports_the_request(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    running = engine.add_request([1, 2, 3], GREEDY)
    waiting = engine.add_request([4] * 30, GREEDY)
    engine.step()
    engine.abort_request(running)
    engine.abort_request(waiting)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[running].finish_reason == outs[waiting].finish_reason == "abort"
    assert outs[running].finished and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request(running) is False  # finished and reported: forgotten, so nothing to stop
    assert engine.abort_request("nope") is False


def test_aborting_the_last_request_is_still_reported(model):
    """A `while has_unfinished_requests(): step()` loop must see the abort, even of the only request."""
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    rid = engine.add_request([1, 2, 3], GREEDY)
    engine.abort_request(rid)
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step()
    assert [(o.request_id, o.finish_reason) for o in reported] == [(rid, "abort")]


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=123, ignore_eos=True)
    prompts = random_prompts(3, [5, 9], seed=4)
    pool = CacheConfig(num_gpu_blocks_override=64)
    a = [o.output_token_ids for o in LLMEngine(model, cache_config=pool).generate(prompts, params)]
    b = [o.output_token_ids for o in LLMEngine(model, cache_config=pool).generate(prompts[::-1], params)][::-1]
    assert a == b, "a seeded request must not depend on what else shares its batch"


def test_pool_size_from_a_byte_budget(model):
    """The budget holds the blocks and the pad block (paged_attention.py), and the pool is no larger."""
    block_bytes = 16 * CFG.kv_bytes_per_token(torch.float32)
    engine = LLMEngine(model, cache_config=CacheConfig(kv_cache_memory_bytes=11 * block_bytes + 1))
    assert engine.block_manager.num_blocks == 10 and engine.cache.nbytes == 11 * block_bytes
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(model, cache_config=CacheConfig(kv_cache_memory_bytes=2 * block_bytes - 1))


@pytest.mark.parametrize("prompt, params, match", [
    ([], GREEDY, "prompt is empty"),
    ([1] * 129, GREEDY, "n_ctx=128"),
    ([1, CFG.vocab_size], GREEDY, "outside the vocabulary"),
    ([1] * 100, SamplingParams(max_tokens=40), "exceed the context"),
    ([1, "a"], GREEDY, "is a str, not an integer"),
    ([1] * 60, SamplingParams(max_tokens=20), "whole pool has 4 blocks"),
])
def test_bad_requests_are_rejected_at_add_request(model, prompt, params, match):
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=4))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests(), "a rejected request must leave no trace"


def test_max_tokens_below_one_is_an_error():
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


def test_duplicate_request_id(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    engine.add_request([1], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request([2], GREEDY, request_id="a")


def test_automatic_ids_skip_ids_a_caller_chose(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    engine.add_request([1], GREEDY, request_id="0")
    assert engine.add_request([2], GREEDY) == "1"


def test_an_explicit_pool_of_zero_blocks_is_an_error(model):
    with pytest.raises(ValueError, match="num_gpu_blocks_override=0"):
        LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=0))


def test_generate_needs_one_params_per_prompt(model):
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8)).generate([[1], [2]], [GREEDY])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_sizes_its_pool_from_gpu_memory_utilization():
    model = context_model().cuda()
    engine = LLMEngine(model, cache_config=CacheConfig(gpu_memory_utilization=0.3))
    free, total = torch.cuda.mem_get_info()
    assert 0 < engine.cache.nbytes <= 0.3 * total
    prompts = random_prompts(4, [3, 17, 40], seed=7)
    got = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == reference(model, prompts)


# ---- the engine owns its state --------------------------------------------------------------


def test_what_a_caller_does_to_an_output_never_reaches_the_engine(model):
    """Every output is the caller's copy: growing its token lists or rewriting its metrics changes
    nothing the engine generates or reports next."""
    prompt = random_prompts(1, [6], seed=12)[0]
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    engine.add_request(prompt, GREEDY, arrival_time=1.0)
    seen = []  # (prompt, tokens, arrival, number of token times) as each output arrived
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((list(out.prompt_token_ids), list(out.output_token_ids), out.metrics.arrival_time,
                         len(out.metrics.token_times)))
            for ids in (out.prompt_token_ids, out.output_token_ids, out.metrics.token_times):
                if hasattr(ids, "extend"):  # whatever the type lets a caller change, the caller changes
                    ids.extend([1, 1])
            out.metrics.arrival_time = -5.0
    assert seen[-1][1] == reference(model, [prompt])[0]
    assert all(p == prompt and a == 1.0 and n == len(t) for p, t, a, n in seen)


def test_sampling_params_cannot_change_under_a_running_request(model):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[7])
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    engine.add_request([3, 1, 4], params)
    engine.step()
    with pytest.raises(AttributeError):
        params.max_tokens = 1  # frozen, as a request's params must stay what it was admitted with
    with pytest.raises(AttributeError):
        params.stop_token_ids.append(5)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.output_token_ids for o in finished] == kv_cache.generate(model, [[3, 1, 4]], params)


def test_a_finished_request_is_reported_once_then_forgotten(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(3, [4, 9], seed=2)]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finished) == sorted(ids), "each finished request is reported exactly once"
    assert all(o.metrics.finished_time is not None and len(o.metrics.token_times) == 12 for o in finished)
    assert engine.requests == {} and engine.step() == []
    assert engine.add_request([1, 2], GREEDY) not in ids, "an automatic id is never reused"


def serve_in_waves(engine, prompts, params, wave: int = 16) -> None:
    """Serve the prompts `wave` at a time, keeping none of the outputs."""
    for i in range(0, len(prompts), wave):
        for p in prompts[i:i + wave]:
            engine.add_request(p, params)
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.slow  # ~20 s under tracemalloc on 2 cores
def test_a_soak_of_2000_requests_leaves_the_python_heap_flat(model):
    """2,000 requests through one engine, the caller keeping no output (and the per-step timeline, a
    record for lessons that grows by one row per step, switched off).

    Three measures from request 200 to request 2,000: the interpreter's whole heap stays within 10%
    (the issue's criterion; sys.getallocatedblocks counts every block); no request's state survives
    (an exact census); and the bytes traced since the engine was built grow by under 64 B a request.
    A retained request costs kilobytes. The 64 B absorbs torch's own small pools, which move the
    traced heap by ~20 KB as they fill."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = random_prompts(2000, [4], seed=9)
    tracemalloc.start()
    try:
        engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16),
                           cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64), record_timeline=False)
        serve_in_waves(engine, prompts[:200], params)
        gc.collect()
        blocks_200, traced_200 = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
        serve_in_waves(engine, prompts[200:], params)
        gc.collect()
        blocks_2000, traced_2000 = sys.getallocatedblocks(), tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert blocks_2000 <= 1.1 * blocks_200, f"the heap grew from {blocks_200:,} to {blocks_2000:,} blocks"
    assert engine.requests == {} and not engine.scheduler.has_unfinished() and engine.block_manager.block_tables == {}
    assert not [o for o in gc.get_objects() if type(o) is Sequence], "a finished request is still alive"
    per_request = (traced_2000 - traced_200) / 1800
    assert per_request < 64, \
        f"{per_request:.0f} B kept per request ({traced_200:,} B after 200 requests, {traced_2000:,} after 2000)"


@pytest.mark.parametrize("prompt, match", [
    ("hello", "the prompt has type str"),
    (b"hello", "the prompt has type bytes"),
    (7, "the prompt has type int"),
    ({1, 2}, "the prompt has type set"),
    (torch.tensor([[1, 2]]), "2-D Tensor of shape"),
    (np.array([[1, 2]]), "2-D ndarray of shape"),
    (torch.tensor([1.0, 2.0]), "token id 1.0 at position 0 is a float"),
    ([1, True], "token id True at position 1 is a bool"),
    ([1, np.float32(2)], "is a float32"),
])
def test_a_prompt_must_be_a_sequence_of_integers(model, prompt, match):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=match):
        kv_cache.generate(model, [prompt], GREEDY)
    assert engine.requests == {}


def test_integer_arrays_and_tensors_are_prompts(model):
    prompt = [3, 14, 15, 92]
    want = reference(model, [prompt])[0]
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    got = engine.generate([np.array(prompt), torch.tensor(prompt), tuple(prompt)], GREEDY)
    assert [o.output_token_ids for o in got] == [want] * 3


def test_no_prompts_is_no_outputs_and_a_bare_prompt_is_explained(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    assert kv_cache.generate(model, []) == [] and engine.generate([]) == []
    with pytest.raises(ValueError, match="the prompt has type int.*list of such lists"):
        kv_cache.generate(model, [1, 2, 3])  # one prompt, not wrapped in a list of prompts


@pytest.mark.parametrize("knobs, match", [
    (dict(num_gpu_blocks_override=10**12), "GiB of KV cache, but cpu has"),
    (dict(gpu_memory_utilization=5), r"gpu_memory_utilization=5 must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization=nan must be a finite number"),
    (dict(num_gpu_blocks_override=2.5), "num_gpu_blocks_override=2.5 is a float"),
    (dict(block_size=0), "block_size=0 must be ≥ 1"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes=-1 must be ≥ 1"),
])
def test_pool_knobs_are_checked_on_every_device(model, knobs, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(model, cache_config=CacheConfig(**knobs))


def test_add_request_wants_sampling_params(model):
    with pytest.raises(ValueError, match="params is a dict; pass a SamplingParams"):
        LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8)).add_request([1], {"max_tokens": 3})


def poison_rows(model, monkeypatch, rows: set[int], on_call: int):
    """Make the model's `on_call`-th forward return NaN logits in the given sampling rows."""
    calls = {"n": 0}
    forward = model.forward

    def poisoned(*args, **kwargs):
        logits = forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == on_call:
            flat = logits.reshape(-1, logits.shape[-1]).clone()  # (rows, V), whatever layout the step used
            flat[sorted(rows)] = float("nan")
            logits = flat.view(logits.shape)
        return logits
    monkeypatch.setattr(model, "forward", poisoned)


def test_non_finite_logits_fail_their_request_and_spare_the_rest(model, monkeypatch):
    prompts = random_prompts(2, [5], seed=21)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    bad, good = (engine.add_request(p, GREEDY) for p in prompts)
    engine.step()  # both prefilled, one token each
    poison_rows(model, monkeypatch, rows={0}, on_call=1)  # the next step: row 0 is `bad`'s decode
    with pytest.raises(NonFiniteLogitsError, match=rf"layer_norm_epsilon.*\['{bad}'\] were aborted"):
        engine.step()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_invariants()
    assert finished[bad].finish_reason == "abort" and len(finished[bad].output_token_ids) == 1
    assert finished[good].output_token_ids == reference(model, [prompts[1]])[0], "the healthy request lost nothing"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and engine.requests == {}


def test_nan_weights_are_an_error_not_a_token(model):
    broken = context_model()
    with torch.no_grad():
        broken.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN or inf"):
        kv_cache.generate(broken, [[1, 2, 3]], GREEDY)
    with pytest.raises(NonFiniteLogitsError):
        naive_decode.generate(broken, [1, 2, 3], GREEDY)
    engine = LLMEngine(broken, cache_config=CacheConfig(num_gpu_blocks_override=8))
    engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(NonFiniteLogitsError):
        engine.step()
    assert [o.finish_reason for o in engine.step()] == ["abort"] and not engine.has_unfinished_requests()
