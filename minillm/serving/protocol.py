"""The body of POST /v1/completions, its checks, and OpenAI's error shape.

The request fields mean what they mean in the OpenAI and vLLM APIs: `prompt`
(text, or a list of token ids), `max_tokens` (default 16), `temperature`,
`top_p`, `top_k`, `seed`, `stop` (strings, or token ids), `stop_token_ids`,
`ignore_eos`, `stream`, `stream_options.include_usage`. `n` must be 1, and the
fields this engine cannot honour (`logprobs`, `echo`, `best_of` > 1, penalties,
`logit_bias`, `suffix`) are refused, not ignored: a client gets what it asked
for, or a 400 that says why.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's fields, and vLLM's `top_k`, `stop_token_ids`, `ignore_eos`)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    # Fields this engine cannot honour: refused when set, never silently ignored.
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_body(status: int, message: str) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(status, "ServiceUnavailable")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def unsupported(body: CompletionRequest) -> str | None:
    if body.n != 1:
        return f"n={body.n}: this server returns one completion per request (n=1); send {body.n} requests instead"
    if body.best_of not in (None, 1):
        return f"best_of={body.best_of} is not supported; only best_of=1 (one sample, returned)"
    if body.logprobs is not None:
        return "logprobs are not supported by this server; leave the field out"
    if body.echo:
        return "echo=true is not supported; the prompt you sent is yours already"
    if body.suffix is not None:
        return "suffix is not supported (GPT-2 has no fill-in-the-middle)"
    if body.presence_penalty or body.frequency_penalty or body.logit_bias:
        return "presence_penalty, frequency_penalty and logit_bias are not supported; leave them out or at 0"
    return None
