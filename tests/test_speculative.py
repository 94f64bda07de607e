"""Speculative decoding changes how fast the target's tokens come, never which tokens (or which distribution).

Greedy runs are compared with the target's own `kv_cache.generate`, token for
token, on a model whose next token depends on its context (tests/models.py),
with drafts that always agree, mostly agree, almost never agree, and prompt
lookup. Sampled runs are compared with the exact distribution of the target's
own sampling, computed by enumeration on a model with a 4-token vocabulary, by
a chi-square test at a fixed significance level over seeded runs; the same test
is shown to reject deliberately broken acceptance rules.
"""
import math

import pytest
import torch

from minillm import PRESETS, SamplingParams, kv_cache
from minillm import speculative
from minillm.config import GPT2Config
from minillm.kv_cache import KVCache, Segment
from minillm.speculative import (NgramProposer, SpecDecodingStats, SpeculativeDecoder, expected_speedup,
                                 expected_tokens_per_pass)
from models import context_model, random_prompts

CFG = PRESETS["tiny"]
GAMMAS = range(1, 9)
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
DRAFTS = ("target itself", "noisy copy", "other init", "prompt lookup")


@pytest.fixture(scope="module")
def target():
    return context_model()


def noisy_copy(model, noise: float = 0.05, seed: int = 5):
    """The target's weights plus Gaussian noise: a draft that agrees with it often, not always."""
    copy = context_model(model.config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return copy


def make_draft(kind, target):
    return {"target itself": lambda: target, "noisy copy": lambda: noisy_copy(target),
            "other init": lambda: context_model(target.config, seed=1),
            "prompt lookup": lambda: NgramProposer(prompt_lookup_max=3)}[kind]()


def prompts_with_repeats(seed: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat themselves, so that prompt lookup finds matches."""
    prompts = random_prompts(5, [1, 4, 19, 40], seed=seed)
    return prompts + [p * 3 + p[:len(p) // 2] for p in random_prompts(2, [3, 7], seed=seed + 1)]


def check_accounting(out, gamma, draft_kind):
    """The statistics add up: new tokens = accepted + target passes, minus what a stop token cut off."""
    s = out.stats
    assert 0 <= s.num_accepted_tokens <= s.num_draft_tokens <= gamma * s.num_target_passes, s
    assert s.num_rejections <= s.num_target_passes, s
    cut = s.num_accepted_tokens + s.num_target_passes - len(out.token_ids)
    assert 0 <= cut <= gamma and (cut == 0 or out.finish_reason == "stop"), (cut, out)
    assert s.num_draft_passes == (0 if draft_kind == "prompt lookup" else s.num_draft_tokens), s
    return cut


def add(total: SpecDecodingStats, s: SpecDecodingStats) -> None:
    for name in vars(total):
        setattr(total, name, getattr(total, name) + getattr(s, name))


# ---- greedy: the target's own tokens -----------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_tokens_are_the_targets_own_for_every_gamma(target, kind):
    draft, total = make_draft(kind, target), SpecDecodingStats()
    for p in prompts_with_repeats(seed=2):
        want = kv_cache.generate(target, [p], GREEDY)[0]
        for gamma in GAMMAS:
            out = speculative.generate(target, draft, p, GREEDY, num_speculative_tokens=gamma)
            assert out.token_ids == want, f"{kind} draft, γ={gamma}, prompt {p}"
            assert out.finish_reason == "length"
            check_accounting(out, gamma, kind)
            add(total, out.stats)
    # The run covered the rule's branches this draft can reach.
    if kind == "target itself":
        assert total.num_rejections == 0 and total.num_accepted_tokens == total.num_draft_tokens > 0, total
    else:
        assert total.num_rejections > 0, total
    if kind in ("noisy copy", "prompt lookup"):
        assert total.num_accepted_tokens > 0, total
    if kind == "other init":   # a draft that disagrees: almost every round is one target token
        assert total.alpha < 0.1, total


@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_stops_where_the_target_stops(target, kind):
    """End-of-text, a stop token, max_tokens and the context limit end a speculative run where they end the
    target's, even when the stop token is a guess accepted in the middle of a round."""
    draft, cuts = make_draft(kind, target), 0
    long_run = kv_cache.generate(target, [[7, 8, 9]], GREEDY)[0]
    eos = long_run[5]
    eos_target = context_model(CFG.with_(eos_token_id=eos))   # same seed and shapes: the same weights
    cases = [(target, [7, 8, 9], SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[long_run[4]])),
             (eos_target, [7, 8, 9], SamplingParams(temperature=0, max_tokens=14)),
             (eos_target, [7, 8, 9], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))]
    cases += [(target, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
              for p in random_prompts(2, [2, 9], seed=3) for m in (1, 2, 3, 7)]
    cases += [(target, p, SamplingParams(temperature=0, max_tokens=CFG.n_ctx - len(p) + 1, ignore_eos=True))
              for p in random_prompts(2, [CFG.n_ctx - 10, CFG.n_ctx], seed=4)]   # up to the context limit
    for model, p, params in cases:
        want = kv_cache.generate(model, [p], params)[0]
        d = model if kind == "target itself" else draft
        for gamma in GAMMAS:
            out = speculative.generate(model, d, p, params, num_speculative_tokens=gamma)
            assert out.token_ids == want, f"{kind} draft, γ={gamma}, {params}, prompt of {len(p)}"
            assert len(p) + len(out.token_ids) - 1 <= CFG.n_ctx
            cuts += check_accounting(out, gamma, kind) > 0
    assert eos in long_run[:6] and long_run[4] in long_run[:5]
    if kind == "target itself":   # every guess is accepted, so stop tokens land mid-round and cut it short
        assert cuts > 0


def test_the_target_cache_holds_exactly_the_sequence_after_every_round(target):
    """After each round the target's cached length is the sequence minus its newest token, and the
    first `num_cached` slots hold what a fresh prefill of those tokens computes: nothing a rejected guess
    wrote is inside. The draft model's cache holds a prefix of the sequence in the same way."""
    prompt = random_prompts(1, [11], seed=6)[0]
    for draft, params in [(noisy_copy(target), GREEDY),
                          (context_model(seed=1), SamplingParams(temperature=1.0, max_tokens=14, seed=0))]:
        dec = SpeculativeDecoder(target, draft, prompt, params, num_speculative_tokens=4)
        rounds = 0
        while dec.finish_reason is None:
            dec.step()
            rounds += 1
            n = dec.num_cached
            assert n == len(dec.token_ids) - 1 == len(prompt) + len(dec.output) - 1
            for model, cache, m in [(target, dec.cache, n), (draft, dec.draft.cache, dec.draft.num_cached)]:
                assert m <= n
                fresh = KVCache(model.config, 1, m)
                with torch.no_grad():
                    model(torch.tensor([dec.token_ids[:m]]), fresh.prepare([Segment(0, 0, m)]).positions, cache=fresh)
                torch.testing.assert_close(cache.k[:, :, :, :m], fresh.k, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(cache.v[:, :, :, :m], fresh.v, atol=1e-4, rtol=1e-4)
        assert dec.stats.num_rejections > 0 and rounds == dec.stats.num_target_passes
        with pytest.raises(RuntimeError, match="has finished"):
            dec.step()


# ---- prompt lookup --------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, k, lookup, want", [
    ([1, 2, 3, 4, 2, 3], 4, (3, 2), [4, 2, 3]),        # vLLM's example: [4,2,3] unmatched, [2,3] matches
    ([1, 2, 3, 4, 2, 3], 1, (3, 2), [4]),
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, (2, 1), [9, 1]),  # the earliest occurrence wins
    ([5, 6, 7, 6, 8, 5, 6], 3, (3, 1), [7, 6, 8]),     # the longest n wins: [5,6] over [6]
    ([1, 2, 3], 3, (3, 1), []),                       # no match, no guesses
    ([4, 4], 3, (3, 1), [4]),
    ([4], 3, (3, 1), []),
    ([9, 1, 2, 3, 1, 2], 2, (3, 3), []),               # nothing of length 3 repeats
])
def test_prompt_lookup_proposes_what_followed_the_longest_match(tokens, k, lookup, want):
    guesses, q = NgramProposer(*lookup).propose(tokens, k, GREEDY, None)
    assert guesses == want and q is None


