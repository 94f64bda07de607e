"""Speculative decoding: spend the compute that decode leaves idle.

Why it exists
-------------
A decode step is memory-bound (lessons 02 and 04): it reads every weight once
for about 2 FLOPs per weight, 0.5 FLOP/B in fp32. Fed k tokens, it still reads
each weight once, so until k · 0.5 FLOP/B nears the ridge point it costs about
what a one-token step costs (where the k-row kernel streams the weights as fast
as the one-row one; CPU BLAS often does not, and lesson 14 measures it). So
*checking* k tokens is nearly free; a cheap drafter supplies tokens to check:

    draft     guess the next γ tokens d_1 .. d_γ                 (γ cheap steps, or a lookup)
    verify    one target pass over [last token, d_1 .. d_γ]       → its distributions p_1 .. p_γ+1
    keep      the longest prefix of the guesses the target accepts, then one token of the target's own

so a round emits 1 to γ + 1 tokens for one target pass. Two drafters: a smaller
GPT-2 with the same vocabulary (`gpt2` for `gpt2-xl`) on its own KV cache, and
prompt lookup (vLLM's "ngram"), which finds the last n tokens earlier in the
sequence and proposes what followed them, at no model cost.

The acceptance rule (Leviathan et al. 2023; Chen et al. 2023)
-------------------------------------------------------------
Greedy: accept d_i while it is the target's argmax; the first disagreement is
replaced by the target's argmax. The tokens are the target's greedy tokens, exactly.
Sampling: accept d_i ~ q_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection emit a token from norm(max(0, p_i − q_i)) and stop; after γ accepts, a bonus
token from p_γ+1. The emitted token is distributed as p:

    P(x) = q(x) · min(1, p(x)/q(x))  +  P(reject) · max(0, p(x) − q(x)) / Σ_y max(0, p(y) − q(y))
         = min(p(x), q(x))           +  max(0, p(x) − q(x))              = p(x)

since P(reject) = 1 − Σ_y min(p(y), q(y)) = Σ_y max(0, p(y) − q(y)). Temperature,
top-k and top-p shape p and q as `sampling.py` defines them, so speculation changes
how fast tokens come, never their distribution. Prompt lookup is q = δ(d): accept
with probability p(d).

What it costs, and when it pays
-------------------------------
If each guess survives with probability α, a round emits on average
(1 − α^(γ+1)) / (1 − α) tokens per target pass. With c = draft step ÷ target
step, a round costs γc + 1 target steps, so the expected speedup is
(1 − α^(γ+1)) / ((1 − α) · (γc + 1)) (Leviathan et al., Theorem 3.8). At α = 0
a round still emits one token, yet pays γ draft steps and a wider pass for it:
a slowdown of 1 / (γc + 1) or worse. Speculation pays only where the draft is
cheap (small c) and right (large α); each extra guess costs c and adds α^γ tokens.

The rewind after a rejection is a number: this file, the cache's owner, sets the
cached length to the accepted sequence less its newest token (the next pass feeds
it). Stale slots past it are never read, then overwritten. The draft's cache too.

Invariants held by the tests: greedy tokens equal `kv_cache.generate`'s for every
γ and drafter (always right, mostly wrong, prompt lookup); sampled tokens follow the
target's distribution (chi-square); accepted ≤ proposed, new tokens = accepted +
target passes − tokens cut at a stop; after every round the target cache's first
`num_cached` slots hold exactly the K/V of the sequence's first `num_cached` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, Segment
from .model import GPT2
from .request_checks import check_prompt
from .sampling import apply_top_k, apply_top_p, make_generator, sample
from .sampling_params import SamplingParams, finish_reason, one_sample


@dataclass
class SpecDecodingStats:
    """What one speculative generation did (the first two are vLLM's counters, by vLLM's names)."""
    num_draft_tokens: int = 0      # guesses proposed
    num_accepted_tokens: int = 0   # guesses the target accepted
    num_rejections: int = 0        # rounds that ended at a rejected guess
    num_target_passes: int = 0     # target forward passes, the first (the prefill) included
    num_draft_passes: int = 0      # draft model forward passes (0 for prompt lookup)

    @property
    def alpha(self) -> float:
        """The per-guess acceptance rate α: accepted ÷ guesses the target judged (not ÷ proposed: the guesses
        after a rejection are never judged, so that ratio would underestimate α, more so for large γ)."""
        judged = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / judged if judged else 0.0


@dataclass
class SpeculativeOutput:
    token_ids: list[int]           # the new tokens, as `kv_cache.generate` returns them
    finish_reason: str
    stats: SpecDecodingStats


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """(1 − α^(γ+1)) / (1 − α): tokens a round emits when each guess survives with probability α."""
    return float(gamma + 1) if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan's expected improvement over the target alone: tokens per round ÷ round cost (γc + 1)."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * c + 1)


# ---- the acceptance rule ---------------------------------------------------------------


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) logits → the distributions `sampling.sample` draws from: temperature, top-k, top-p, softmax.

    In float64: a rejection needs p > q somewhere for the residual to sample from, which holds only while
    p and q each sum to 1 more closely than their gap (fp32's ~1e-7 could leave it nothing to sample)."""
    return apply_top_p(apply_top_k(logits.double() / params.temperature, params.top_k), params.top_p).softmax(dim=-1)


