"""Parallel sampling: n samples of one prompt, prefilled once, sharing its blocks until one writes (copy-on-write).

Every equivalence runs on a model whose next token depends on its context (tests/models.py): a sample that
read a block another sample wrote into would draw other tokens than its seed run alone.
"""
import pytest
import torch

from minillm import SamplingParams, kv_cache
from minillm.block_manager import BlockManager
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.parallel_sampling import group_blocks
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts

BS = 4


@pytest.fixture(scope="module")
def model():
    return context_model()


def engine_for(model, blocks=64, prefix=False, chunked=True, budget=64, seqs=8):
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                            enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS, num_gpu_blocks_override=blocks, enable_prefix_caching=prefix))


def drive(engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]]) -> list:
    """Add requests at the given steps, check the blocks after every step; the finished outputs in order of adding."""
    finals, ids, step = {}, [], 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for prompt, params in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, params))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after every request finished"
    return [finals[i] for i in ids]


def alone(model, prompt, params):
    """Each sample j of `params`, as the request with n=1 and seed + j returns it, each in an engine of its own."""
    return [engine_for(model).generate([prompt], SamplingParams(
        temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, ignore_eos=True,
        seed=params.seed + j))[0].output_token_ids for j in range(params.n)]


@pytest.mark.parametrize("length", [7, 8, 13])  # ends inside a block, on its boundary, inside a later one
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("budget", [64, 8])      # 8: the 13-token prompt is prefilled in chunks
def test_each_sample_equals_its_seed_run_alone(model, length, prefix, budget):
    prompt = random_prompts(1, [length], seed=length)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=9, seed=40, n=4, ignore_eos=True)
    engine = engine_for(model, prefix=prefix, budget=budget)
    (out,) = drive(engine, {0: [(prompt, params)]})
    got = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3] and out.finished
    assert got == alone(model, prompt, params)
    assert len({tuple(t) for t in got}) == 4, "samples seeded apart drew the same text"
    copies = 3 if length % BS else 0  # the shared partial block: copied by all samples but the last to write
    assert engine.block_manager.num_copies == copies


def test_the_prompt_is_prefilled_once(model):
    prompt = random_prompts(1, [10], seed=1)[0]
    engine = engine_for(model)
    drive(engine, {0: [(prompt, SamplingParams(temperature=1.0, max_tokens=5, seed=0, n=5, ignore_eos=True))]})
    assert sum(s.num_prefill_tokens for s in engine.timeline) == len(prompt)
    assert max(s.num_decode_tokens for s in engine.timeline) == 5


