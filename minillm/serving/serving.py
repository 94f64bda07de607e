"""The work behind each endpoint: check a request, hand it to the engine thread, and shape what comes back.

As in vLLM's `entrypoints/openai`, an endpoint is three parts: `protocol.py`
holds the request and response types, this file does the work, and
`api_server.py` only routes. A completion goes:

    body ──limits──▶ ──tokenize (a thread)──▶ prompt ids + SamplingParams ──EngineLoop.submit_all──▶
         Accepted | Rejected (429, 503, 400), the body's prompts together
    engine thread ──RequestOutput──▶ text worker: the text each token added, its logprobs, its SSE event
         ──▶ the event loop, which only sends them (or, at the end, one JSON body written in a thread)

The event loop does no work that grows with what a client sent: every number
that sets a request's cost is checked first (`limits.py`), and tokenizing,
detokenizing, stop strings, logprob objects and large answers are done in
threads. `echo` with `max_tokens: 0` scores the prompt and generates nothing
that is sent (the engine runs one step, whose token is dropped); prompt +
`max_tokens` must fit `max_model_len`, and `max_tokens: null` is the rest of it.

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
from functools import lru_cache

from fastapi import Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse, format_sse_event

from .chat_template import ChatTemplate, ChatTemplateError
from .choices import EngineFailed, Prompt, TextWorker, merged, pieces
from .engine_loop import RETRY_AFTER_S, EngineLoop, Rejected
from .errors import APIError, error_body, error_response, param_of
from .limits import RequestBounds, ServerLimits, batch_of, longest_token_chars
from .prometheus import ServerMetrics
from .protocol import (ChatCompletionRequest, ChatShape, CompletionRequest, CompletionShape, DetokenizeRequest,
                       SamplingFields, TokenizeRequest, logprobs_writer, num_logprobs, to_sampling_params,
                       unsupported)
from .text_stream import StopStrings


class OpenAIServing:
    """What the endpoints need: the engine loop, the tokenizer, the model's name and root (the checkpoint it
    was loaded from), its chat template if it has one, the limits on a request, and the metrics."""

    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, max_model_len: int, root: str | None = None,
                 chat_template: ChatTemplate | None = None, limits: ServerLimits = ServerLimits(),
                 max_num_seqs: int = 256):
        self.loop, self.tokenizer, self.model_name, self.max_model_len = loop, tokenizer, model_name, max_model_len
        self.root, self.chat_template, self.limits = root or model_name, chat_template, limits
        self.bounds = RequestBounds(limits, max_num_seqs, loop.max_queue, max_model_len,
                                    longest_token_chars(tokenizer))
        self.metrics = ServerMetrics(loop, model_name)
        self.text = TextWorker()
        self.token_text = lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id]))

    def models(self) -> dict:
        """GET /v1/models, with vLLM's `root` (what --model named) and `max_model_len`."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "minillm", "root": self.root, "parent": None,
                                            "max_model_len": self.max_model_len}]}

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info, in vLLM's shape: what lm-eval's `tokenizer_backend=remote` reads (the special
        tokens' text, the chat template) to tokenize through /tokenize and /detokenize, with no files of its own."""
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id]) if self.tokenizer.eos_token_id is not None \
            else None
        return {"tokenizer_class": "GPT2TokenizerFast" if not self.tokenizer.is_fallback else "ByteTokenizer",
                "eos_token": eos, "bos_token": eos, "unk_token": eos, "pad_token": None, "add_bos_token": False,
                "model_max_length": self.max_model_len, "clean_up_tokenization_spaces": False,
                "chat_template": self.chat_template.source if self.chat_template else None}

    # ---- checking a request ----------------------------------------------------------------------

    def prompts(self, batch: list, echo: bool = False) -> list[tuple[list[int], str | None]]:
        """The body's prompts, one per choice: (token ids, the text if it was sent as text, or with `echo`
        decoded). Tokenizing and decoding are work: called off the event loop."""
        decode = self.tokenizer.decode if echo else lambda ids: None
        return [(self.tokenizer.encode(p), p) if isinstance(p, str) else (p, decode(p)) for p in batch]

    def params(self, body: SamplingFields, num_prompt_tokens: int, where: str, logprobs: int | None):
        """The engine's SamplingParams for one prompt of the body (`protocol.to_sampling_params`), and whether it
        only scores the prompt (`echo` with `max_tokens: 0`)."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = [s for s in stops if not isinstance(s, str)] + list(body.stop_token_ids or [])
        max_tokens = getattr(body, "max_completion_tokens", None)  # chat's newer name for max_tokens
        max_tokens = body.max_tokens if max_tokens is None else max_tokens
        echo = getattr(body, "echo", False)
        echo_only = echo and max_tokens == 0  # the engine generates one token, which is not sent
        if echo_only and num_prompt_tokens > self.max_model_len:
            raise self.bounds.too_long(where, num_prompt_tokens)
        new = 1 if echo_only else self.bounds.new_tokens(max_tokens, num_prompt_tokens, where)
        return to_sampling_params(body, {
            "max_tokens": new, "logprobs": logprobs, "prompt_logprobs": logprobs if echo else None,
            "stop_token_ids": tuple(stop_ids), "best_of": getattr(body, "best_of", None)}), echo_only

    def check(self, body: SamplingFields, batch: list) -> int | None:
        """Every check that needs no tokenizing, before any work; returns the logprobs asked per token."""
        self.check_model(body.model)
        problem = unsupported(body)
        if problem:
            raise APIError(400, *problem)
        logprobs = num_logprobs(body, self.limits.max_logprobs)
        self.bounds.check(body, batch, logprobs)
        return logprobs

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
                    response_id: str, logprobs: int | None, render) -> list[Prompt]:
        """Make each prompt's params, hand the body's prompts to the engine thread together, and wait for its
        answers (Accepted or Rejected). A prompt refused fails the body, naming its index, and aborts the rest."""
        stops = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or [] if isinstance(s, str)]
        automaton = StopStrings([s for s in stops if s])
        echo, choices, entries = getattr(body, "echo", False), [], 0
        many = len(prompts) > 1
        for i, (prompt, text) in enumerate(prompts):
            request_id, where = (f"{response_id}-{i}", f"prompt[{i}]") if many else (response_id, "prompt")
            params, echo_only = self.params(body, len(prompt), where, logprobs)
            positions = (0 if echo_only else params.max_tokens) + (len(prompt) if echo else 0)
            entries += params.n * positions * (1 + (logprobs or 0))
            choices.append((Prompt(i, request_id, prompt, automaton, asyncio.Queue(), params.n,
                                   text if echo else None, echo_only,
                                   render), params))
        if logprobs is not None:
            self.bounds.check_answer(entries, logprobs)
        self.loop.submit_all([(p.request_id, p.prompt, params, arrival,
                               self.text.deliverer(p, self.tokenizer.decode, self.loop.abort))
                              for p, params in choices])
        accepted: list[Prompt] = []
        try:
            for p, _ in choices:
                answer = await p.outputs.get()
                if isinstance(answer, Rejected):
                    raise self.refusal(answer, body, p.index if many else None)
                accepted.append(p)
        except BaseException:  # refused, or the client left: the prompts already accepted must not run on
            for p, _ in choices:
                self.loop.abort(p.request_id)
            raise
        return accepted

    def refusal(self, answer: Rejected, body: SamplingFields, index: int | None) -> APIError:
        self.metrics.rejected.labels(str(answer.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if answer.status in (429, 503) else None
        param = param_of(answer.message, body) if answer.status == 400 else None
        e = APIError(answer.status, answer.message, param, headers)
        if index is not None and answer.status == 400:  # name the prompt at fault
            e.message = f"prompt[{index}]: {e.message}"
            e.param = f"prompt[{index}]" if e.param in (None, "prompt") else e.param
        return e

    # ---- the endpoints ---------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest):
        """POST /v1/completions: n choices per prompt."""
        arrival = time.perf_counter()
        batch = batch_of(body.prompt)
        logprobs = self.check(body, batch)
        prompts = await asyncio.to_thread(self.prompts, batch, body.echo)  # tokenizing, off the event loop
        return await self.respond(body, prompts, arrival, CompletionShape(self.model_name, int(time.time())),
                                  logprobs)

    async def chat(self, body: ChatCompletionRequest):
        """POST /v1/chat/completions: the messages through the chat template, then as a completion."""
        arrival = time.perf_counter()
        logprobs = self.check(body, [])
        if len(body.messages) > self.max_model_len:  # a template marks each message with a token at least
            raise APIError(400, f"messages holds {len(body.messages)} messages, more than max_model_len="
                                f"{self.max_model_len} tokens hold (each takes one at least); send fewer", "messages")
        most = self.max_model_len * self.bounds.longest_token  # characters the context could hold

        def prompt_ids() -> list[int]:  # reading, rendering and tokenizing thousands of messages: off the loop
            chars = sum(len(m.as_template_input()["content"]) for m in body.messages)
            text = "" if chars > most else self.render_chat(body.messages, body.add_generation_prompt)
            if max(chars, len(text)) > most:  # the template may repeat what it renders: bounded before tokenizing
                raise APIError(400, f"the messages hold {max(chars, len(text))} characters as rendered, more than the "
                                    f"context of max_model_len={self.max_model_len} tokens holds; shorten them",
                               "messages")
            return self.tokenizer.encode(text)
        prompt = await asyncio.to_thread(prompt_ids)
        return await self.respond(body, [(prompt, None)], arrival, ChatShape(self.model_name, int(time.time())),
                                  logprobs)

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """POST /tokenize, as vLLM answers it."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either a prompt (text) or messages (for the chat template), not both "
                                "nor neither", "prompt")
        def answer() -> bytes:  # tokenizing megabytes and writing millions of ids: off the event loop
            text = body.prompt if body.messages is None else self.render_chat(body.messages, body.add_generation_prompt)
            tokens = self.tokenizer.encode(text)
            return json.dumps({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                               "token_strs": None}).encode()
        return Response(await asyncio.to_thread(answer), media_type="application/json")

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """POST /detokenize, as vLLM answers it."""
        self.check_model(body.model)
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"token id {t} at position {i} is outside the vocabulary [0, {vocab}); "
                                    "send ids that /tokenize gave", f"tokens[{i}]")
        text = await asyncio.to_thread(lambda: json.dumps({"prompt": self.tokenizer.decode(body.tokens)}).encode())
        return Response(text, media_type="application/json")

    async def respond(self, body: SamplingFields, prompts: list, arrival: float, shape, logprobs: int | None):
        """Run the request; its answer as server-sent events (`stream: true`) or as one body at its end."""
        response_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        write = None if logprobs is None else logprobs_writer(shape, self.token_text)
        render = None
        if body.stream:
            offsets: dict[int, int] = {}

            def render(index: int, piece) -> str:  # on the text worker: the logprob objects and the JSON
                lp = None
                if write is not None:
                    lp, offsets[index] = write(piece.entries, offsets.get(index, 0))
                return format_sse_event(data_str=json.dumps(shape.chunk(response_id, piece.text, piece.reason,
                                                                        index, lp)))
        started = await self.start(body, prompts, arrival, response_id, logprobs, render)
        streams = [pieces(p, self.loop.abort) for p in started]
        indices = [p.choice_index(j) for p in started for j in range(p.n)]  # every choice, in order

        def usage() -> dict:
            n_prompt, n = sum(len(p.prompt) for p in started), sum(sum(p.num_generated) for p in started)
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        if body.stream:
            async def events():
                """One event per generated token of each choice, as the engine makes them, then the usage and
                [DONE]."""
                each = merged(streams)
                try:
                    for index in indices:
                        for event in shape.opening(response_id, index):
                            yield format_sse_event(data_str=json.dumps(event))
                    async for _, piece in each:
                        yield piece.event
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

        def whole() -> bytes:  # the logprob objects and the JSON of the whole answer, off the event loop
            return json.dumps({**shape.whole(response_id, [
                shape.choice("".join(texts[p.choice_index(j)]), reasons[p.choice_index(j)], p.choice_index(j),
                             None if write is None else write(p.entries[j], 0)[0])
                for p in started for j in range(p.n)]), "usage": usage()}).encode()
        return Response(await asyncio.to_thread(whole), media_type="application/json")


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
