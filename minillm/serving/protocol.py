"""The request bodies, as OpenAI's and vLLM's clients send them.

The fields mean what they mean in the OpenAI and vLLM APIs: `prompt` (text, a
list of token ids, or a batch of either: one choice per prompt), `max_tokens`
(default 16; null: the rest of the context), `temperature`, `top_p`, `top_k`,
`seed`, `stop` (strings, or token ids), `stop_token_ids`, `ignore_eos`,
`min_tokens`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`,
`logprobs` (completions: how many top tokens per position, an integer;
chat: `logprobs: true` and `top_logprobs: k`), `echo` (the prompt, and with
`logprobs` its tokens' log-probabilities, before the completion; with
`max_tokens: 0`, the scored prompt alone, as OpenAI's legacy API and vLLM give it), `stream`,
`stream_options.include_usage`; a null means the default. Types are strict
(`errors.read_body` validates with strict=True): `true` is not the token id 1
and `"yes"` is not a bool.

`n` samples of each prompt come back as `n` choices, choice `prompt_index · n +
sample_index` (vLLM's rule); `best_of`, if given, must equal `n`. The fields
this engine cannot honour (`best_of` > `n`, `logit_bias`, `suffix`, vLLM's
`prompt_logprobs`) are refused, not ignored: a client gets what it asked for,
or a 400 that says why. Unknown fields are ignored, as vLLM ignores them.

A body becomes the engine's `SamplingParams` in one place, `to_sampling_params`:
each field from the body field of its name, or from DERIVED. A SamplingParams
field that is neither stops this module from importing, so none is dropped
silently.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams
from .errors import APIError, param_of

# A list's validation stops at its first wrong item: a body of a million wrong items is one error, not a
# million (each turned into a Python dict, for seconds, with the GIL held), and the error names that item.
FAIL_FAST = Field(fail_fast=True)
Ints, Strs = Annotated[list[int], FAIL_FAST], Annotated[list[str], FAIL_FAST]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last event with `usage` and no choices, before [DONE]


class SamplingFields(BaseModel):
    """What every generating endpoint takes (OpenAI's fields, and vLLM's `top_k`, `stop_token_ids`,
    `ignore_eos`, `min_tokens`, `repetition_penalty`)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Strs | Ints | None = None
    stop_token_ids: Ints | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None  # refused when set, never silently ignored, as is:
    prompt_logprobs: int | None = None  # vLLM's own field; `echo` with `logprobs` scores the prompt here


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions."""
    prompt: str | Ints | Strs | Annotated[list[Ints], FAIL_FAST]
    logprobs: int | bool | None = None  # an integer here; a bool is taken only to be refused with a clear message
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template reads it: content as one string (text parts joined by a newline, as
        vLLM joins them)."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": content or "", **({"name": self.name} if self.name else {})}


class ChatCompletionRequest(SamplingFields):
    """The body of POST /v1/chat/completions: OpenAI's `messages`, `max_completion_tokens` (the newer name of
    `max_tokens`), and vLLM's `add_generation_prompt`."""
    messages: Annotated[list[ChatMessage], FAIL_FAST]
    max_tokens: int | None = None  # as OpenAI's chat: by default, up to the end of the context
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize, as vLLM takes it: a `prompt`, or `messages` for the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: Ints


# ---- what comes back ---------------------------------------------------------------------------------


