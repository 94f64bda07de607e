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

The pieces are made on one thread of their own, the `TextWorker`, never on the
event loop: the engine thread hands it each output, it decodes only the new
tokens, feeds them to the stop-string automaton (`text_stream.py`), writes the
logprob objects and the event, and puts the result on the request's queue.

A request whose client is gone is aborted at once, all its samples (the
generator's `finally`), and a sample whose text hit a stop string alone, so the
engine frees their blocks.
"""
from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..sampling_params import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from ..sequence import CompletionOutput, RequestOutput
from .engine_loop import Failed
from .text_stream import StopStrings, TextStream

log = logging.getLogger("minillm.server")


class EngineFailed(Exception):
    """The engine step running this request raised; the message says how."""


@dataclass
class Piece:
    sample: int         # which of its prompt's n samples
    text: str
    reason: str | None  # set on the sample's last piece
    entries: list       # (token id, TokenLogprobs | None) of the tokens this piece adds, the echoed prompt's first
    event: str | None = None  # the server-sent event that carries it, when the answer is streamed


@dataclass
class Batch:
    """What one engine output became: its pieces, and whether the request is over (engine, and every sample)."""
    pieces: list[Piece]
    finished: bool
    done: bool


@dataclass
class Prompt:
    """One prompt's request: where its pieces arrive, what its text needs (stop strings, echo), and what each
    of its n samples has sent so far. `advance` runs on the text worker; the rest on the event loop."""
    index: int  # its place in the batch
    request_id: str
    prompt: list[int]
    stops: StopStrings
    outputs: asyncio.Queue
    n: int = 1
    echo: str | None = None  # the prompt's text, sent before each sample's completion (`echo: true`)
    echo_only: bool = False  # `echo` with `max_tokens: 0`: the scored prompt, and no new token
    render: Callable[[int, Piece], str] | None = None  # a piece's event, streamed (on the text worker)
    num_generated: list[int] = field(default_factory=list)  # per sample
    entries: list[list] = field(default_factory=list)  # per sample: every (token id, TokenLogprobs | None) sent

    def __post_init__(self):
        self.num_generated = [0] * self.n
        self.entries = [[] for _ in range(self.n)]
        self._done, self._seen, self._echo = [False] * self.n, [0] * self.n, [self.echo] * self.n
        self._texts: list[TextStream] = []

    def choice_index(self, sample: int) -> int:
        """The index of its sample `sample` among the answer's choices (vLLM's rule)."""
        return self.index * self.n + sample

    def advance(self, out: RequestOutput, decode: Callable[[list[int]], str], abort: Callable[..., None]) -> Batch:
        """The pieces one engine output adds, one per generated token, each sample's last with its finish
        reason; a stop string that ends one sample aborts that one alone."""
        self._texts = self._texts or [TextStream(decode, self.stops) for _ in range(self.n)]
        made: list[Piece] = []
        for sample in out.outputs:
            j, text, ids = sample.index, self._texts[sample.index], sample.token_ids
            if self.echo_only:
                if sample.finish_reason is not None and not self._done[j]:
                    self._done[j] = True
                    reason = FINISH_ABORT if sample.finish_reason == FINISH_ABORT else FINISH_LENGTH
                    made.append(self._piece(j, self._echo[j], reason, _prompt_entries(self.prompt, out)))
                continue
            first, self._seen[j] = self._seen[j] + 1, len(ids)
            for count in range(first, len(ids) + 1):
                if self._done[j]:
                    break
                last = sample.finish_reason is not None and count == len(ids)
                delta = text.update(ids[:count], last)
                self._done[j] = last or text.stopped
                entries = [(ids[count - 1], sample.logprobs[count - 1] if sample.logprobs else None)]
                if self._echo[j] is not None:
                    delta, entries = self._echo[j] + delta, _prompt_entries(self.prompt, out) + entries
                    self._echo[j] = None
                self.num_generated[j] = count
                made.append(self._piece(j, delta, _reason(sample, text) if self._done[j] else None, entries))
                if text.stopped and not all(self._done):  # a stop string ended this one: the others go on
                    abort(self.request_id, j)
            if sample.finish_reason is not None and not self._done[j]:  # aborted before another token
                self._done[j] = True
                head, entries = ("", []) if self._echo[j] is None else (self._echo[j], _prompt_entries(self.prompt, out))
                self._echo[j] = None
                made.append(self._piece(j, head + text.update(ids, True), _reason(sample, text), entries))
        return Batch(made, out.finished, all(self._done))

    def _piece(self, sample: int, text: str, reason: str | None, entries: list) -> Piece:
        self.entries[sample] += entries
        piece = Piece(sample, text, reason, entries)
        if self.render is not None:
            piece.event = self.render(self.choice_index(sample), piece)
        return piece


class TextWorker:
    """The threads that turn engine outputs into text and events, so the event loop only moves bytes.

    The engine thread hands each item of a request (Accepted, Rejected, a RequestOutput, Failed) to one of
    `threads` threads, always the same for one request, so its items keep their order; that thread detokenizes,
    matches stop strings, builds the logprob objects and the events (`Prompt.advance`), and puts the result on
    the request's asyncio queue. Several threads, so that a request with a heavy answer (echo, logprobs, n)
    shares the interpreter with the others instead of holding a queue they wait in."""

    def __init__(self, threads: int = 4):
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix=f"minillm-text-{i}") for i in range(threads)]
        self._next = 0

    def deliverer(self, p: Prompt, decode, abort) -> Callable[[object], None]:
        """The `put` for p's request: called on the engine thread, it queues the work and returns at once."""
        loop = asyncio.get_running_loop()
        pool, self._next = self.pools[self._next % len(self.pools)], self._next + 1

        def work(item) -> None:
            try:
                if isinstance(item, RequestOutput):
                    item = p.advance(item, decode, abort)
            except Exception as e:  # noqa: BLE001  (a bug here must end this stream, not hang it)
                log.error("request %s: its text failed\n%s", p.request_id, traceback.format_exc())
                abort(p.request_id)
                item = Failed(f"the server failed to decode the output: {type(e).__name__}: {e}")
            try:
                loop.call_soon_threadsafe(p.outputs.put_nowait, item)
            except RuntimeError:  # the event loop is closed: the handler is gone, nobody to tell
                pass

        def put(item) -> None:
            try:
                pool.submit(work, item)
            except RuntimeError:  # shut down: the server is gone
                pass
        return put

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False)


async def pieces(p: Prompt, abort: Callable[..., None]):
    """Yield the pieces of the prompt's samples as the text worker makes them. A step that failed raises
    EngineFailed. Leaving before the engine finished the request (the client left, stop strings ended every
    sample) aborts it."""
    finished = False
    try:
        while True:
            batch = await p.outputs.get()
            if isinstance(batch, Failed):
                finished = True  # the engine loop has aborted it already
                raise EngineFailed(batch.message)
            finished = batch.finished
            for piece in batch.pieces:
                yield piece
            if batch.done:
                return
    finally:
        if not finished:
            abort(p.request_id)


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
