"""Turning logits into the next token.

A request's `SamplingParams` (sampling_params.py) say how: greedy when the
temperature is 0, else logits divided by the temperature, cut to the top k
tokens and to the nucleus of mass p, then drawn from the request's own seeded
stream.

Sampling costs almost nothing next to a forward pass (a sort of V logits per
row for top-p); it lives apart from the model so that every decoding strategy
(naive, KV cache, paged engine) shares exactly the same choice of token for the
same logits. That is what lets the tests demand *identical* greedy tokens
across all of them.

Logits that are not finite (NaN weights, a bad `layer_norm_epsilon`, an fp16
overflow) have no argmax worth the name: `sample` raises NonFiniteLogitsError
instead of returning a token. The check is one pass over the logits (their
min and max) and adds no device sync: on a GPU a bad row is made to pick the
id one past the vocabulary, and that id is noticed on the host, in the ids
`sample` fetches anyway.

Invariants held by the tests: greedy is the argmax; top-k keeps exactly the k
largest logits and top-p the smallest nucleus of mass ≥ p (always the top
token); a seeded request draws the same tokens whatever shares its batch; a
row with NaN or ±inf never becomes a token.
"""
from __future__ import annotations


import torch

from .device import to_device
from .logprobs import sample_logprobs
from .penalties import apply_penalties
from .sampling_params import SamplingParams


class NonFiniteLogitsError(ValueError):
    """Logits holding NaN or ±inf, so no token can be chosen; `rows` are the rows of the batch at fault,
    `request_ids` their requests (the engine fills them in, having aborted those requests and no other)."""

    def __init__(self, rows: list[int], message: str | None = None, request_ids: list[str] = ()):
        self.rows, self.request_ids = rows, list(request_ids)  # the requests of those rows, once the engine knows
        super().__init__(message or (
            f"the logits of row(s) {rows} hold NaN or ±inf, so no token can be chosen. Likely causes: weights "
            "holding NaN or inf (a corrupt or badly converted checkpoint; re-download it), a config.json whose "
            "layer_norm_epsilon is not a small positive number (GPT-2 uses 1e-05), or a half-precision overflow "
            "(try --dtype fp32)"))


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (N, V); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # >>> exercise sampling-top-k (lesson 01, 1 pt): mask everything below the k-th largest logit
    # hint: each row has its own threshold, its k-th largest logit (torch can find a row's k largest values); every logit below its row's threshold becomes -inf, the rest keep their values. Off limits: transformers, TopKLogitsWarper, TopPLogitsWarper.
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))
    # <<< exercise