def test_samples_hold_the_blocks_that_block_arithmetic_predicts(model):
    P, T, n = 10, 7, 3  # 10 tokens: 2 full blocks shared and a partial one, copied twice
    engine = engine_for(model)
    engine.add_request(random_prompts(1, [P], seed=2)[0],
                       SamplingParams(temperature=1.0, max_tokens=T, seed=0, n=n, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    assert peak == group_blocks(P, P + T - 1, n, BS) == 2 + 3 * (4 - 2)
    assert peak < n * -(-(P + T - 1) // BS)


def test_greedy_samples_are_n_copies_of_the_greedy_text(model):
    prompt = random_prompts(1, [9], seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, n=3, ignore_eos=True)
    (out,) = drive(engine_for(model), {0: [(prompt, params)]})
    expected = kv_cache.generate(model, [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [expected] * 3


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("chunked", [True, False])
def test_groups_and_single_requests_under_preemption(model, prefix, chunked):
    """A pool too small for everyone: samples are preempted alone and recomputed, and each still equals its seed."""
    prompts = random_prompts(4, [5, 8, 11], seed=7)
    ps = [SamplingParams(temperature=1.0, max_tokens=10, seed=10 * i, n=1 + i % 3, ignore_eos=True)
          for i in range(4)]
    engine = engine_for(model, blocks=14, prefix=prefix, chunked=chunked)
    outs = drive(engine, {0: [(prompts[0], ps[0]), (prompts[1], ps[1])], 2: [(prompts[2], ps[2])],
                          3: [(prompts[3], ps[3])]})
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemptions"
    for prompt, params, out in zip(prompts, ps, outs):
        assert [o.token_ids for o in out.outputs] == alone(model, prompt, params)


def test_samples_that_find_the_batch_full_wait_and_still_match(model):
    """max_num_seqs=3, one request running: of 3 samples, one forks into the batch and one waits in the queue."""
    long, prompt = random_prompts(2, [6], seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, n=3, ignore_eos=True)
    engine = engine_for(model, seqs=3)
    outs = drive(engine, {0: [(long, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))],
                          1: [(prompt, params)]})
    assert [o.token_ids for o in outs[1].outputs] == alone(model, prompt, params)
    assert outs[1].num_preemptions == 0 and max(s.num_seqs for s in engine.timeline) <= 3


@pytest.mark.parametrize("after_steps", [1, 4])  # mid-prompt (chunks of 8), and after the samples forked
def test_abort_finishes_every_sample_and_frees_every_block(model, after_steps):
    engine = engine_for(model, budget=8)
    rid = engine.add_request(random_prompts(1, [14], seed=5)[0],
                             SamplingParams(temperature=1.0, max_tokens=30, seed=1, n=3, ignore_eos=True))
    for _ in range(after_steps):
        engine.step()
        engine.check_invariants()
    assert engine.abort_request(rid)
    (out,) = engine.step()
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request(rid) is False


def test_without_copy_on_write_the_invariant_names_the_shared_block(model, monkeypatch):
    """Break it on purpose: a sample that writes into the block its siblings read is caught after the step."""
    monkeypatch.setattr(BlockManager, "_shared_tail", lambda self, seq: None)
    engine = engine_for(model)
    engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(temperature=1.0, max_tokens=5, seed=0, n=2,
                                                          ignore_eos=True))
    with pytest.raises(AssertionError, match="is shared by sequences"):
        for _ in range(3):
            engine.step()
            engine.check_invariants()


def test_one_sample_reads_as_before_and_n_samples_say_where_to_read(model):
    engine = engine_for(model)
    one, two = engine.generate([[1, 2, 3]] * 2, [SamplingParams(temperature=0.0, max_tokens=3),
                                                 SamplingParams(temperature=0.0, max_tokens=3, n=2)])
    assert one.output_token_ids == one.outputs[0].token_ids and one.finish_reason == "length"
    with pytest.raises(AttributeError, match=r"2 samples \(n > 1\): read outputs\[i\]"):
        two.output_token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), r"n=0 must be ≥ 1"),
    (dict(n=True), r"n=True is a bool; it must be an integer"),
    (dict(n=2.0), r"n=2.0 is a float"),
    (dict(n=2, best_of=3), r"best_of=3 with n=2: .* best_of must equal n"),
    (dict(n=3, seed=2**64 - 2), r"seed \+ j, which must stay below 2\*\*64; pass a seed of at most"),
])
def test_bad_n_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_n_that_the_pool_or_the_batch_cannot_hold_is_refused(model):
    engine = engine_for(model, blocks=10, seqs=4)
    with pytest.raises(ValueError, match=r"4 samples of 17 tokens of KV = 14 blocks of 4, but the whole pool "
                                         r"has 10 blocks; lower n, max_tokens"):
        engine.add_request([1] * 8, SamplingParams(max_tokens=10, n=4))
    with pytest.raises(ValueError, match=r"n=5 samples run side by side, but max_num_seqs=4"):
        engine.add_request([1] * 2, SamplingParams(max_tokens=2, n=5))
    assert engine.requests == {} and SamplingParams(n=2, best_of=2).n == 2


def test_a_hostile_n_is_refused_before_a_single_sample_is_built(model, monkeypatch):
    """n = 10⁹ is refused by its count alone: building the samples first would take minutes and gigabytes."""
    from minillm import engine as engine_module
    engine, built = engine_for(model, seqs=4), []
    real = engine_module.sample_params
    def counted(params):  # a regression fails here rather than build 10⁹ samples
        built.append(params.n)
        assert params.n <= 4, f"the engine began building n={params.n} samples before checking n"
        return real(params)
    monkeypatch.setattr(engine_module, "sample_params", counted)
    with pytest.raises(ValueError, match=r"n=1000000000 samples run side by side, but max_num_seqs=4"):
        engine.add_request([1] * 2, SamplingParams(max_tokens=2, n=10**9))
    assert built == [], "n was checked only after the samples were built" and engine.requests == {}
    engine.add_request([1] * 2, SamplingParams(max_tokens=2, n=2))
    assert built == [2]


