"""What one request may ask of the server, checked before any work is done for it.

A request's cost is set by a few numbers it sends, not by its size on the
wire: `n: 1000000000` is 17 bytes, and building its samples would take the
whole memory. So every such number is checked against a limit before the
server tokenizes, allocates or queues anything, in time that does not grow
with the value (a bound is compared, never counted up to):

    limit                             bounds                                  flag
    n (and best_of, which equals it)  samples side by side                    --max-num-seqs
    logprobs, top_logprobs            top entries per position                --max-logprobs
    prompts in one body               requests one body queues                --max-num-seqs + --max-queue
    stop strings: count, characters   the text matched after every token      --max-stop-strings, --max-stop-chars
    the body                          bytes read before parsing               --max-body-bytes (413)
                                      seconds to receive it whole             --body-timeout (408)
    a prompt's tokens                 the model's context, max_model_len      (the model's; no flag)
    the answer's logprob entries      choices × positions × (1 + logprobs)    --max-logprob-entries

A text prompt is bounded before it is tokenized: no token is longer than the
tokenizer's longest, so a text of more than max_model_len × that many
characters cannot fit. Each refusal is a 400 (413, 408 for the body) in OpenAI's
shape naming the field, the value, the limit and the flag that raises it.
The defaults are far above what an honest client sends.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

from ..sampling_params import MAX_LOGPROBS

FLAGS = {"max_body_bytes": "--max-body-bytes", "max_stop_strings": "--max-stop-strings",
         "max_stop_chars": "--max-stop-chars", "max_logprobs": "--max-logprobs",
         "max_logprob_entries": "--max-logprob-entries", "body_timeout": "--body-timeout"}


@dataclass(frozen=True)
class ServerLimits:
    """The server's own limits on one request (the engine's, max_num_seqs and the context, come from it)."""
    max_body_bytes: int = 4 * 2**20       # a prompt of a million-token context, as ids, fits in a few MiB
    max_stop_strings: int = 64            # OpenAI's API takes 4; lm-eval sends a handful
    max_stop_chars: int = 4096            # all stop strings together
    max_logprobs: int = 20                # vLLM's max_logprobs
    max_logprob_entries: int = 1_000_000  # about 100 MB of JSON; n=16 samples of a whole 1024-token context,
    # echoed, with 20 top logprobs each, carry 350,000
    body_timeout: float = 30.0            # seconds to receive a whole body: a client that trickles it holds a socket

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), (int, float) if f.name == "body_timeout" else int
            if isinstance(value, bool) or not isinstance(value, kind) or not value >= 0:
                raise ValueError(f"{FLAGS[f.name]} {value!r} must be a number ≥ 0")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs {self.max_logprobs}: the engine computes at most {MAX_LOGPROBS} top "
                             f"log-probabilities per token; pass at most {MAX_LOGPROBS}")

    @classmethod
    def from_args(cls, args) -> "ServerLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def APIError(status: int, message: str, param: str | None = None):
    """errors.APIError, imported when first needed: `serve --help` reads the defaults above without FastAPI."""
    from .errors import APIError as error
    return error(status, message, param)


def over(param: str, value, limit: int, flag: str, what: str):
    """The 400 for `param`=`value` over `limit`: what the limit bounds, and the flag that raises it."""
    return APIError(400, f"{param}={_short(value)} is over this server's limit of {limit} {what}; send at most {limit}, "
                         f"or start `serve` with a larger {flag}", param)


_longest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token decodes to (computed once per tokenizer): a text of more than
    max_model_len × this many characters has more than max_model_len tokens."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
    try:
        _longest[tokenizer] = longest
    except TypeError:  # a tokenizer that cannot be weakly referenced: computed again next time
        pass
    return longest


def batch_of(prompt) -> list:
    """The body's prompts: a text, a list of ids, or a batch of either (one choice per prompt)."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