def apply_top_p(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of top tokens whose probabilities sum to ≥ p.

    p is one value for every row of logits (N, V), or an (N, 1) column of
    per-row values. The most likely token is always kept, so p → 0 becomes greedy.
    """
    if not isinstance(p, torch.Tensor) and p >= 1.0:
        return logits
    # >>> exercise sampling-top-p (lesson 01, 2 pts): keep the smallest prefix of sorted tokens with mass ≥ p
    # hint: which tokens make the nucleus: those the most-likely-first order reaches before the mass reaches p, and what about the token whose probability makes it cross p? p may be one number or one per row, an (N, 1) column: does every row meet its own p? Once decided in sorted order, how does each decision get back to its token id?. Off limits: transformers, TopKLogitsWarper, TopPLogitsWarper.
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
           generators: list[torch.Generator | None] | None = None, histories=None,
           eos_token_id: int | None = None) -> list[int]:
    """Pick one token per row of logits (N, V) under each row's own parameters: tensor ops for the whole
    batch, and one device→host transfer, the token ids, at the end.

    Rows whose params carry penalties or min_tokens first have them applied
    (penalties.py; `histories[i]` is row i's (prompt ids, output ids),
    `eos_token_id` the id min_tokens masks). Greedy rows take the argmax. The
    others are drawn together: logits over each row's temperature, its top-k
    and top-p applied, then the exponential race, argmax(p / E) with one E ~ Exp(1) per token. The smallest of
    independent exponential clocks E_i / p_i rings at i with probability p_i,
    so this draws from p exactly, with no cumulative sum and no search. A
    seeded row draws its E from its own generator, so its tokens do not depend
    on what else shares the batch. A row whose logits are not finite raises.
    """
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} SamplingParams")
    generators = generators or [None] * len(params)
    if len(generators) != len(params):  # zip would silently drop rows
        raise ValueError(f"{len(params)} SamplingParams but {len(generators)} generators; pass one per row (None "
                         "for an unseeded row), or no list at all")
    if not params:
        return []
    logits = logits if logits.dtype == torch.float32 else logits.float()
    logits = apply_penalties(logits, params, histories, eos_token_id)  # itself when no row asks
    best, tokens = logits.max(dim=-1)  # the greedy rows are done; a NaN anywhere in a row makes its max NaN
    drawn = [i for i, sp in enumerate(params) if not sp.greedy]
    if len(drawn) == len(params):
        tokens = _draw(logits, params, generators)
    elif drawn:
        rows = _column(drawn, torch.long, logits.device)[:, 0]
        tokens[rows] = _draw(logits[rows], [params[i] for i in drawn], [generators[i] for i in drawn])
    # The step's one transfer to the host. A row whose max is NaN or ±inf cannot be sampled; its flag (-1)
    # rides on the same transfer, so checking costs no extra device sync.
    ids = torch.where(best.isfinite(), tokens, -1).tolist()
    if -1 in ids:
        raise NonFiniteLogitsError([i for i, t in enumerate(ids) if t == -1])
    return ids


def sample_sequences(logits: torch.Tensor, seqs: list, eos_token_id: int | None) -> list[tuple]:
    """A step's rows of logits, row i sequence i's (`Sequence`): (sequence, its token, its TokenLogprobs or None)
    for each, drawn under its own params and stream; penalties and min_tokens read its history, and only rows
    that ask get logprobs (`logprobs.py`)."""
    history = {} if not any(s.params.reads_history for s in seqs) else dict(
        histories=[(s.prompt_token_ids, s.output_token_ids) for s in seqs], eos_token_id=eos_token_id)
    tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], **history)
    return list(zip(seqs, tokens, sample_logprobs(logits, seqs, tokens)))


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """The exponential race over rows that all sample: (M, V) logits → (M,) token ids, on the device."""
    x = logits / _column([sp.temperature for sp in params], torch.float32, logits.device)
    for k in sorted({sp.top_k for sp in params if 0 < sp.top_k < logits.shape[-1]}):  # one call per distinct k
        x = _on_rows(x, [i for i, sp in enumerate(params) if sp.top_k == k], lambda rows: apply_top_k(rows, k))
    nucleus = [i for i, sp in enumerate(params) if sp.top_p < 1.0]
    if nucleus:  # one sort for every row that asks for a nucleus, each with its own p
        p = _column([params[i].top_p for i in nucleus], torch.float32, logits.device)
        x = _on_rows(x, nucleus, lambda rows: apply_top_p(rows, p))
    probs = x.softmax(dim=-1)
    race = torch.empty_like(probs)
    if None in generators:
        race.exponential_()  # one draw for the batch, from the global stream
    for i, g in enumerate(generators):
        if g is not None:
            race[i].exponential_(generator=g)  # a seeded row from its own stream
    # A clock of exactly 0 would turn a zero probability into 0/0; the smallest normal float rules it out.
    return probs.div_(race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def _on_rows(x: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
    """x with fn applied to the listed rows (to x whole when that is every row)."""
    if len(rows) == x.shape[0]:
        return fn(x)
    index = _column(rows, torch.long, x.device)[:, 0]
    x[index] = fn(x[index])
    return x


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values as an (N, 1) tensor on `device`, uploaded by `to_device`."""
    return to_device(values, device, dtype)[:, None]