@pytest.mark.parametrize("after", [False, True])
def test_a_step_that_fails_at_the_copy_leaves_each_sample_its_own_tokens(model, after):
    """The first copy-on-write fails, before or after copying: the step is undone, and a sample whose copy was
    never made is recomputed rather than served a block of zeros."""
    prompt = random_prompts(1, [7], seed=12)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=8, n=3, ignore_eos=True)
    engine, calls = engine_for(model), [0]
    real = engine.cache.copy_blocks

    def failing(copies):
        calls[0] += 1
        if calls[0] == 1 and not after:
            raise RuntimeError("injected before the copy")
        real(copies)
        if calls[0] == 1:
            raise RuntimeError("injected after the copy")

    engine.cache.copy_blocks = failing
    engine.add_request(prompt, params)
    finals, failures = [], 0
    while engine.has_unfinished_requests():
        try:
            finals += [out for out in engine.step() if out.finished]
        except RuntimeError:
            failures += 1
        engine.check_invariants()
    assert failures == 1 and calls[0] >= 1
    assert [o.token_ids for o in finals[0].outputs] == alone(model, prompt, params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_aborting_one_sample_leaves_the_others_their_tokens(model):
    prompt = random_prompts(1, [9], seed=6)[0]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=30, n=3, ignore_eos=True)
    engine = engine_for(model)
    rid = engine.add_request(prompt, params)
    assert engine.abort_request(rid, 1) is False, "before the fork, sample 0 computes the prompt for them all"
    engine.step()
    assert engine.abort_request(rid, 1) is True and engine.abort_request(rid, 1) is False
    with pytest.raises(ValueError, match=r"index=3: request .* has samples 0 to 2"):
        engine.abort_request(rid, 3)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
        engine.check_invariants()
    want = alone(model, prompt, params)
    (out,) = finals
    assert [o.finish_reason for o in out.outputs] == ["length", "abort", "length"]
    assert [out.outputs[0].token_ids, out.outputs[2].token_ids] == [want[0], want[2]]
    assert out.outputs[1].token_ids == want[1][:1]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_timeline_counts_one_logits_row_for_a_prompt_of_n_samples(model):
    engine = engine_for(model)
    engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=3, seed=0, n=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.num_sampled for s in engine.timeline] == [1, 4, 4]  # the prompt's last row, then one per sample


def test_decoders_of_one_sample_refuse_n_rather_than_ignore_it(model):
    from minillm import naive_decode
    from minillm.speculative import NgramProposer, generate as speculate
    three = SamplingParams(temperature=1.0, max_tokens=3, n=3)
    for call, name in ((lambda: kv_cache.generate(model, [[1, 2]], three), "kv_cache.generate"),
                       (lambda: naive_decode.generate(model, [1, 2], three), "naive_decode.generate"),
                       (lambda: speculate(model, NgramProposer(), [1, 2], three, num_speculative_tokens=2), "speculative decoding")):
        with pytest.raises(ValueError, match=rf"n=3: {name} returns one sample per prompt; for n samples use "
                                             "LLMEngine"):
            call()


def full_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("blocks, seqs", [(64, 8), (64, 2), (10, 4)],
                         ids=["room", "batch-full", "preempted"])  # batch-full: samples wait for a place
def test_each_sample_has_its_own_logprobs_and_the_prompt_its_own(model, blocks, seqs):
    prompts = [random_prompts(1, [k], seed=4)[0] for k in (7, 9)]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, n=2, logprobs=1,
                            prompt_logprobs=1)
    outs = drive(engine_for(model, blocks=blocks, seqs=seqs), {0: [(prompts[0], params)], 1: [(prompts[1], params)]})
    assert (sum(o.num_preemptions for o in outs) > 0) == (blocks == 10)
    for prompt, out in zip(prompts, outs):
        assert [s.token_ids for s in out.outputs] == alone(model, prompt, params)
        assert out.outputs[0].logprobs is not out.outputs[1].logprobs
        for s in out.outputs:
            ref = full_logprobs(model, prompt + s.token_ids)
            assert [lp.token_id for lp in s.logprobs] == s.token_ids
            for k, lp in enumerate(s.logprobs):
                assert abs(lp.logprob - ref[len(prompt) + k - 1, lp.token_id].item()) < 1e-4
                assert lp.top[0][0] == ref[len(prompt) + k - 1].argmax().item()
        ref = full_logprobs(model, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[pos].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_penalties_and_min_tokens_read_each_samples_own_tokens(model):
    prompt = random_prompts(1, [9], seed=6)[0]
    knobs = dict(temperature=1.0, seed=9, max_tokens=10, presence_penalty=1.5, frequency_penalty=1.0,
                 repetition_penalty=1.3, min_tokens=4)
    group = engine_for(model).generate([prompt], SamplingParams(**knobs, n=3))[0]
    singles = [engine_for(model).generate([prompt], SamplingParams(**{**knobs, "seed": knobs["seed"] + j}))[0]
               for j in range(3)]
    assert [s.token_ids for s in group.outputs] == [s.output_token_ids for s in singles]
    plain = [engine_for(model).generate([prompt], SamplingParams(temperature=1.0, seed=9 + j, max_tokens=10))[0]
             for j in range(3)]
    assert [s.token_ids for s in group.outputs] != [s.output_token_ids for s in plain]  # the penalties did act
