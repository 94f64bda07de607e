"""Turning logits into the next token, and knowing when to stop.

`SamplingParams` uses vLLM's field names so what you learn here carries over:

    temperature   0 means greedy (argmax); otherwise logits are divided by it
    top_k         keep only the k most likely tokens (0 or -1: keep all)
    top_p         keep the smallest set of tokens whose probability sums to ≥ p
    max_tokens    how many tokens to generate at most
    seed          a per-request random stream: the same seed gives the same text
    stop_token_ids, ignore_eos
                  generation ends at the end-of-text token, or any listed id

Sampling costs almost nothing next to a forward pass (a sort of V logits per
row for top-p); it lives apart from the model so that every decoding strategy
(naive, KV cache, paged engine) shares exactly the same choice of token for the
same logits. That is what lets the tests demand *identical* greedy tokens
across all of them.

Invariants held by the tests: greedy is the argmax; top-k keeps exactly the k
largest logits and top-p the smallest nucleus of mass ≥ p (always the top
token); a seeded request draws the same tokens whatever shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FINISH_STOP = "stop"        # an end-of-text or stop token was generated
FINISH_LENGTH = "length"    # max_tokens reached, or the context is full
FINISH_ABORT = "abort"      # the caller aborted the request


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer ≥ 1: "
                             "a request has to generate at least one token")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be ≥ 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; 1 keeps every token")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be ≥ 1, or 0 / -1 to keep every token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (N, V); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # >>> exercise sampling-top-k (lesson 01, 1 pt): mask everything below the k-th largest logit
    # hint: each row has its own threshold, its k-th largest logit (torch can find a row's k largest values); every logit below its row's threshold becomes -inf, the rest keep their values
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
    # <<< exercise


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of top tokens whose probabilities sum to ≥ p.

    The most likely token is always kept, so p → 0 becomes greedy.
    """
    if p >= 1.0:
        return logits
    # >>> exercise sampling-top-p (lesson 01, 2 pts): keep the smallest prefix of sorted tokens with mass ≥ p
    # hint: sort descending, cumsum the softmax; a token is dropped if the mass *before* it already reaches p; scatter the mask back
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
    # <<< exercise


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A private random stream per request, so a seeded request is reproducible
    whatever else shares its batch."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None) -> list[int]:
    """Pick one token per row of logits (N, V) under each row's own parameters."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} SamplingParams")
    generators = generators or [None] * len(params)
    if len(generators) != len(params):  # zip would silently drop rows
        raise ValueError(f"{len(params)} SamplingParams but {len(generators)} generators; pass one per row (None "
                         "for an unseeded row), or no list at all")
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; one device sync for the batch
    for i, (sp, gen) in enumerate(zip(params, generators)):
        if sp.greedy:
            continue
        row = apply_top_p(apply_top_k(logits[i:i + 1] / sp.temperature, sp.top_k), sp.top_p)
        tokens[i] = int(torch.multinomial(row.softmax(dim=-1), 1, generator=gen))
    return tokens


def finish_reason(token: int, num_generated: int, seq_len: int, params: SamplingParams,
                  eos_token_id: int | None, n_ctx: int) -> str | None:
    """Why a sequence ends after emitting `token` as its `num_generated`-th token
    (its length is now `seq_len`), or None if it goes on. One rule for every decoder.

    The context is full when the next step would feed a token at position n_ctx,
    past the position table: that is when seq_len exceeds n_ctx."""
    if token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos):
        return FINISH_STOP
    if num_generated >= params.max_tokens or seq_len > n_ctx:
        return FINISH_LENGTH
    return None
