"""The request bodies, as OpenAI's and vLLM's clients send them.

The fields mean what they mean in the OpenAI and vLLM APIs: `prompt` (text, or
a list of token ids), `max_tokens` (default 16; null: the rest of the context),
`temperature`, `top_p`, `top_k`, `seed`, `stop` (strings, or token ids),
`stop_token_ids`, `ignore_eos`, `stream`, `stream_options.include_usage`; a
null means the default. Types are strict (`errors.read_body` validates with
strict=True): `true` is not the token id 1 and `"yes"` is not a bool.

`n` samples come back as `n` choices, each with its `index` (`best_of`, if
given, must equal `n`). The fields this engine cannot honour (`logprobs`,
`echo`, penalties, `logit_bias`, `suffix`) are refused, not ignored: a
client gets what it asked for, or a 400 that says why. Unknown fields are
ignored, as vLLM ignores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last event with `usage` and no choices, before [DONE]


class SamplingFields(BaseModel):
    """What every generating endpoint takes (OpenAI's fields, and vLLM's `top_k`, `stop_token_ids`,
    `ignore_eos`, `repetition_penalty`)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Fields this engine cannot honour: refused when set, never silently ignored.
    logprobs: int | bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions."""
    prompt: str | list[int] | list[str] | list[list[int]]
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
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template reads it: content as one string (text parts joined)."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content or "", **({"name": self.name} if self.name else {})}


class ChatCompletionRequest(SamplingFields):
    """The body of POST /v1/chat/completions: OpenAI's `messages`, `max_completion_tokens` (the newer name of
    `max_tokens`), and vLLM's `add_generation_prompt`."""
    messages: list[ChatMessage]
    max_tokens: int | None = None  # as OpenAI's chat: by default, up to the end of the context
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize, as vLLM takes it: a `prompt`, or `messages` for the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# ---- what comes back ---------------------------------------------------------------------------------


@dataclass
class CompletionShape:
    """The bodies of /v1/completions: `text_completion` objects, streamed or whole."""
    model: str
    created: int
    id_prefix = "cmpl"

    def opening(self, request_id: str, n: int) -> list[dict]:
        return []  # a completion's first event is its first token's

    def _choice(self, index: int, text: str, reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    def chunk(self, request_id: str, index: int, delta: str, reason: str | None) -> dict:
        return {"id": request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [self._choice(index, delta, reason)]}

    def whole(self, request_id: str, choices: list[tuple[str, str | None]]) -> dict:
        """The answer not streamed: one choice per sample, (text, finish reason) by index."""
        return {**self.chunk(request_id, 0, "", None), "choices": [self._choice(i, *c) for i, c in enumerate(choices)]}


@dataclass
class ChatShape:
    """The bodies of /v1/chat/completions: a `chat.completion`, or `chat.completion.chunk` events whose
    first carries only the role, as OpenAI and vLLM send it."""
    model: str
    created: int
    id_prefix = "chatcmpl"

    def _chunk(self, request_id: str, index: int, delta: dict, reason: str | None) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    def opening(self, request_id: str, n: int) -> list[dict]:
        return [self._chunk(request_id, i, {"role": "assistant", "content": ""}, None) for i in range(n)]

    def chunk(self, request_id: str, index: int, delta: str, reason: str | None) -> dict:
        return self._chunk(request_id, index, {"content": delta}, reason)

    def whole(self, request_id: str, choices: list[tuple[str, str | None]]) -> dict:
        return {"id": request_id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": reason} for i, (text, reason) in enumerate(choices)]}


def unsupported(body: SamplingFields) -> tuple[str, str] | None:
    """(why, which field) for the first field set to what this engine cannot do, or None."""
    if body.logprobs not in (None, False):
        return "logprobs are not supported by this server; leave the field out", "logprobs"
    if getattr(body, "echo", False):
        return "echo=true is not supported; the prompt you sent is yours already", "echo"
    if getattr(body, "suffix", None) is not None:
        return "suffix is not supported (GPT-2 has no fill-in-the-middle)", "suffix"
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if getattr(body, name) not in (None, neutral):
            return f"{name}={getattr(body, name)} is not supported; leave it out or at {neutral}", name
    if body.logit_bias:
        return "logit_bias is not supported; leave it out", "logit_bias"
    return None