# ---- sampling: the target's own distribution ---------------------------------------------------

TINY_VOCAB = GPT2Config(n_layer=1, n_head=2, n_embd=16, n_ctx=16, vocab_size=4, eos_token_id=None)
SIGNIFICANCE = 1e-3     # the chi-square test's fixed level
NUM_RUNS = 1000         # seeded runs per distribution, seeds 0 .. NUM_RUNS − 1
K = 3                   # tokens per run: 4³ = 64 possible sequences
PROMPT = [0, 1, 2]


@pytest.fixture(scope="module")
def vocab4():
    """A target and an unrelated draft over a 4-token vocabulary; their distributions differ a lot."""
    return context_model(TINY_VOCAB, seed=0, std=0.5), context_model(TINY_VOCAB, seed=1, std=0.5)


def kept(logits: list[float], params: SamplingParams) -> list[float]:
    """sampling.py's definition, written out one token at a time: temperature, then the k most likely, then
    the smallest set of most likely tokens whose probability reaches top_p; the probabilities renormalised."""
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if params.top_k > 0:
        order = order[:params.top_k]
    z = sum(math.exp(scaled[i]) for i in order)
    keep, mass = [], 0.0
    for i in order:
        if mass >= params.top_p:
            break
        keep.append(i)
        mass += math.exp(scaled[i]) / z
    z = sum(math.exp(scaled[i]) for i in keep)
    return [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(logits))]