@dataclass
class CompletionShape:
    """The bodies of /v1/completions: `text_completion` objects, streamed or whole, one choice per prompt."""
    model: str
    created: int
    id_prefix = "cmpl"

    def opening(self, request_id: str, index: int) -> list[dict]:
        return []  # a completion's first event is its first token's

    def chunk(self, request_id: str, delta: str, reason: str | None, index: int = 0, logprobs=None) -> dict:
        return self.whole(request_id, [self.choice(delta, reason, index, logprobs)])

    def choice(self, text: str, reason: str | None, index: int = 0, logprobs=None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def whole(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}


@dataclass
class ChatShape:
    """The bodies of /v1/chat/completions: a `chat.completion`, or `chat.completion.chunk` events whose
    first (per choice) carries only the role, as OpenAI and vLLM send it."""
    model: str
    created: int
    id_prefix = "chatcmpl"

    def _chunk(self, request_id: str, delta: dict, reason: str | None, index: int, logprobs=None) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def opening(self, request_id: str, index: int) -> list[dict]:
        return [self._chunk(request_id, {"role": "assistant", "content": ""}, None, index)]

    def chunk(self, request_id: str, delta: str, reason: str | None, index: int = 0, logprobs=None) -> dict:
        return self._chunk(request_id, {"content": delta}, reason, index, logprobs)

    def choice(self, text: str, reason: str | None, index: int = 0, logprobs=None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}

    def whole(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices}


def completion_logprobs(entries: list, token_text, offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs` object for (token id, TokenLogprobs or None) entries: each token's text, its
    log-probability, a dict of the top tokens' (the token itself included, as vLLM sends it), and each token's
    character offset in the choice's text, counting from `offset`. None (the first prompt token) stays None."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in entries:
        text = token_text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        top = None if lp is None else {token_text(t): v for t, v in lp.top}
        if top is not None:
            top.setdefault(text, lp.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: list, token_text) -> dict:
    """The chat API's `logprobs`: `content`, one {token, logprob, bytes, top_logprobs} per token."""
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(t, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}
                        for t, lp in entries]}


def logprobs_writer(shape, token_text):
    """f(entries, offset) → (the `logprobs` object in the shape's API, the next text offset)."""
    if isinstance(shape, ChatShape):
        return lambda entries, offset: (chat_logprobs(entries, token_text), offset)

    def write(entries, offset):
        out = completion_logprobs(entries, token_text, offset)
        return out, offset + sum(len(t) for t in out["tokens"])
    return write


def unsupported(body: SamplingFields) -> tuple[str, str] | None:
    """(why, which field) for the first field set to what this engine cannot do, or None."""
    if getattr(body, "suffix", None) is not None:
        return "suffix is not supported (GPT-2 has no fill-in-the-middle)", "suffix"
    if body.logit_bias:
        return "logit_bias is not supported; leave it out", "logit_bias"
    if body.prompt_logprobs is not None:
        return ("prompt_logprobs is not supported by this server's API; to score the prompt send /v1/completions "
                "with echo: true and logprobs: k (OpenAI's shape, the first token's logprob null)", "prompt_logprobs")
    return None


# ---- from a body to the engine's SamplingParams ------------------------------------------------------

# Every SamplingParams field is carried from a body field of the same name, or is one of these, which the
# server derives (each from what the comment says). `check_carried` runs when this module is imported: a new
# SamplingParams field that no body carries and that is not listed here stops the server from starting, so it
# cannot be dropped silently. Give the request types a field of its name, or derive it here.
DERIVED = {
    "max_tokens": "max_tokens (chat: max_completion_tokens first); null: the rest of the context",
    "logprobs": "completions: logprobs, an integer; chat: top_logprobs (0 if absent) when logprobs is true",
    "prompt_logprobs": "completions: logprobs when echo is true (vLLM's own prompt_logprobs field is refused)",
    "stop_token_ids": "stop_token_ids, and the token ids among stop",
    "best_of": "completions' best_of; chat has none",
}


def check_carried(params_type=SamplingParams, bodies=None) -> None:
    """Raise TypeError naming each field of `params_type` that a body type neither has nor DERIVED lists."""
    for body in bodies or (CompletionRequest, ChatCompletionRequest):
        dropped = [f.name for f in fields(params_type) if f.name not in DERIVED and f.name not in body.model_fields]
        if dropped:
            raise TypeError(f"{params_type.__name__} fields {dropped} are carried by no field of {body.__name__}: "
                            "a request could never set them. Add a field of that name to the request types "
                            "(protocol.py), or derive it in protocol.DERIVED")


def to_sampling_params(body: SamplingFields, derived: dict, params_type=SamplingParams):
    """The engine's params for `body`: each field from the body field of its name, or from `derived` (exactly
    the DERIVED ones); a null is the default. A value the params refuse is a 400 naming its field."""
    given = {}
    for f in fields(params_type):
        value = derived[f.name] if f.name in DERIVED else getattr(body, f.name)
        if value is not None:
            given[f.name] = value
    try:
        return params_type(**given)
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e), body)) from None


def num_logprobs(body: SamplingFields, most: int) -> int | None:
    """How many top log-probabilities per token the body asks for, or None; a 400 for a value out of place.
    Completions take `logprobs: k` (an integer); chat takes `logprobs: true` and `top_logprobs: k`."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, f"top_logprobs={top} needs logprobs=true; send both, or leave top_logprobs out",
                           "top_logprobs")
        if top is not None and top < 0:
            raise APIError(400, f"top_logprobs={top} must be in [0, {most}]: how many of the most likely "
                                "tokens to list at each position", "top_logprobs")
        return (top or 0) if body.logprobs else None
    k = getattr(body, "logprobs", None)
    if isinstance(k, bool):
        raise APIError(400, f"logprobs={str(k).lower()} is a boolean; in /v1/completions logprobs is how many of "
                            f"the most likely tokens to list at each position, an integer in [0, {most}] "
                            "(e.g. 1), or null; `logprobs: true` with `top_logprobs` is the chat API's", "logprobs")
    if k is not None and k < 0:
        raise APIError(400, f"logprobs={k} must be in [0, {most}] (this server's most, as vLLM's "
                            "max_logprobs): how many of the most likely tokens to list at each position", "logprobs")
    return k


check_carried()