@dataclass(frozen=True)
class RequestBounds:
    """The limits, with the engine's own: its batch, its queue, its context and its tokenizer's longest token."""
    limits: ServerLimits
    max_num_seqs: int
    max_queue: int
    max_model_len: int
    longest_token: int

    def check(self, body, batch: list, num_logprobs: int | None) -> None:
        """Refuse, before any work, a body whose numbers are over a limit (comparisons only: no value is
        counted up to, no prompt tokenized)."""
        lim = self.limits
        if body.n > self.max_num_seqs:
            raise APIError(400, f"n={_short(body.n)} samples run side by side, but max_num_seqs={self.max_num_seqs} "
                                "sequences fit in a step, so it could never run; lower n, or start `serve` with "
                                f"--max-num-seqs of at least {_short(body.n)}", "n")
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of > self.max_num_seqs:
            raise over("best_of", best_of, self.max_num_seqs, "--max-num-seqs", "samples side by side")
        if num_logprobs is not None and num_logprobs > lim.max_logprobs:
            param = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
            raise over(param, num_logprobs, lim.max_logprobs, "--max-logprobs", "top log-probabilities per token")
        most = self.max_num_seqs + self.max_queue
        if len(batch) > most:
            raise APIError(400, f"prompt: the body holds {len(batch)} prompts, but at most max_num_seqs="
                                f"{self.max_num_seqs} run and --max-queue={self.max_queue} wait, {most} in all, so "
                                f"it could never be admitted, now or later; send at most {most} prompts per body, "
                                "or start `serve` with a larger --max-queue", "prompt")
        stops = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or [] if isinstance(s, str)]
        if len(stops) > lim.max_stop_strings:
            raise over("stop", f"[{len(stops)} strings]", lim.max_stop_strings, "--max-stop-strings", "stop strings")
        chars = sum(len(s) for s in stops)
        if chars > lim.max_stop_chars:
            raise over("stop", f"[{chars} characters]", lim.max_stop_chars, "--max-stop-chars",
                       "characters of stop strings in all")
        for i, p in enumerate(batch):
            where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(p, str) and len(p) > self.max_model_len * self.longest_token:
                raise APIError(400, f"{where} has {len(p)} characters: more than max_model_len="
                                    f"{self.max_model_len} tokens of at most {self.longest_token} characters each, "
                                    f"so more than the model's context (n_ctx={self.max_model_len}); no flag raises "
                                    "it: shorten the prompt", where)
            if isinstance(p, list) and len(p) > self.max_model_len:
                raise self.too_long(where, len(p))

    def too_long(self, where: str, num_tokens: int):
        return APIError(400, f"{where} has {num_tokens} tokens but the model's context holds n_ctx="
                             f"{self.max_model_len} (max_model_len; no flag raises it); truncate the prompt to at "
                             f"most {self.max_model_len} tokens", where)

    def new_tokens(self, max_tokens: int | None, num_tokens: int, where: str) -> int:
        """How many tokens a prompt of `num_tokens` may generate, as vLLM bounds it: prompt + new ≤
        max_model_len; `max_tokens: null` is the rest of the context."""
        room = self.max_model_len - num_tokens
        if num_tokens > self.max_model_len:
            raise self.too_long(where, num_tokens)
        if max_tokens is None:
            if room < 1:
                raise APIError(400, f"{where} has {num_tokens} tokens and fills the model's context "
                                    f"(max_model_len={self.max_model_len}): no room for a new token; shorten it",
                               where)
            return room
        if max_tokens > room:
            raise APIError(400, f"prompt ({num_tokens} tokens) + max_tokens ({_short(max_tokens)}) is more than "
                                f"the model's context, max_model_len={self.max_model_len}; lower max_tokens to at "
                                f"most {room}, or shorten the prompt", "max_tokens")
        return max_tokens

    def check_answer(self, entries: int, num_logprobs: int) -> None:
        """The answer's projected logprob entries (choices × positions × (1 + logprobs)) against the limit."""
        if entries > self.limits.max_logprob_entries:
            raise APIError(400, f"logprobs={num_logprobs}: the answer would carry {entries} log-probability "
                                f"entries (choices × positions × (1 + logprobs)), over this server's limit of "
                                f"{self.limits.max_logprob_entries}; lower n, logprobs, max_tokens or the number "
                                "of prompts, or start `serve` with a larger --max-logprob-entries", "logprobs")


def _short(value) -> str:
    """The value as a message quotes it: a long integer by its first digits and its length (a JSON body holds
    none of more than 4300 digits, so printing it is cheap)."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"
