"""What a request asks of sampling, and when its generation ends: vLLM's `SamplingParams`.

The fields carry vLLM's names, so what you learn here carries over:

    temperature   0 means greedy (argmax); otherwise logits are divided by it (≥ 0.01)
    top_k         keep only the k most likely tokens (0 or -1: keep all)
    top_p         keep the smallest set of tokens whose probability sums to ≥ p
    max_tokens    how many tokens to generate at most
    seed          a per-request random stream: the same seed gives the same text
    stop_token_ids, ignore_eos
                  generation ends at the end-of-text token, or any listed id
    n, best_of    how many samples of the prompt to return, and to draw (best_of = n
                  here); the prompt is prefilled once (`parallel_sampling.py`)
    min_tokens    until this many are generated, the end-of-text and stop ids are masked out
    presence_penalty, frequency_penalty
                  OpenAI's, in [-2, 2], on the tokens generated so far:
                  logit − presence·[count > 0] − frequency·count
    repetition_penalty
                  vLLM's (> 0, 1 is off), on every token of prompt and output:
                  a positive logit is divided by it, a negative one multiplied
    logprobs      also return each generated token's log-probability and the
                  `logprobs` most likely tokens' (0..MAX_LOGPROBS; None: none)
    prompt_logprobs
                  the same for every prompt token but the first (which has no
                  context): this computes logits at every prompt position, and
                  such a request takes nothing from the prefix cache

Penalties, min_tokens and log-probabilities are the engine's (`LLMEngine`):
the single-sequence decoders (naive_decode, kv_cache, speculative) return
tokens only and refuse penalties rather than ignore them.

Log-probabilities are the model's own (vLLM's default `logprobs_mode`,
"raw_logprobs"): log_softmax of the logits before penalties, temperature,
top-k or top-p, so they score text the same whatever the request samples with.

Every field is checked when the params are made, and they are frozen, so a
request's params cannot change while it runs. `finish_reason` is the one rule
every decoder uses to end a sequence.

This file needs no torch, as nano-vllm's does: the scheduler's side of the engine
(sequences, blocks, queues) can be read, run and tested without it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import check_int, check_real

FINISH_STOP = "stop"        # an end-of-text or stop token was generated
FINISH_LENGTH = "length"    # max_tokens reached, or the context is full
FINISH_ABORT = "abort"      # the caller aborted the request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top log-probabilities a request may ask per token
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
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None

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
            stop_token_ids=tuple(check_int("a stop token id", t, 0) for t in stops),
            presence_penalty=_penalty("presence_penalty", self.presence_penalty),
            frequency_penalty=_penalty("frequency_penalty", self.frequency_penalty),
            logprobs=_num_logprobs("logprobs", self.logprobs),
            prompt_logprobs=_num_logprobs("prompt_logprobs", self.prompt_logprobs),
            n=check_int("n", self.n, 1, hint=": the number of samples to return, 1 or more"),
            best_of=None if self.best_of is None else check_int("best_of", self.best_of, 1))
        checked["min_tokens"] = check_int("min_tokens", self.min_tokens, 0, checked["max_tokens"] + 1,
                                          hint=" (at most max_tokens; 0 lets the end come at once)")
        r = check_real("repetition_penalty", self.repetition_penalty, " (1 is off)")
        if r <= 0:
            raise ValueError(f"repetition_penalty={r:g} must be > 0: 1 is off, above 1 discourages repeats, "
                             "below 1 encourages them")
        if not MIN_TEMPERATURE <= r <= 1 / MIN_TEMPERATURE:  # as temperature: past it, logits overflow to ±inf
            raise ValueError(f"repetition_penalty={r:g} must be in [{MIN_TEMPERATURE}, {1 / MIN_TEMPERATURE:g}]: "
                             "beyond that it divides or multiplies a seen token's logit past float32's range")
        checked["repetition_penalty"] = r
        n = checked["n"]
        if checked["best_of"] not in (None, n):
            raise ValueError(f"best_of={self.best_of} with n={n}: this engine returns every sample it draws and "
                             f"ranks none, so best_of must equal n (or be left out). Ask for n={self.best_of} with "
                             f"logprobs and keep the ones you like (e.g. by the sum of their logprobs)")
        if checked["seed"] is not None and checked["seed"] + n > 2**64:
            raise ValueError(f"seed={checked['seed']} with n={n}: sample j draws from seed + j, which must stay "
                             f"below 2**64; pass a seed of at most {2**64 - n}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # the one way to set a field of a frozen dataclass

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling depends on the tokens so far (a penalty, or min_tokens): only such rows pay for it."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)


def _penalty(name: str, value) -> float:
    v = check_real(name, value, " (0 is off)")
    if not -2.0 <= v <= 2.0:
        raise ValueError(f"{name}={v:g} must be in [-2, 2] (OpenAI's range; 0 is off)")
    return v


def _num_logprobs(name: str, value) -> int | None:
    if value is None:
        return None
    return check_int(name, value, 0, MAX_LOGPROBS + 1,
                     hint=f": how many top log-probabilities per token, at most {MAX_LOGPROBS} (None for none)")


def one_sample(params: SamplingParams, decoder: str) -> SamplingParams:
    """The params of a decoder that returns one sample per prompt; n > 1 is refused, never ignored."""
    if params.n != 1:
        raise ValueError(f"n={params.n}: {decoder} returns one sample per prompt; for n samples use LLMEngine "
                         "(one prefill, shared blocks), or call it n times with seeds seed + j")
    return params


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