def exact_distribution(model, prompt, params, k=K) -> dict[tuple, float]:
    """P(first k tokens) under the target's own sampling, by enumerating every prefix through the model."""
    dist = {(): 1.0}
    with torch.no_grad():
        for _ in range(k):
            nxt = {}
            for seq, pr in dist.items():
                logits = model(torch.tensor([prompt + list(seq)]))[0, -1].double().tolist()
                for t, pt in enumerate(kept(logits, params)):
                    nxt[seq + (t,)] = pr * pt
            dist = nxt
    return dist


def chi_square_p_value(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Pearson's goodness of fit; sequences expected fewer than 5 times are pooled into one bin. A sequence
    the target can never produce (probability 0) that was seen anyway gives p = 0."""
    if any(counts.get(seq, 0) for seq, pr in expected.items() if pr == 0) or set(counts) - set(expected):
        return 0.0
    big = [seq for seq, pr in expected.items() if pr * n >= 5]
    rest = [seq for seq, pr in expected.items() if 0 < pr * n < 5]
    bins = [([seq], expected[seq] * n) for seq in big]
    if rest:
        bins.append((rest, sum(expected[seq] for seq in rest) * n))
    stat = sum((sum(counts.get(s, 0) for s in seqs) - e) ** 2 / e for seqs, e in bins)
    df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def speculative_counts(target, draft, params, gamma, prompt=PROMPT) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for seed in range(NUM_RUNS):
        sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            max_tokens=K, seed=seed, ignore_eos=True)
        seq = tuple(speculative.generate(target, draft, prompt, sp, num_speculative_tokens=gamma).token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def test_chi_square_oracle_is_the_targets_own_sampling(vocab4):
    """The enumerated distribution is what `kv_cache.generate` samples from: the oracle is the right one."""
    target, _ = vocab4
    params = SamplingParams(temperature=0.9, top_k=3, max_tokens=K, ignore_eos=True)
    counts: dict[tuple, int] = {}
    for seed in range(NUM_RUNS):
        sp = SamplingParams(temperature=0.9, top_k=3, max_tokens=K, seed=seed, ignore_eos=True)
        seq = tuple(kv_cache.generate(target, [PROMPT], sp)[0])
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_p_value(counts, exact_distribution(target, PROMPT, params), NUM_RUNS) > SIGNIFICANCE


SAMPLED_CASES = {   # name: (draft, params, γ)
    "model draft, T=1.3 top-p 0.7, γ=3": ("model", SamplingParams(temperature=1.3, top_p=0.7), 3),
    "prompt lookup, T=0.8 top-k 3, γ=3": ("lookup", SamplingParams(temperature=0.8, top_k=3), 3),
}
SLOW_SAMPLED_CASES = {
    "model draft, T=1, γ=1": ("model", SamplingParams(temperature=1.0), 1),
    "model draft, T=0.7 top-k 2, γ=4": ("model", SamplingParams(temperature=0.7, top_k=2), 4),
    "model draft, T=1, γ=2": ("model", SamplingParams(temperature=1.0), 2),
    "prompt lookup, T=1, γ=5": ("lookup", SamplingParams(temperature=1.0), 5),
}


def sampled_case(vocab4, name):
    target, draft = vocab4
    kind, params, gamma = {**SAMPLED_CASES, **SLOW_SAMPLED_CASES}[name]
    draft = draft if kind == "model" else NgramProposer(prompt_lookup_max=2)
    prompt = PROMPT if kind == "model" else [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]   # repeats: lookup has guesses
    return target, draft, params, gamma, prompt


@pytest.mark.parametrize("name", [*SAMPLED_CASES, *(pytest.param(n, marks=pytest.mark.slow)
                                                    for n in SLOW_SAMPLED_CASES)])
def test_sampled_tokens_follow_the_targets_distribution(vocab4, name):
    target, draft, params, gamma, prompt = sampled_case(vocab4, name)
    counts = speculative_counts(target, draft, params, gamma, prompt)
    p_value = chi_square_p_value(counts, exact_distribution(target, prompt, params), NUM_RUNS)
    assert p_value > SIGNIFICANCE, f"{name}: χ² p = {p_value:.2g}"


def accept_every_guess(guesses, q, p, generator=None):
    return guesses + [int(torch.multinomial(p[-1], 1, generator=generator))]


def resample_from_p(guesses, q, p, generator=None):
    """The real rule's accepted guesses, but a refused guess's replacement drawn from p instead of the residual."""
    emitted = speculative_rule(guesses, q, p, generator)
    if len(emitted) <= len(guesses):   # a guess was refused: its replacement is the last token
        emitted[-1] = int(torch.multinomial(p[len(emitted) - 1], 1, generator=generator))
    return emitted


def inverted_ratio(guesses, q, p, generator=None):
    """The real rule with the draft's and the target's roles swapped on the guessed positions: it accepts with
    probability min(1, q/p). (Built on the rule under test, so that this file holds no rule of its own.)"""
    k = len(guesses)
    return speculative_rule(guesses, p[:k], torch.cat([q, p[k:]]), generator)


def bonus_from_the_last_guess_row(guesses, q, p, generator=None):
    """Correct, except that after every guess is accepted the bonus comes from the last guess's row of p."""
    emitted = speculative_rule(guesses, q, p, generator)
    if len(emitted) == len(guesses) + 1 and guesses:
        emitted[-1] = int(torch.multinomial(p[-2], 1, generator=generator))
    return emitted


speculative_rule = speculative.rejection_sample
BROKEN = {"resample from p": resample_from_p, "accept every guess": accept_every_guess,
          "inverted ratio": inverted_ratio, "bonus from the wrong row": bonus_from_the_last_guess_row}


@pytest.mark.parametrize("broken", ["resample from p", *(pytest.param(b, marks=pytest.mark.slow)
                                                         for b in BROKEN if b != "resample from p")])
def test_the_chi_square_test_rejects_a_broken_rule(vocab4, monkeypatch, broken):
    """The distribution test can fail: the same runs with a wrong acceptance rule are rejected at the same level."""
    monkeypatch.setattr(speculative, "rejection_sample", BROKEN[broken])
    target, draft, params, gamma, prompt = sampled_case(vocab4, "model draft, T=1, γ=2")
    counts = speculative_counts(target, draft, params, gamma, prompt)
    p_value = chi_square_p_value(counts, exact_distribution(target, prompt, params), NUM_RUNS)
    assert p_value < SIGNIFICANCE, f"a {broken} rule passed the distribution test (χ² p = {p_value:.2g})"


@pytest.mark.parametrize("kind", ["other init", "noisy copy", "prompt lookup"])
def test_sampled_runs_stop_and_add_up_like_greedy_ones(target, kind):
    """Sampling, with a stop token drawn often enough to land inside rounds: the output ends at its first stop
    token or at max_tokens, and the statistics add up."""
    draft = make_draft(kind, target)
    for seed, p in enumerate(prompts_with_repeats(seed=10)):
        stop = SamplingParams(temperature=1.0, top_k=3, max_tokens=12, seed=seed, ignore_eos=True)
        first = speculative.generate(target, draft, p, stop, num_speculative_tokens=4).token_ids
        params = SamplingParams(temperature=1.0, top_k=3, max_tokens=12, seed=seed, stop_token_ids=[first[3]],
                                ignore_eos=True)
        for gamma in (1, 3, 8):
            out = speculative.generate(target, draft, p, params, num_speculative_tokens=gamma)
            stops = [i for i, t in enumerate(out.token_ids) if t == first[3]]
            assert stops in ([], [len(out.token_ids) - 1]), out.token_ids
            assert out.finish_reason == ("stop" if stops else "length") and len(out.token_ids) <= 12
            check_accounting(out, gamma, kind)


def test_seeds_are_honoured(target):
    p = random_prompts(1, [6], seed=8)[0]
    draft = context_model(seed=1)

    def run(seed):
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=seed, ignore_eos=True)
        return speculative.generate(target, draft, p, sp, num_speculative_tokens=3).token_ids

    assert run(3) == run(3) and run(3) != run(4)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert len(speculative.generate(target, NgramProposer(), p, unseeded, num_speculative_tokens=3).token_ids) == 12


