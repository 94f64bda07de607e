"""Turning logits into the next token, and knowing when to stop.

`SamplingParams` uses vLLM's field names so what you learn here carries over:

    temperature   0 means greedy (argmax); otherwise logits are divided by it (≥ 0.01)
    top_k         keep only the k most likely tokens (0 or -1: keep all)
    top_p         keep the smallest set of tokens whose probability sums to ≥ p
    max_tokens    how many tokens to generate at most
    seed          a per-request random stream: the same seed gives the same text
    stop_token_ids, ignore_eos
                  generation ends at the end-of-text token, or any listed id

Every field is checked when the params are made, and they are frozen, so a
request's params cannot change while it runs.

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

from dataclasses import dataclass

import torch

from .config import check_int, check_real

FINISH_STOP = "stop"        # an end-of-text or stop token was generated
FINISH_LENGTH = "length"    # max_tokens reached, or the context is full
FINISH_ABORT = "abort"      # the caller aborted the request

MIN_TEMPERATURE = 0.01  # vLLM raises smaller temperatures to this; we refuse them: logits / T can overflow


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        """Check every field, and keep it as a plain Python value; from here on the params are frozen."""
        t = check_real("temperature", self.temperature, " (0 means greedy)")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature={t:g} must be 0 (greedy) or at least {MIN_TEMPERATURE}: below that, "
                             "sampling is greedy in all but name and dividing the logits by it can overflow")
        p = check_real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p={p} must be in (0, 1]; 1 keeps every token")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise ValueError(f"stop_token_ids={stops!r} must be a list of token ids, e.g. [{stops!r}]")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        checked = dict(
            temperature=t, top_p=p,
            top_k=check_int("top_k", self.top_k, -1, hint=" (0 or -1 keep every token)"),
            max_tokens=check_int("max_tokens", self.max_tokens, 1, hint=": a request generates at least one token"),
            seed=None if self.seed is None else check_int("seed", self.seed, 0, 2**64,
                                                          hint=", or None for an unseeded request"),
            stop_token_ids=tuple(check_int("a stop token id", t, 0) for t in stops))
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # the one way to set a field of a frozen dataclass

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class NonFiniteLogitsError(ValueError):
    """Logits holding NaN or ±inf, so no token can be chosen; `rows` are the rows of the batch at fault."""

    def __init__(self, rows: list[int], message: str | None = None):
        self.rows = rows
        super().__init__(message or (
            f"the logits of row(s) {rows} hold NaN or ±inf, so no token can be chosen. Likely causes: weights "
            "holding NaN or inf (a corrupt or badly converted checkpoint; re-download it), a config.json whose "
            "layer_norm_epsilon is not a small positive number (GPT-2 uses 1e-05), or a half-precision overflow "
            "(try --dtype fp32)"))


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """The logits to sample from, or NonFiniteLogitsError for rows holding NaN or ±inf.

    A row is finite when its min and max are (both propagate NaN): one pass, done by `aminmax`. On
    the CPU the flags are already on the host, so a bad row raises at once. On a GPU reading them
    would stall the host until the GPU caught up, so they travel with the sampled ids instead
    (`fold_nonfinite_rows`), and `reject_flagged_rows` raises once the ids are on the host.
    """
    lo, hi = torch.aminmax(logits, dim=-1, keepdim=True)
    finite = lo.isfinite() & hi.isfinite()  # (N, 1)
    if logits.device.type != "cpu":
        return fold_nonfinite_rows(logits, finite)
    if not finite.all():
        raise NonFiniteLogitsError((~finite).nonzero()[:, 0].tolist())
    return logits


def fold_nonfinite_rows(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """(N, V) → (N, V + 1). A row that is not `finite` becomes -inf everywhere except a new last column,
    so argmax and sampling alike (temperature, top-k and top-p keep a row's top token) pick id V for
    it; finite rows get -inf there and sample as before. No sync: the flag is in the ids."""
    flag = torch.where(finite, float("-inf"), 0.0).to(logits.dtype)
    return torch.cat([torch.where(finite, logits, float("-inf")), flag], dim=-1)


def reject_flagged_rows(tokens: list[int], vocab_size: int) -> list[int]:
    """The sampled tokens, or NonFiniteLogitsError naming the rows `fold_nonfinite_rows` flagged."""
    bad = [i for i, t in enumerate(tokens) if t == vocab_size]
    if bad:
        raise NonFiniteLogitsError(bad)
    return tokens


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
    vocab_size = logits.shape[-1]
    logits = check_finite(logits).float()  # NaN or ±inf: raises now on the CPU; on a GPU the row samples id V
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; one device sync for the batch
    for i, (sp, gen) in enumerate(zip(params, generators)):
        if sp.greedy:
            continue
        row = apply_top_p(apply_top_k(logits[i:i + 1] / sp.temperature, sp.top_k), sp.top_p)
        tokens[i] = int(torch.multinomial(row.softmax(dim=-1), 1, generator=gen))
    return reject_flagged_rows(tokens, vocab_size)


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
