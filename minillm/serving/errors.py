"""Every error in OpenAI's shape, and a request body read so that no input can become a 500.

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

`message` is one line that names the value, the limit and the fix; `param` names
the field when there is one (`prompt[0]`, `stream_options.include_usage`), else
null; `code` is the HTTP status. Only a fault of the server is a 5xx.

A body is read in the order that its faults can occur, each with its own 4xx:

    more than MAX_BODY_BYTES          413, told by Content-Length before a byte is read
                                      (the limit is `serve --max-body-bytes`)
    not whole within --body-timeout   408 (a client that trickles its body holds a socket)
    not UTF-8                         400, naming the byte and its offset
    not JSON (NaN and Infinity too)   400, naming the line and column
    a number of over 4300 digits      400 (Python refuses to convert it: the cost grows as its square)
    nested too deep for the parser    400
    not an object                     400
    a string that is not Unicode      400, naming the field (a lone surrogate such as "\\ud800"
                                      is valid JSON, but no tokenizer and no UTF-8 encoder takes it)
    a field of the wrong type         400, naming the field; types are strict: a bool is not an
                                      integer, a string is not a bool

The error body is written in ASCII, so that no message, whatever it quotes, can
fail to encode.
"""
from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

MAX_BODY_BYTES = 4 * 2**20  # a prompt of a million-token context, as ids, fits in a few MiB
OFF_LOOP_BYTES = 16 * 2**10  # a body larger than this is parsed in a worker thread
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An answer other than 200: its status, its one-line message, the field it concerns, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": " ".join(message.split()), "type": kind, "param": param, "code": status}}


class ASCIIJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    return ASCIIJSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# ---- reading a body ---------------------------------------------------------------------------------


async def read_body(request: Request, model: type[BaseModel], max_bytes: int = MAX_BODY_BYTES,
                    timeout: float = 30.0) -> BaseModel:
    """The request's body as `model`, or an APIError saying what is wrong with it (see the module's table)."""
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, model, max_bytes)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive whole within {timeout:g} s; send it at once, or start "
                            "`serve` with a larger --body-timeout", headers={"Connection": "close"}) from None


async def _read_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    def too_large(size: str) -> APIError:
        return APIError(413, f"the body ({size}) is over {max_bytes} bytes, the most this server reads; "
                             "send a shorter prompt (no context holds one this long), or start `serve` with a "
                             "larger --max-body-bytes")
    declared = request.headers.get("content-length", "")
    if len(declared) > 20 or (declared.isascii() and declared.isdigit() and int(declared) > max_bytes):
        raise too_large(f"Content-Length: {declared[:20]}{'...' if len(declared) > 20 else ''}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise too_large("as read")
    if len(raw) > OFF_LOOP_BYTES:  # parsing and validating megabytes is work: not on the event loop
        return await asyncio.to_thread(parse_body, bytes(raw), model)
    return parse_body(bytes(raw), model)


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                            "cannot start or continue a character; send JSON encoded in UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # not a JSONDecodeError: an integer of more digits than Python converts
        raise APIError(400, f"the body holds a number Python will not read: {e.args[0].split(':')[0]}; no "
                            "field of a request needs more than 20 digits") from None
    except RecursionError:
        raise APIError(400, "the body nests arrays or objects deeper than this server parses; no field of a "
                            "request nests more than 3 levels") from None
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")
        raise APIError(400, f"the body is {kind}, not a JSON object; send an object, e.g. "
                            '{"prompt": "Hello", "max_tokens": 16}')
    _check_unicode(obj, "")
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        message, param = describe(e, obj)
        raise APIError(400, message, param) from None


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not a JSON number (use a finite number, or leave the field out)",
                               name, 0)


def _check_unicode(value, path: str) -> None:
    """Refuse a string that no UTF-8 encoder takes (a lone surrogate), naming where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = path or "a key"
            raise APIError(400, f"{where}: the text has a lone surrogate, {value[e.start]!r}, at character "
                                f"{e.start}; it is not Unicode text. Send the character whole (its pair, or "
                                "its UTF-8)", path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")


def describe(error: ValidationError, obj: dict) -> tuple[str, str]:
    """One line for a validation error, and the field it names. Of a union's errors (`prompt` may be text or
    token ids), the one that reached deepest into what was sent says the most."""
    best = max(error.errors(), key=lambda e: _path(e, obj)[1])
    param = _path(best, obj)[0]
    if best["type"] == "missing":
        return f"{param} is required", param
    sent = json.dumps(best["input"])
    sent = sent if len(sent) <= 40 else sent[:37] + "..."
    expected = re.sub(r"^Input should be ", "", best["msg"])
    return f"{param} is {sent}; it must be {expected}", param


def _path(err: dict, obj) -> tuple[str, int]:
    """The part of an error's `loc` that indexes what was sent (pydantic's names of union branches dropped),
    as a path such as `messages[1].content`, and how many steps deep it goes."""
    loc, path, depth = err["loc"], "", 0
    for i, key in enumerate(loc):
        missing = err["type"] == "missing" and i == len(loc) - 1
        if isinstance(obj, dict) and isinstance(key, str) and (key in obj or missing):
            path, obj = f"{path}.{key}" if path else key, obj.get(key)
        elif isinstance(obj, list) and isinstance(key, int) and 0 <= key < len(obj):
            path, obj = f"{path}[{key}]", obj[key]
        else:
            continue
        depth += 1
    return path, depth


def param_of(message: str, body: BaseModel) -> str:
    """The field of `body` an engine's ValueError is about. SamplingParams' messages start with it (`top_p=1.5
    must be ...`); the engine's own name the prompt, a stop token id, or max_tokens where it is the one to
    lower."""
    named = re.match(r"(\w+)=", message)
    if named and named.group(1) in type(body).model_fields:
        return named.group(1)
    stop_id = re.match(r"(?:a )?stop token id[ =](-?\d+)", message)
    if stop_id:
        return "stop_token_ids" if int(stop_id.group(1)) in (body.stop_token_ids or []) else "stop"
    return "max_tokens" if "lower max_tokens" in message else "prompt"
