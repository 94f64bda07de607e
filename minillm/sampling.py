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

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .config import GPT2Config, check_int, check_real

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
           generators: list[torch.Generator | None] | None = None) -> list[int]:
    """Pick one token per row of logits (N, V) under each row's own parameters: tensor ops for the whole
    batch, and one device→host transfer, the token ids, at the end.

    Greedy rows take the argmax. The others are drawn together: logits over
    each row's temperature, its top-k and top-p applied, then the exponential
    race, argmax(p / E) with one E ~ Exp(1) per token. The smallest of
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


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a tensor on `device`, without making the host wait.

    `torch.tensor(values, device="cuda")` copies from pageable memory, and such
    a copy waits for the GPU to finish everything queued before it: one hidden
    sync per tensor. Copied from pinned (page-locked) memory with
    non_blocking=True, it is queued behind that work instead, and the host goes on.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values as an (N, 1) tensor on `device`, uploaded by `to_device`."""
    return to_device(values, device, dtype)[:, None]


def check_prompt(config: GPT2Config, token_ids, max_tokens: int = 0) -> list[int]:
    """The prompt as a list of Python ints, or a ValueError naming the value, the limit and the fix.

    A prompt is a sequence of token ids: a list or tuple of integers (NumPy's
    and torch's included), or a 1-D integer array or tensor. A sequence holds
    at most len(prompt) + max_tokens − 1 tokens of KV, since the last sampled
    token is never fed back, so that is what must fit in n_ctx. Cheap enough
    to call once per request; the model's forward pass itself does not check,
    so the hot path stays lean.
    """
    kind = type(token_ids).__name__
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        if token_ids.ndim != 1:
            raise ValueError(f"the prompt is a {token_ids.ndim}-D {kind} of shape {tuple(token_ids.shape)}; a "
                             "prompt is one sequence of token ids (pass one request per prompt)")
        token_ids = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes, bytearray)):
        raise ValueError(f"the prompt has type {kind}, not a sequence of token ids; encode text with the "
                         "tokenizer")
    elif not isinstance(token_ids, Sequence):
        raise ValueError(f"the prompt has type {kind}, not a sequence of token ids (a list of ints); a call that "
                         "takes several prompts wants a list of such lists")
    ids = []
    for i, t in enumerate(token_ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"token id {t!r} at position {i} is a {type(t).__name__}, not an integer; "
                             "a prompt is a sequence of token ids (encode text with the tokenizer)") from None
        if not 0 <= t < config.vocab_size:
            raise ValueError(f"token id {t} at position {i} is outside the vocabulary [0, {config.vocab_size}); "
                             "was the prompt encoded with a different tokenizer?")
        ids.append(t)
    n = len(ids)
    if n == 0:
        raise ValueError("the prompt is empty: a GPT-2 needs at least one token to condition on "
                         "(encode some text, or start from the end-of-text token)")
    if n > config.n_ctx:
        raise ValueError(f"the prompt has {n} tokens but the context holds n_ctx={config.n_ctx}; "
                         f"truncate the prompt to at most {config.n_ctx} tokens")
    if max_tokens and n + max_tokens - 1 > config.n_ctx:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) − 1 = {n + max_tokens - 1} tokens of KV "
                         f"exceed the context n_ctx={config.n_ctx}; lower max_tokens to at most "
                         f"{config.n_ctx - n + 1} or shorten the prompt")
    return ids


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
