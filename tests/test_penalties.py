"""Penalties and min_tokens (minillm/penalties.py): each formula against the logits by hand, and greedy decoding
with a penalty against a reference loop over the full forward pass."""
import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.penalties import apply_penalties
from minillm.sampling import sample
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts

CFG = PRESETS["tiny"]


def by_formula(z: torch.Tensor, prompt, output, sp: SamplingParams, eos=None) -> torch.Tensor:
    """One row, token by token, as vLLM and OpenAI write the formulas."""
    z = z.clone()
    for t in range(z.shape[0]):
        c = output.count(t)
        if (t in prompt or c) and sp.repetition_penalty != 1.0:
            z[t] = z[t] / sp.repetition_penalty if z[t] > 0 else z[t] * sp.repetition_penalty
        z[t] = z[t] - sp.frequency_penalty * c - sp.presence_penalty * (c > 0)
    if len(output) < sp.min_tokens:
        for t in [*sp.stop_token_ids, *([] if sp.ignore_eos or eos is None else [eos])]:
            z[t] = float("-inf")
    return z


def test_each_penalty_matches_its_formula_and_rows_that_do_not_ask_are_untouched():
    z = torch.randn(5, 30, generator=torch.Generator().manual_seed(0)) * 3
    hist = [([1, 2, 3], [4, 4, 5]), ([7, 8], [8, 8, 8, 9]), ([0], [1]), ([2, 5], [5, 6]), ([3], [])]
    params = [SamplingParams(frequency_penalty=0.7), SamplingParams(presence_penalty=-1.5, repetition_penalty=1.3),
              SamplingParams(), SamplingParams(repetition_penalty=0.6, frequency_penalty=2, presence_penalty=2),
              SamplingParams(min_tokens=2, stop_token_ids=(11,))]
    before = z.clone()
    got = apply_penalties(z, params, hist, eos_token_id=29)
    assert torch.equal(z, before), "the raw logits must stay as they are (logprobs read them)"
    for i, (sp, (p, o)) in enumerate(zip(params, hist)):
        torch.testing.assert_close(got[i], by_formula(z[i], p, o, sp, eos=29), rtol=0, atol=1e-6)
    assert torch.equal(got[2], z[2])
    assert apply_penalties(z, [SamplingParams()] * 5, None) is z, "no penalty: the same tensor, nothing built"


def test_greedy_with_a_penalty_takes_the_argmax_of_the_penalized_logits():
    z = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    assert sample(z, [SamplingParams(temperature=0)]) == [1]
    assert sample(z, [SamplingParams(temperature=0, frequency_penalty=0.5)], histories=[((0,), [1])]) == [2]


def test_min_tokens_masks_the_end_until_enough_are_generated():
    z = torch.tensor([[0.0, 9.0, 1.0]])
    sp = SamplingParams(temperature=0, min_tokens=2)
    assert sample(z, [sp], histories=[((0,), [2])], eos_token_id=1) == [2]
    assert sample(z, [sp], histories=[((0,), [2, 2])], eos_token_id=1) == [1]


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_with_frequency_penalty_is_the_reference_loop(chunked):
    model = context_model()
    prompts = random_prompts(3, [5, 9, 14], seed=3)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0, presence_penalty=0.5)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=8 if chunked else 64,
                                              enable_chunked_prefill=chunked, max_num_seqs=8),
                       CacheConfig(num_gpu_blocks_override=64, block_size=4))
    outs = engine.generate(prompts + prompts, [sp] * 3 + [plain] * 3)
    for prompt, out, base in zip(prompts, outs[:3], outs[3:]):
        ids, gen = list(prompt), []
        with torch.no_grad():
            for _ in range(16):
                z = model(torch.tensor([ids]))[0, -1].float()
                z = by_formula(z, prompt, gen, sp)
                gen.append(int(z.argmax()))
                ids.append(gen[-1])
        assert out.output_token_ids == gen
        assert out.output_token_ids != base.output_token_ids, "the penalty should change this greedy sequence"
        assert max(gen.count(t) for t in gen) < max(base.output_token_ids.count(t) for t in base.output_token_ids)