def rejection_sample(draft_token_ids: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Leviathan's rule for one round: the accepted prefix of the k guesses, then one token of the target's.

    draft_probs (k, V): the distribution q_i each guess was drawn from.
    target_probs (k + 1, V): the target's p_i at the same positions, and one more for the bonus token.
    Returns 1 to k + 1 token ids (ints), distributed exactly as sampling from p one token at a time; every
    random number comes from `generator`, so a seeded round gives the same tokens again."""
    # >>> exercise speculative-accept (lesson 14, 3 pts): accept each guess with probability min(1, p/q), then draw one token of the target's own
    # hint: a guess is kept with probability min(1, p/q) at its token: how do you decide that with `generator` alone, so that a seeded round repeats? Which guesses survive the first refusal? Then one token of the target's own: from which distribution when every guess was kept, and from which when guess i was refused, so that the round's tokens are distributed exactly as p's?
    k = len(draft_token_ids)
    rows = torch.arange(k, device=target_probs.device)
    guesses = torch.tensor(draft_token_ids, dtype=torch.long, device=target_probs.device)
    u = torch.rand(k, generator=generator, device=target_probs.device)
    accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
    n = int(accepted.long().cumprod(dim=0).sum())     # guesses accepted before the first rejection
    if n == k:
        last = target_probs[k]                         # every guess kept: a bonus token from p_k+1
    else:
        last = (target_probs[n] - draft_probs[n]).clamp(min=0)   # norm(max(0, p − q)); multinomial normalises
    return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
    # <<< exercise


def verify(draft_token_ids: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
           params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """The tokens a round emits, from the target's logits (k + 1, V) at the last token and each guess."""
    if params.greedy:   # accept while the guess is the target's own choice, then take the target's choice
        best = sample(logits, [params] * len(logits))
        n = next((i for i, (d, b) in enumerate(zip(draft_token_ids, best)) if d != b), len(draft_token_ids))
        return draft_token_ids[:n] + [best[n]]
    p = sampling_distribution(logits, params)
    if draft_probs is None:   # a drafter that proposes without sampling: q is all on its guess
        draft_probs = F.one_hot(torch.tensor(draft_token_ids, dtype=torch.long, device=p.device), p.shape[-1]).to(p)
    return rejection_sample(draft_token_ids, draft_probs, p, generator)


# ---- the drafters -------------------------------------------------------------------------


class DraftModelProposer:
    """A smaller GPT-2 with the target's vocabulary guesses one token per decode step, on its own cache."""

    def __init__(self, model: GPT2, max_seq_len: int):
        self.model = model
        self.cache = KVCache(model.config, 1, max_seq_len, model.device, model.dtype)
        self.num_cached = 0          # tokens of the sequence whose K/V this cache holds
        self.num_forward_passes = 0

    def propose(self, token_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """k guesses after `token_ids`, and the distributions q (k, V) they were drawn from (None if greedy).

        The first pass feeds what this cache has not seen (the prompt, then the one or two tokens the last
        round emitted); each later pass feeds the previous guess. The last guess is never fed."""
        device = self.model.device
        feed, guesses, dists = token_ids[self.num_cached:], [], []
        for _ in range(k):
            meta = self.cache.prepare([Segment(0, self.num_cached, len(feed))])
            logits = self.model(torch.tensor([feed], device=device), meta.positions, cache=self.cache,
                                logits_indices=torch.tensor([len(feed) - 1], device=device))   # (1, V)
            self.num_cached += len(feed)
            self.num_forward_passes += 1
            if params.greedy:
                guesses += sample(logits, [params])
            else:
                q = sampling_distribution(logits, params)   # the draft shaped by the same temperature, top-k, top-p
                guesses.append(int(torch.multinomial(q[0], 1, generator=generator)))
                dists.append(q)
            feed = guesses[-1:]
        return guesses, (torch.cat(dists) if dists else None)

    def rewind(self, num_tokens: int) -> None:
        """Forget the K/V past the first `num_tokens` tokens of the sequence (the rejected guesses)."""
        self.num_cached = min(self.num_cached, num_tokens)


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in it and propose the tokens that followed.

    The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins, at its earliest occurrence,
    as in vLLM. No match, no guesses: a plain decode step. No model runs, so its cost c is almost 0."""

    def __init__(self, prompt_lookup_max: int = 3, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max={prompt_lookup_max} "
                             "must satisfy 1 ≤ min ≤ max: they bound the length of the n-gram matched")
        self.prompt_lookup_max, self.prompt_lookup_min = prompt_lookup_max, prompt_lookup_min
        self.num_forward_passes = 0

    def propose(self, token_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], None]:
        for n in range(min(self.prompt_lookup_max, len(token_ids) - 1), self.prompt_lookup_min - 1, -1):
            suffix = token_ids[-n:]
            for start in range(len(token_ids) - n):      # every earlier place, the suffix itself excluded
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k], None
        return [], None

    def rewind(self, num_tokens: int) -> None:
        """Nothing to forget: the lookup reads the sequence itself."""


# ---- the loop ---------------------------------------------------------------------------


class SpeculativeDecoder:
    """One sequence on the contiguous KV cache; `step()` runs one round (draft, verify, keep)."""

    def __init__(self, target: GPT2, draft: GPT2 | NgramProposer, prompt_token_ids, params: SamplingParams,
                 num_speculative_tokens: int):
        cfg, params = target.config, one_sample(params, "speculative decoding")
        self.prompt = check_prompt(cfg, prompt_token_ids, params.max_tokens)
        if params.reads_history:
            raise ValueError("penalties and min_tokens change the target's distribution token by token, and this "
                             "decoder verifies guesses against the plain one; run such a request on LLMEngine")
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an integer ≥ 1 (the "
                             "guesses per round, γ); for no speculation call kv_cache.generate")
        max_seq_len = len(self.prompt) + params.max_tokens - 1   # KV a sequence holds: its last token is never fed
        if isinstance(draft, GPT2):
            draft = DraftModelProposer(_check_draft(draft, target, max_seq_len), max_seq_len)
        elif not isinstance(draft, NgramProposer):
            raise TypeError(f"draft must be a GPT2 (a smaller model with the target's vocabulary) or an "
                            f"NgramProposer (prompt lookup), got {type(draft).__name__}")
        self.target, self.draft, self.params, self.gamma = target, draft, params, num_speculative_tokens
        self.cache = KVCache(cfg, 1, max_seq_len, target.device, target.dtype)
        self.num_cached = 0                    # target K/V length; this decoder, the cache's owner, keeps it
        self.token_ids = list(self.prompt)     # the sequence: prompt, then output
        self.output: list[int] = []
        self.generator = make_generator(params, target.device)
        self.stats = SpecDecodingStats()
        self.finish_reason: str | None = None

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One round: draft k ≤ γ guesses, verify them in one target pass, keep what the rule accepts.
        The first round's pass is the prefill (prompt plus guesses). Returns the tokens added to the output."""
        if self.finish_reason is not None:
            raise RuntimeError(f"the sequence has finished ({self.finish_reason}); start a new SpeculativeDecoder")
        params, device = self.params, self.target.device
        # Never guess past max_tokens: a round emits up to k + 1 tokens, and its pass must fit the cache.
        k = min(self.gamma, params.max_tokens - len(self.output) - 1)
        guesses, q = self.draft.propose(self.token_ids, k, params, self.generator) if k else ([], None)
        feed = self.token_ids[self.num_cached:] + guesses
        meta = self.cache.prepare([Segment(0, self.num_cached, len(feed))])
        rows = torch.arange(len(feed) - len(guesses) - 1, len(feed), device=device)   # last token and each guess
        logits = self.target(torch.tensor([feed], device=device), meta.positions, cache=self.cache,
                             logits_indices=rows)   # (len(guesses) + 1, V)
        emitted = verify(guesses, q, logits, params, self.generator)

        n = len(emitted) - 1   # guesses accepted
        self.stats.num_target_passes += 1
        self.stats.num_draft_tokens += len(guesses)
        self.stats.num_accepted_tokens += n
        self.stats.num_rejections += int(n < len(guesses))
        self.stats.num_draft_passes = self.draft.num_forward_passes
        added = []
        for token in emitted:   # one token at a time, so a stop token cuts the round short
            added.append(token)
            self.output.append(token)
            self.token_ids.append(token)
            self.finish_reason = finish_reason(token, len(self.output), len(self.token_ids), params,
                                               self.target.config.eos_token_id, self.target.config.n_ctx)
            if self.finish_reason:
                break
        # The rewind: keep the K/V of every token but the newest; what the rejected guesses wrote is past it.
        self.num_cached = len(self.token_ids) - 1
        self.draft.rewind(self.num_cached)
        return added


def _check_draft(draft: GPT2, target: GPT2, max_seq_len: int) -> GPT2:
    d, t = draft.config, target.config
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"the draft's vocabulary ({d.vocab_size} tokens) differs from the target's "
                         f"({t.vocab_size}); a draft must share the target's tokenizer, e.g. gpt2 for gpt2-xl")
    if d.n_ctx < max_seq_len:
        raise ValueError(f"the draft's context n_ctx={d.n_ctx} is shorter than this request's "
                         f"{max_seq_len} tokens of KV; shorten the prompt or max_tokens, or use another draft")
    if draft.device != target.device:
        raise ValueError(f"the draft is on {draft.device} but the target on {target.device}; "
                         f"move the draft with draft.to({str(target.device)!r})")
    return draft


def generate(target: GPT2, draft: GPT2 | NgramProposer, prompt_token_ids, params: SamplingParams | None = None,
             *, num_speculative_tokens: int) -> SpeculativeOutput:
    """Generate after one prompt with speculative decoding; the tokens follow the target's own distribution.
    `draft`: a smaller GPT-2 with the target's vocabulary, or an `NgramProposer` (prompt lookup)."""
    params = params or SamplingParams(temperature=0.0)
    decoder = SpeculativeDecoder(target, draft, prompt_token_ids, params, num_speculative_tokens)
    while decoder.finish_reason is None:
        decoder.step()
    return SpeculativeOutput(decoder.output, decoder.finish_reason, decoder.stats)
