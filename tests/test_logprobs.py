"""Log-probabilities (minillm/logprobs.py): the prompt's and the generated tokens', against log_softmax of the
model's full forward pass, through chunked prefill, the prefix cache and preemption."""
import pytest
import torch

from minillm import SamplingParams
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts

ATOL = 1e-4  # fp32: the paged path and the full forward pass differ by summation order only


@pytest.fixture(scope="module")
def model():
    return context_model()


def full_logprobs(model, ids) -> torch.Tensor:
    """(T, V) log_softmax of one full forward pass: row q is the distribution of token q + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def check(model, out, k):
    prompt, gen = list(out.prompt_token_ids), out.output_token_ids
    ref = full_logprobs(model, prompt + gen)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - ref[pos - 1, prompt[pos]].item()) < ATOL
        top = ref[pos - 1].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - w) < ATOL for (_, v), w in zip(lp.top, top.values.tolist()))
    assert len(out.logprobs) == len(gen)
    for i, lp in enumerate(out.logprobs):
        row = len(prompt) - 1 + i
        assert lp.token_id == gen[i] and abs(lp.logprob - ref[row, gen[i]].item()) < ATOL
        assert len(lp.top) == k and lp.top[0][0] == int(ref[row].argmax())


def engine(model, budget=256, prefix=False, blocks=128, block_size=4):
    return LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4,
                                            enable_chunked_prefill=True),
                     CacheConfig(num_gpu_blocks_override=blocks, block_size=block_size, enable_prefix_caching=prefix))


@pytest.mark.parametrize("budget", [256, 7])  # 7: every prompt is cut into chunks of at most 7 tokens
def test_prompt_and_sample_logprobs_are_the_full_forward_pass(model, budget):
    prompts = random_prompts(3, [12, 23, 30], seed=1)
    sp = SamplingParams(temperature=0.8, seed=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = engine(model, budget).generate(prompts + prompts[:1], [sp] * 3 + [SamplingParams(max_tokens=3)])
    for out in outs[:3]:
        check(model, out, 3)
    assert outs[3].logprobs is None and outs[3].prompt_logprobs is None


def test_logprobs_are_taken_before_penalties_and_temperature(model):
    prompt = random_prompts(1, [10], seed=2)[0]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                        frequency_penalty=2.0, repetition_penalty=1.5)
    check(model, engine(model).generate([prompt], sp)[0], 2)


def test_a_prompt_logprobs_request_takes_nothing_from_the_prefix_cache(model):
    prompt = random_prompts(1, [33], seed=4)[0]
    eng = engine(model, budget=16, prefix=True)
    first = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    again = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32, "the cache should hold the prompt"
    scored = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0
    check(model, scored, 1)
    eng.check_invariants()


def test_a_preempted_request_records_each_prompt_position_once(model):
    prompts = random_prompts(4, [20, 24], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    eng = engine(model, budget=16, blocks=24)
    outs = eng.generate(prompts, sp)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool should be small enough to preempt"
    for out in outs:
        check(model, out, 1)


def test_only_requests_that_ask_pay_for_prompt_rows(model):
    """The LM head runs at every prompt position only for a request with prompt_logprobs; the others' prefill
    chunks still ask the model for their sampling row alone."""
    eng = engine(model)
    rows = []
    forward = eng.model.forward

    def recording(*args, logits_indices=None, **kw):
        rows.append(None if logits_indices is None else len(logits_indices))
        return forward(*args, logits_indices=logits_indices, **kw)
    eng.model.forward = recording
    try:
        prompts = random_prompts(2, [20], seed=6)
        eng.generate(prompts, SamplingParams(max_tokens=2, logprobs=5))  # logprobs of samples: no extra rows
        assert rows[0] == 2
        rows.clear()
        eng.generate(prompts, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=0)])
        assert rows[0] == 2 + 19  # two sampling rows, and the 19 positions the second prompt scores
    finally:
        del eng.model.forward
