"""The vectorised sampler: one pass for the whole batch, each row under its own parameters and its own seed.

The draw is the exponential race, argmax(p / E) with E ~ Exp(1) per token; these
tests hold it to the distribution it claims, to each row's own top-k and top-p,
and to a seeded row's independence from whatever shares its batch.
"""
import numpy as np
import pytest
import torch

from minillm.config import PRESETS
from minillm.request_checks import check_prompt
from minillm.sampling import sample
from minillm.sampling_params import SamplingParams


def logits_rows(n, vocab=40, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def seeded(seed, **kw):
    return SamplingParams(temperature=kw.pop("temperature", 0.8), seed=seed, **kw)


def draw(logits, params, steps=6):
    """Tokens of `steps` calls, each row with a fresh generator per seeded row, as a request keeps one."""
    gens = [None if sp.seed is None else torch.Generator().manual_seed(sp.seed) for sp in params]
    return [sample(logits, params, gens) for _ in range(steps)]


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    x = logits_rows(1, seed=3)
    row = seeded(7, top_k=10, top_p=0.9)
    alone = [t[0] for t in draw(x, [row])]
    crowd = torch.cat([logits_rows(2, seed=4), x, logits_rows(2, seed=5)])
    neighbours = [SamplingParams(temperature=0.0), seeded(8, top_p=0.5), row, SamplingParams(temperature=1.3),
                  seeded(9, top_k=3)]
    assert [t[2] for t in draw(crowd, neighbours)] == alone
    assert len(set(alone)) > 1, "the row was meant to draw different tokens at different steps"


def test_greedy_rows_are_the_argmax_beside_sampled_rows():
    x = logits_rows(4, seed=1)
    params = [SamplingParams(temperature=0.0), seeded(1), SamplingParams(temperature=0.0), seeded(2, top_k=1)]
    tokens = sample(x, params, [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)])
    top = x.argmax(-1).tolist()
    assert tokens[0] == top[0] and tokens[2] == top[2] and tokens[3] == top[3]  # top_k=1 leaves one token


def test_the_exponential_race_draws_from_the_softmax():
    """20,000 rows of the same logits drawn at once: each token's frequency is its probability (4 σ)."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20_000
    tokens = torch.tensor(sample(probs.log().expand(n, 5), [SamplingParams(temperature=1.0)] * n))
    freq = torch.bincount(tokens, minlength=5).float() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma).all(), (freq, probs)


def test_temperature_top_k_and_top_p_apply_per_row():
    """One batch, four settings: each row only ever draws from the tokens its own settings allow."""
    torch.manual_seed(1)
    base = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])  # probabilities ~ 0.64, 0.23, 0.09, 0.03, ...
    settings = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7),
                SamplingParams(temperature=1.0, top_k=3, top_p=0.99), SamplingParams(temperature=50.0)]
    allowed = [{0, 1}, {0, 1}, {0, 1, 2}, set(range(6))]
    n = 500
    params = [sp for sp in settings for _ in range(n)]
    tokens = sample(base.expand(len(params), 6).clone(), params)
    for i, allow in enumerate(allowed):
        drawn = set(tokens[i * n:(i + 1) * n])
        assert drawn <= allow, (i, drawn, allow)
        assert len(drawn) == len(allow) or i == 3, (i, drawn)  # every allowed token shows up in 500 draws
    assert len(set(tokens[3 * n:])) >= 5, "a hot temperature flattens the distribution"


def test_non_finite_logits_raise_and_name_the_rows():
    x = logits_rows(3)
    x[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] hold NaN.*layer_norm_epsilon"):
        sample(x, [SamplingParams(temperature=0.0)] * 3)
    x[1, 4], x[2, 0] = 0.0, float("inf")
    with pytest.raises(ValueError, match=r"row\(s\) \[2\]"):
        sample(x, [seeded(1)] * 3, [torch.Generator().manual_seed(1)] * 3)


def test_no_rows_sample_nothing():
    assert sample(torch.zeros(0, 8), []) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_seeded_row_is_independent_of_its_batch_and_the_step_syncs_once():
    x = logits_rows(5, seed=2).cuda()
    row = seeded(11, top_p=0.8)

    def run(rows, params):
        gens = [None if sp.seed is None else torch.Generator("cuda").manual_seed(sp.seed) for sp in params]
        return [sample(rows, params, gens) for _ in range(5)]
    alone = [t[0] for t in run(x[2:3], [row])]
    params = [SamplingParams(temperature=0.0), seeded(3, top_k=5), row, SamplingParams(temperature=1.0), seeded(4)]
    assert [t[2] for t in run(x, params)] == alone
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sample(x, params, [None if sp.seed is None else torch.Generator("cuda").manual_seed(1) for sp in params])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


# ---- a prompt is checked once per request ------------------------------------------

CFG = PRESETS["tiny"]


@pytest.mark.parametrize("prompt, max_tokens, match", [
    ([], 0, "prompt is empty"),
    ([1] * 129, 0, "129 tokens but the context holds n_ctx=128"),
    ([1] * 100, 40, "lower max_tokens to at most 29"),
    ([1] * 128, 2, "lower max_tokens to at most 1"),
    ([1, 512], 0, "token id 512 at position 1 is outside the vocabulary \\[0, 512\\)"),
    ([1, -3], 0, "token id -3"),
])
def test_bad_prompts_get_clear_errors(prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        check_prompt(CFG, prompt, max_tokens)


def test_the_context_limit_counts_the_kv_a_sequence_holds():
    """prompt + max_tokens − 1 tokens of KV must fit: the last sampled token is never fed."""
    check_prompt(CFG, [1] * 128, 1)
    check_prompt(CFG, [1] * 100, 29)


def test_any_integer_type_is_a_token_id():
    assert check_prompt(CFG, [np.int32(5), torch.tensor(7), True + 0]) == [5, 7, 1]
    assert all(type(t) is int for t in check_prompt(CFG, np.array([1, 2], dtype=np.uint16)))
