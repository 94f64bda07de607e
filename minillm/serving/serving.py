"""The work behind each endpoint: check a request, hand it to the engine thread, and shape what comes back.

As in vLLM's `entrypoints/openai`, an endpoint is three parts: `protocol.py`
holds the request and response types, this file does the work, and
`api_server.py` only routes. A completion goes:

    body ──check──▶ prompt ids + SamplingParams ──EngineLoop.submit──▶ Accepted | Rejected (429, 503, 400)
         ◀── one RequestOutput per step ◀── engine thread
    RequestOutput ──TextStream──▶ the text each token added ──▶ an SSE event, or one JSON body at the end

A request of `n` samples is one engine request (its prompt prefilled once, its
blocks shared: `parallel_sampling.py`) and `n` choices, each with its own text
stream; its usage counts every sample's tokens. A request whose client is gone
is aborted at once, all its samples together, and a sample whose text hit a
stop string alone, so the engine frees their blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event

from ..sequence import CompletionOutput
from ..sampling_params import FINISH_ABORT, FINISH_STOP, SamplingParams
from .chat_template import ChatTemplate, ChatTemplateError
from .engine_loop import RETRY_AFTER_S, EngineLoop, Failed, Rejected
from .errors import APIError, error_body, error_response, param_of
from .prometheus import ServerMetrics
from .protocol import (ChatCompletionRequest, ChatShape, CompletionRequest, CompletionShape, DetokenizeRequest,
                       SamplingFields, TokenizeRequest, unsupported)
from .text_stream import TextStream


class OpenAIServing:
    """What the endpoints need: the engine loop, the tokenizer, the model's name and root (the checkpoint it
    was loaded from), its chat template if it has one, and the metrics."""

    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, max_model_len: int, root: str | None = None,
                 chat_template: ChatTemplate | None = None):
        self.loop, self.tokenizer, self.model_name, self.max_model_len = loop, tokenizer, model_name, max_model_len
        self.root, self.chat_template = root or model_name, chat_template
        self.metrics = ServerMetrics(loop)

    def models(self) -> dict:
        """GET /v1/models, with vLLM's `root` (what --model named) and `max_model_len`."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "minillm", "root": self.root, "parent": None,
                                            "max_model_len": self.max_model_len}]}

    # ---- checking a request ----------------------------------------------------------------------

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"the prompt is a batch of {len(prompt)} prompts; this server takes one "
                                    "prompt per request: send one request for each", "prompt")
            prompt = prompt[0]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def params(self, body: SamplingFields, num_prompt_tokens: int) -> tuple[SamplingParams, list[str]]:
        """The engine's SamplingParams for the body (a null field: its default), and the stop strings."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_strings = [s for s in stops if isinstance(s, str)]
        stop_ids = [s for s in stops if not isinstance(s, str)] + list(body.stop_token_ids or [])
        max_tokens = getattr(body, "max_completion_tokens", None)  # chat's newer name for max_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        if max_tokens is None:  # null: up to the end of the context
            max_tokens = self.max_model_len - num_prompt_tokens + 1
        given = {k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p),
                                   ("top_k", body.top_k)) if v is not None}
        try:
            return SamplingParams(**given, max_tokens=max_tokens, seed=body.seed, stop_token_ids=tuple(stop_ids),
                                  ignore_eos=body.ignore_eos, n=body.n, best_of=getattr(body, "best_of", None)), \
                stop_strings
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e), body)) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model")

    def render_chat(self, messages, add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise APIError(400, f"{self.model_name!r} has no chat template (GPT-2 was never trained to chat); "
                                "start the server with --chat-template FILE (a Jinja template, as vLLM takes), "
                                "or send a prompt to /v1/completions", "messages")
        try:
            return self.chat_template.render([m.as_template_input() for m in messages], add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None

    async def start(self, body: SamplingFields, prompt: list[int], arrival: float, id_prefix: str) -> tuple[
            str, SamplingParams, list[str], asyncio.Queue]:
        """Check the request, hand it to the engine thread, and wait for its answer (Accepted or Rejected)."""
        self.check_model(body.model)
        problem = unsupported(body)
        if problem:
            raise APIError(400, *problem)
        params, stops = self.params(body, len(prompt))
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the handler is gone, nobody to tell
                pass

        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.loop.submit(request_id, prompt, params, arrival, put)
        try:
            answer = await outputs.get()
        except asyncio.CancelledError:  # the client left before the engine answered
            self.loop.abort(request_id)
            raise
        if isinstance(answer, Rejected):
            self.metrics.rejected.labels(str(answer.status)).inc()
            headers = {"Retry-After": str(RETRY_AFTER_S)} if answer.status in (429, 503) else None
            param = param_of(answer.message, body) if answer.status == 400 else None
            raise APIError(answer.status, answer.message, param, headers)
        return request_id, params, stops, outputs

    # ---- the text, token by token ------------------------------------------------------------------

    async def deltas(self, request_id: str, outputs: asyncio.Queue, texts: list[TextStream]):
        """Yield (sample index, the text each token added, None, its tokens so far), and last for each sample
        (index, its text, its finish reason, its tokens); `texts` holds one stream per sample.

        The request is aborted when this generator is left before the engine finished it: the client left (the
        handler was cancelled while it awaited the next output), or stop strings ended every sample's text. A
        step that failed raises EngineFailed."""
        done, seen, finished = [False] * len(texts), [0] * len(texts), False
        try:
            while not all(done):
                out = await outputs.get()
                if isinstance(out, Failed):
                    finished = True  # the engine loop has aborted it already
                    raise EngineFailed(out.message)
                finished = out.finished
                for sample in out.outputs:
                    j, text, ids = sample.index, texts[sample.index], sample.token_ids
                    first, seen[j] = seen[j] + 1, len(ids)
                    for count in range(first, len(ids) + 1):
                        if done[j]:
                            break
                        last = sample.finish_reason is not None and count == len(ids)
                        delta = text.update(ids[:count], last)
                        done[j] = last or text.stopped
                        yield j, delta, _reason(sample, text) if done[j] else None, count
                        if text.stopped and not all(done):  # a stop string ended this one: the others go on
                            self.loop.abort(request_id, j)
                    if sample.finish_reason is not None and not done[j]:  # aborted before another token
                        done[j] = True
                        yield j, text.update(ids, True), _reason(sample, text), len(ids)
        finally:
            if not finished:
                self.loop.abort(request_id)

    # ---- the endpoints ---------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest):
        """POST /v1/completions."""
        arrival = time.perf_counter()
        return await self.respond(body, self.prompt_ids(body.prompt), arrival,
                                  CompletionShape(self.model_name, int(time.time())))

    async def chat(self, body: ChatCompletionRequest):
        """POST /v1/chat/completions: the messages through the chat template, then as a completion."""
        arrival = time.perf_counter()
        self.check_model(body.model)
        prompt = self.tokenizer.encode(self.render_chat(body.messages, body.add_generation_prompt))
        return await self.respond(body, prompt, arrival, ChatShape(self.model_name, int(time.time())))

    def tokenize(self, body: TokenizeRequest) -> dict:
        """POST /tokenize, as vLLM answers it."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either a prompt (text) or messages (for the chat template), not both "
                                "nor neither", "prompt")
        text = body.prompt if body.messages is None else self.render_chat(body.messages, body.add_generation_prompt)
        tokens = self.tokenizer.encode(text)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """POST /detokenize, as vLLM answers it."""
        self.check_model(body.model)
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"token id {t} at position {i} is outside the vocabulary [0, {vocab}); "
                                    "send ids that /tokenize gave", f"tokens[{i}]")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def respond(self, body: SamplingFields, prompt: list[int], arrival: float, shape):
        """Run the request; its answer as server-sent events (`stream: true`) or as one body at its end."""
        request_id, params, stops, outputs = await self.start(body, prompt, arrival, shape.id_prefix)
        tokens = self.deltas(request_id, outputs, [TextStream(self.tokenizer.decode, stops) for _ in range(params.n)])
        counts = [0] * params.n  # tokens of each sample

        def usage(num_generated: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": num_generated,
                    "total_tokens": len(prompt) + num_generated}

        if body.stream:
            async def events():
                """One event per generated token, as the engine makes them, then the usage and [DONE]."""
                try:
                    for event in shape.opening(request_id, params.n):
                        yield format_sse_event(data_str=json.dumps(event))
                    async for j, delta, reason, counts[j] in tokens:
                        yield format_sse_event(data_str=json.dumps(shape.chunk(request_id, j, delta, reason)))
                except EngineFailed as e:
                    yield format_sse_event(data_str=json.dumps(error_body(500, str(e))))
                    return
                finally:
                    await tokens.aclose()  # a client that left: abort now, not when the generator is collected
                if body.stream_options and body.stream_options.include_usage:
                    yield format_sse_event(data_str=json.dumps(
                        {**shape.chunk(request_id, 0, "", None), "choices": [], "usage": usage(sum(counts))}))
                yield format_sse_event(data_str="[DONE]")

            return EventSourceResponse(events(), headers={"Cache-Control": "no-cache"})

        parts, reasons = [[] for _ in counts], [None] * params.n  # not streamed: one body at the end
        try:  # (a client that leaves cancels this)
            async for j, delta, reasons[j], counts[j] in tokens:
                parts[j].append(delta)
        except EngineFailed as e:
            return error_response(500, str(e))
        finally:
            await tokens.aclose()
        return {**shape.whole(request_id, [("".join(p), r) for p, r in zip(parts, reasons)]),
                "usage": usage(sum(counts))}


class EngineFailed(Exception):
    """The engine step running this request raised; the message says how."""


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone: after the body, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancelled_when_client_leaves(work, request: Request):
    """Await `work` (a handler's coroutine), cancelling it if the client disconnects first, as vLLM's
    `with_cancellation` does: a client that stops waiting for a non-streamed answer aborts its request at
    once, not after its last token. Returns work's result, or a 499 response nobody will read."""
    handler, listener = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait([handler, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (handler, listener):
            if not task.done():
                task.cancel()
    if handler.done() and not handler.cancelled():
        return handler.result()
    await asyncio.gather(handler, return_exceptions=True)  # its finally blocks (the abort) have run
    return Response(status_code=499)


def _reason(out: CompletionOutput, text: TextStream) -> str:
    return FINISH_STOP if text.stopped else (out.finish_reason or FINISH_ABORT)
