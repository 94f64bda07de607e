"""The work behind each endpoint: check a request, hand it to the engine thread, and shape what comes back.

As in vLLM's `entrypoints/openai`, an endpoint is three parts: `protocol.py`
holds the request and response types, this file does the work, and
`api_server.py` only routes. A completion goes:

    body ──check──▶ prompt ids + SamplingParams ──EngineLoop.submit──▶ Accepted | Rejected (429, 503, 400)
         ◀── one RequestOutput per step ◀── engine thread
    RequestOutput ──choices.pieces──▶ the text each token added ──▶ an SSE event, or one JSON body at the end

A batch of prompts is one engine request per prompt, each of `n` samples (its
prompt prefilled once, its blocks shared: `parallel_sampling.py`), and `n`
choices each, numbered prompt_index · n + sample_index (`choices.py`); usage
counts each prompt's tokens once and every sample's. A prompt the engine
refuses fails the whole body with a 400 naming its index, and aborts the
others. A request whose client is gone is aborted at once, all its samples
together, and a sample whose text hit a stop string alone, so the engine frees
their blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from .chat_template import ChatTemplate, ChatTemplateError
from .choices import EngineFailed, Prompt, merged, pieces
from .engine_loop import RETRY_AFTER_S, EngineLoop, Rejected
from .errors import APIError, error_body, error_response, param_of
from .prometheus import ServerMetrics
from .protocol import (ChatCompletionRequest, ChatShape, CompletionRequest, CompletionShape, DetokenizeRequest,
                       SamplingFields, TokenizeRequest, chat_logprobs, completion_logprobs, unsupported)


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

    def prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """The body's prompts, one per choice: (token ids, the text if it was sent as text)."""
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        return [(self.tokenizer.encode(p), p) if isinstance(p, str) else (p, None) for p in batch]

    def params(self, body: SamplingFields, num_prompt_tokens: int) -> tuple[SamplingParams, list[str]]:
        """The engine's SamplingParams for the body (a null field: its default), and the stop strings."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_strings = [s for s in stops if isinstance(s, str)]
        stop_ids = [s for s in stops if not isinstance(s, str)] + list(body.stop_token_ids or [])
        max_tokens = getattr(body, "max_completion_tokens", None)  # chat's newer name for max_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        if max_tokens is None:  # null: up to the end of the context
            max_tokens = self.max_model_len - num_prompt_tokens + 1
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_tokens", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty")
                 if getattr(body, k) is not None}
        logprobs = num_logprobs(body)
        if logprobs is not None:
            given["logprobs"] = logprobs
            if getattr(body, "echo", False):  # the prompt's own tokens, scored: what loglikelihood needs
                given["prompt_logprobs"] = logprobs
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

    async def start(self, body: SamplingFields, prompts: list[tuple[list[int], str | None]], arrival: float,
                    response_id: str) -> list[Prompt]:
        """Check the request, hand each prompt to the engine thread, and wait for its answer (Accepted or
        Rejected). A prompt refused fails the body, naming its index, and aborts those already accepted."""
        self.check_model(body.model)
        problem = unsupported(body)
        if problem:
            raise APIError(400, *problem)
        choices: list[Prompt] = []
        try:
            for i, (prompt, text) in enumerate(prompts):
                request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
                try:
                    choices.append(await self._start_one(body, prompt, arrival, request_id, i, text))
                except APIError as e:
                    if len(prompts) > 1:  # name the prompt at fault
                        e.message = f"prompt[{i}]: {e.message}"
                        e.param = f"prompt[{i}]" if e.param in (None, "prompt") else e.param
                    raise
        except BaseException:  # refused, or the client left: the prompts already accepted must not run on
            for choice in choices:
                self.loop.abort(choice.request_id)
            raise
        return choices

    async def _start_one(self, body: SamplingFields, prompt: list[int], arrival: float, request_id: str,
                         index: int, text: str | None) -> Prompt:
        params, stops = self.params(body, len(prompt))
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the handler is gone, nobody to tell
                pass

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
        echo = None
        if getattr(body, "echo", False):
            echo = text if text is not None else self.tokenizer.decode(prompt)
        return Prompt(index, request_id, prompt, stops, outputs, params.n, echo)

    # ---- the endpoints ---------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest):
        """POST /v1/completions: n choices per prompt."""
        arrival = time.perf_counter()
        return await self.respond(body, self.prompts(body.prompt), arrival,
                                  CompletionShape(self.model_name, int(time.time())))

    async def chat(self, body: ChatCompletionRequest):
        """POST /v1/chat/completions: the messages through the chat template, then as a completion."""
        arrival = time.perf_counter()
        self.check_model(body.model)
        prompt = self.tokenizer.encode(self.render_chat(body.messages, body.add_generation_prompt))
        return await self.respond(body, [(prompt, None)], arrival, ChatShape(self.model_name, int(time.time())))

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

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs_writer(self, body: SamplingFields, shape):
        """f(entries, offset) → (the `logprobs` object, the next text offset), or None when not asked for."""
        if num_logprobs(body) is None:
            return None
        if isinstance(shape, ChatShape):
            return lambda entries, offset: (chat_logprobs(entries, self.token_text), offset)

        def write(entries, offset):
            out = completion_logprobs(entries, self.token_text, offset)
            return out, offset + sum(len(t) for t in out["tokens"])
        return write

    async def respond(self, body: SamplingFields, prompts: list, arrival: float, shape):
        """Run the request; its answer as server-sent events (`stream: true`) or as one body at its end."""
        response_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        started = await self.start(body, prompts, arrival, response_id)
        streams = [pieces(p, self.tokenizer.decode, self.loop.abort) for p in started]
        write = self.logprobs_writer(body, shape)
        indices = [p.choice_index(j) for p in started for j in range(p.n)]  # every choice, in order

        def usage() -> dict:
            n_prompt, n = sum(len(p.prompt) for p in started), sum(sum(p.num_generated) for p in started)
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        if body.stream:
            async def events():
                """One event per generated token of each choice, as the engine makes them, then the usage and
                [DONE]."""
                offsets = dict.fromkeys(indices, 0)
                each = merged(streams)
                try:
                    for index in indices:
                        for event in shape.opening(response_id, index):
                            yield format_sse_event(data_str=json.dumps(event))
                    async for i, piece in each:
                        index, logprobs = started[i].choice_index(piece.sample), None
                        if write is not None:
                            logprobs, offsets[index] = write(piece.entries, offsets[index])
                        event = shape.chunk(response_id, piece.text, piece.reason, index, logprobs)
                        yield format_sse_event(data_str=json.dumps(event))
                except EngineFailed as e:
                    yield format_sse_event(data_str=json.dumps(error_body(500, str(e))))
                    return
                finally:
                    await each.aclose()  # a client that left: abort now, not when the generator is collected
                if body.stream_options and body.stream_options.include_usage:
                    yield format_sse_event(data_str=json.dumps(
                        {**shape.whole(response_id, []), **({"object": "chat.completion.chunk"}
                                                            if isinstance(shape, ChatShape) else {}),
                         "usage": usage()}))
                yield format_sse_event(data_str="[DONE]")

            return EventSourceResponse(events(), headers={"Cache-Control": "no-cache"})

        # Not streamed: one body at the end (a client that leaves cancels this, and `merged` aborts the rest).
        texts, reasons = {index: [] for index in indices}, dict.fromkeys(indices)
        each = merged(streams)
        try:
            async for i, piece in each:
                index = started[i].choice_index(piece.sample)
                texts[index].append(piece.text)
                reasons[index] = piece.reason or reasons[index]
        except EngineFailed as e:
            return error_response(500, str(e))
        finally:
            await each.aclose()
        return {**shape.whole(response_id, [
            shape.choice("".join(texts[p.choice_index(j)]), reasons[p.choice_index(j)], p.choice_index(j),
                         None if write is None else write(p.entries[j], 0)[0])
            for p in started for j in range(p.n)]), "usage": usage()}


def num_logprobs(body: SamplingFields) -> int | None:
    """How many top log-probabilities per token the body asks for, or None; a 400 for a value out of place.
    Completions take `logprobs: k` (an integer); chat takes `logprobs: true` and `top_logprobs: k`."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, f"top_logprobs={top} needs logprobs=true; send both, or leave top_logprobs out",
                           "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={top} must be in [0, {MAX_LOGPROBS}]: how many of the most likely "
                                "tokens to list at each position", "top_logprobs")
        return (top or 0) if body.logprobs else None
    k = getattr(body, "logprobs", None)
    if isinstance(k, bool):
        raise APIError(400, f"logprobs={str(k).lower()} is a boolean; in /v1/completions logprobs is how many of "
                            f"the most likely tokens to list at each position, an integer in [0, {MAX_LOGPROBS}] "
                            "(e.g. 1), or null; `logprobs: true` with `top_logprobs` is the chat API's", "logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs={k} must be in [0, {MAX_LOGPROBS}] (this server's most, as vLLM's "
                            "max_logprobs): how many of the most likely tokens to list at each position", "logprobs")
    return k


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
