"""The choices of an answer: each prompt's request in the engine, its samples turned into pieces of text.

A completion body may hold a batch of prompts (a list of strings, or of token
id lists); each becomes an engine request of its own, of `n` samples (one
prefill, shared blocks: `parallel_sampling.py`), and `n` choices of the one
answer. Choice `prompt_index · n + sample_index` is sample j of prompt i, as
vLLM numbers them. Streamed, the choices' events interleave as their tokens
come, each naming its index; whole, the answer lists them in order.

A piece is what one event carries: the sample it belongs to, the text its token
added (with `echo`, the prompt's text too before the first: every sample's
choice carries the prompt, as vLLM's do), and the (token id, TokenLogprobs)
entries it covers, from which the endpoint writes its `logprobs`. A sample's
entries are its own; the prompt's are the request's, the same for each sample.

A request whose client is gone is aborted at once, all its samples (the
generator's `finally`), and a sample whose text hit a stop string alone, so the
engine frees their blocks.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from ..sampling_params import FINISH_ABORT, FINISH_STOP
from ..sequence import CompletionOutput, RequestOutput
from .engine_loop import Failed
from .text_stream import TextStream


class EngineFailed(Exception):
    """The engine step running this request raised; the message says how."""


@dataclass
class Prompt:
    """One prompt's request: where its outputs arrive, what its text needs (stop strings, echo), and what each
    of its n samples has sent so far."""
    index: int  # its place in the batch
    request_id: str
    prompt: list[int]
    stops: list[str]
    outputs: asyncio.Queue
    n: int = 1
    echo: str | None = None  # the prompt's text, sent before each sample's completion (`echo: true`)
    num_generated: list[int] = field(default_factory=list)  # per sample
    entries: list[list] = field(default_factory=list)  # per sample: every (token id, TokenLogprobs | None) sent

    def __post_init__(self):
        self.num_generated = self.num_generated or [0] * self.n
        self.entries = self.entries or [[] for _ in range(self.n)]

    def choice_index(self, sample: int) -> int:
        """The index of its sample `sample` among the answer's choices (vLLM's rule)."""
        return self.index * self.n + sample


@dataclass
class Piece:
    sample: int         # which of its prompt's n samples
    text: str
    reason: str | None  # set on the sample's last piece
    entries: list       # (token id, TokenLogprobs | None) of the tokens this piece adds, the echoed prompt's first


async def pieces(p: Prompt, decode: Callable[[list[int]], str], abort: Callable[..., None]):
    """Yield the pieces of the prompt's samples, one per generated token, each sample's last with its finish
    reason. A step that failed raises EngineFailed. Leaving before the engine finished the request (the client
    left, stop strings ended every sample) aborts it; a stop string that ends one sample aborts that one alone."""
    texts = [TextStream(decode, p.stops) for _ in range(p.n)]
    done, seen, echo, finished = [False] * p.n, [0] * p.n, [p.echo] * p.n, False
    try:
        while not all(done):
            out = await p.outputs.get()
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
                    entries = [(ids[count - 1], sample.logprobs[count - 1] if sample.logprobs else None)]
                    if echo[j] is not None:
                        delta, entries, echo[j] = echo[j] + delta, _prompt_entries(p.prompt, out) + entries, None
                    p.num_generated[j] = count
                    yield _piece(p, j, delta, _reason(sample, text) if done[j] else None, entries)
                    if text.stopped and not all(done):  # a stop string ended this one: the others go on
                        abort(p.request_id, j)
                if sample.finish_reason is not None and not done[j]:  # aborted before another token
                    done[j] = True
                    head, entries = ("", []) if echo[j] is None else (echo[j], _prompt_entries(p.prompt, out))
                    echo[j] = None
                    yield _piece(p, j, head + text.update(ids, True), _reason(sample, text), entries)
    finally:
        if not finished:
            abort(p.request_id)


def _piece(p: Prompt, sample: int, text: str, reason: str | None, entries: list) -> Piece:
    p.entries[sample] += entries
    return Piece(sample, text, reason, entries)


def _prompt_entries(prompt: list[int], out: RequestOutput) -> list:
    """The prompt's tokens, each with its log-probability when the request asked (the first has none)."""
    lps = out.prompt_logprobs or [None] * len(prompt)
    return list(zip(prompt, lps))


def _reason(out: CompletionOutput, text: TextStream) -> str:
    return FINISH_STOP if text.stopped else (out.finish_reason or FINISH_ABORT)


async def merged(streams: list):
    """(prompt number, piece) from several piece generators as each comes; each generator is closed (its
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
