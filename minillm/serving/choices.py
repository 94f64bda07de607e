"""One choice of an answer: one prompt's request in the engine, turned into pieces of text and their tokens.

A completion body may hold a batch of prompts (a list of strings, or of token
id lists); each becomes an engine request of its own and a choice of the one
answer, its `index` its place in the batch (vLLM's rule is prompt_index · n +
sample_index; here n = 1). Streamed, the choices' events interleave as their
tokens come, each naming its index; whole, the answer lists them in order.

A piece is what one event carries: the text its token added (the echoed
prompt's text too, before the first), and the (token id, TokenLogprobs)
entries it covers, from which the endpoint writes its `logprobs`.

A request whose client is gone, or whose text hit a stop string, is aborted at
once (the generator's `finally`), so the engine frees its blocks.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from ..engine import RequestOutput
from ..sampling_params import FINISH_ABORT, FINISH_STOP
from .engine_loop import Failed
from .text_stream import TextStream


class EngineFailed(Exception):
    """The engine step running this request raised; the message says how."""


@dataclass
class Choice:
    """One prompt's request: where its outputs arrive, and what its text needs (stop strings, echo)."""
    index: int
    request_id: str
    prompt: list[int]
    stops: list[str]
    outputs: asyncio.Queue
    echo: str | None = None  # the prompt's text, sent before the completion's (`echo: true`)
    num_generated: int = 0
    entries: list = field(default_factory=list)  # every (token id, TokenLogprobs | None) sent so far


@dataclass
class Piece:
    text: str
    reason: str | None  # set on the choice's last piece
    entries: list       # (token id, TokenLogprobs | None) of the tokens this piece adds, the echoed prompt's first


async def pieces(choice: Choice, decode: Callable[[list[int]], str], abort: Callable[[str], None]):
    """Yield the choice's pieces, one per generated token, the last with its finish reason. A step that failed
    raises EngineFailed. Leaving early (the client left, a stop string) aborts the request."""
    text, done, generated, echo = TextStream(decode, choice.stops), False, [], choice.echo
    try:
        while not done:
            out = await choice.outputs.get()
            if isinstance(out, Failed):
                done = True  # the engine loop has aborted it already
                raise EngineFailed(out.message)
            new, generated = out.output_token_ids[len(generated):], out.output_token_ids
            for k in range(len(new)):
                n = len(generated) - len(new) + k + 1
                last = out.finished and k == len(new) - 1
                delta = text.update(generated[:n], last)
                done = last or text.stopped
                entries = [(generated[n - 1], out.logprobs[n - 1] if out.logprobs else None)]
                if echo is not None:
                    delta, entries, echo = echo + delta, _prompt_entries(choice.prompt, out) + entries, None
                choice.num_generated = n
                yield _piece(choice, delta, _reason(out, text) if done else None, entries)
                if done:
                    break
            if out.finished and not new:  # aborted before another token
                done = True
                head, entries = ("", []) if echo is None else (echo, _prompt_entries(choice.prompt, out))
                yield _piece(choice, head + text.update(generated, True), _reason(out, text), entries)
    finally:
        if not done or text.stopped:
            abort(choice.request_id)


def _piece(choice: Choice, text: str, reason: str | None, entries: list) -> Piece:
    choice.entries += entries
    return Piece(text, reason, entries)


def _prompt_entries(prompt: list[int], out: RequestOutput) -> list:
    """The prompt's tokens, each with its log-probability when the request asked (the first has none)."""
    lps = out.prompt_logprobs or [None] * len(prompt)
    return list(zip(prompt, lps))


def _reason(out: RequestOutput, text: TextStream) -> str:
    return FINISH_STOP if text.stopped else (out.finish_reason or FINISH_ABORT)


async def merged(streams: list):
    """(choice number, piece) from several piece generators as each comes; each generator is closed (its
    request aborted if unfinished) when this one is left, or when one raises (which is raised here)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for piece in gen:
                await queue.put((i, piece))
            await queue.put((i, None))
        except EngineFailed as e:
            await queue.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, EngineFailed):
                raise item
            if item is None:
                left -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their finally blocks (the aborts) have run