# ---- the formula and the call's errors ---------------------------------------------------------


def test_expected_tokens_and_speedup():
    assert expected_tokens_per_pass(0.0, 5) == 1.0 and expected_tokens_per_pass(1.0, 5) == 6.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(0.0, 4, 0.25) == pytest.approx(0.5)   # a draft that never agrees halves the speed
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert SpecDecodingStats(num_accepted_tokens=6, num_rejections=2, num_draft_tokens=20).alpha == 0.75


def test_bad_calls_get_clear_errors(target):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 must be an integer ≥ 1"):
        speculative.generate(target, target, [1, 2], GREEDY, num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=2.5"):
        speculative.generate(target, target, [1, 2], GREEDY, num_speculative_tokens=2.5)
    other_vocab = context_model(CFG.with_(vocab_size=600))
    with pytest.raises(ValueError, match=r"vocabulary \(600 tokens\) differs from the target's \(512\)"):
        speculative.generate(target, other_vocab, [1, 2], GREEDY, num_speculative_tokens=2)
    short = context_model(CFG.with_(n_ctx=16))
    with pytest.raises(ValueError, match=r"draft's context n_ctx=16 is shorter than this request's 20 tokens"):
        speculative.generate(target, short, list(range(7)), GREEDY, num_speculative_tokens=2)
    with pytest.raises(TypeError, match="draft must be a GPT2 .* or an NgramProposer"):
        speculative.generate(target, "gpt2", [1, 2], GREEDY, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="prompt_lookup_min=3 and prompt_lookup_max=2"):
        NgramProposer(prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative.generate(target, NgramProposer(), [], GREEDY, num_speculative_tokens=2)

