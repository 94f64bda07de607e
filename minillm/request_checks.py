"""What an engine refuses: a second thread, and a request it could not run.

One engine, one thread. Nothing in `LLMEngine` is locked, so two threads
inside one engine would corrupt it silently; instead `step`, `add_request`,
`abort_request`, `generate` and `close` refuse, with a RuntimeError naming this
rule, to start while another thread is inside one of them (`one_thread`). The
safe pattern: one thread owns the engine and loops over `step()`; other threads
hand it requests and aborts through a `queue.Queue`, which the owner drains
between steps, and receive outputs the same way:

    def owner(engine, inbox, outbox):                 # the only thread that touches engine
        while True:
            while not inbox.empty() or not engine.has_unfinished_requests():
                kind, *args = inbox.get()             # blocks while there is nothing to do
                if kind == "add":
                    engine.add_request(*args)
                else:
                    engine.abort_request(*args)
            for out in engine.step():
                outbox.put(out)

A request is checked whole before it is queued (`check_request`,
`check_fits`): every argument that is wrong, and every request that could never
run (more KV than the whole pool, or, with chunked prefill off, more tokens
than one step's budget), is refused at once, naming the value and the fix,
rather than left to wait forever.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator
import threading
from collections.abc import Sequence as Sized

import numpy as np
import torch

from .block_manager import BlockManager
from .config import GPT2Config
from .parallel_sampling import group_blocks
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig
from .sequence import Sequence


def check_prompt(config: GPT2Config, token_ids, max_tokens: int = 0) -> list[int]:
    """The prompt as a list of Python ints, or a ValueError naming the value, the limit and the fix.

    A prompt is a sequence of token ids: a list or tuple of integers (NumPy's
    and torch's included), or a 1-D integer array or tensor. A sequence holds
    at most len(prompt) + max_tokens − 1 tokens of KV, since the last sampled
    token is never fed back, so that is what must fit in n_ctx. Cheap enough
    to call once per request; the model's forward pass itself does not check,
    so the hot path stays lean.
    """
    kind = type(token_ids).__name__
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        if token_ids.ndim != 1:
            raise ValueError(f"the prompt is a {token_ids.ndim}-D {kind} of shape {tuple(token_ids.shape)}; a "
                             "prompt is one sequence of token ids (pass one request per prompt)")
        token_ids = token_ids.tolist()
    elif isinstance(token_ids, (str, bytes, bytearray)):
        raise ValueError(f"the prompt has type {kind}, not a sequence of token ids; encode text with the "
                         "tokenizer")
    elif not isinstance(token_ids, Sized):
        raise ValueError(f"the prompt has type {kind}, not a sequence of token ids (a list of ints); a call that "
                         "takes several prompts wants a list of such lists")
    ids = []
    for i, t in enumerate(token_ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"token id {t!r} at position {i} is a {type(t).__name__}, not an integer; "
                             "a prompt is a sequence of token ids (encode text with the tokenizer)") from None
        if not 0 <= t < config.vocab_size:
            raise ValueError(f"token id {t} at position {i} is outside the vocabulary [0, {config.vocab_size}); "
                             "was the prompt encoded with a different tokenizer?")
        ids.append(t)
    n = len(ids)
    if n == 0:
        raise ValueError("the prompt is empty: a GPT-2 needs at least one token to condition on "
                         "(encode some text, or start from the end-of-text token)")
    if n > config.n_ctx:
        raise ValueError(f"the prompt has {n} tokens but the context holds n_ctx={config.n_ctx}; "
                         f"truncate the prompt to at most {config.n_ctx} tokens")
    if max_tokens and n + max_tokens - 1 > config.n_ctx:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) − 1 = {n + max_tokens - 1} tokens of KV "
                         f"exceed the context n_ctx={config.n_ctx}; lower max_tokens to at most "
                         f"{config.n_ctx - n + 1} or shorten the prompt")
    return ids

def one_thread(method):
    """Run an engine method holding the engine's guard, refusing a call from a second thread while one runs.

    The guard is re-entrant (the NonFiniteLogitsError path of `step` aborts requests), and never waits: a
    second thread that waited would still interleave its calls with the owner's between steps."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._guard.acquire(blocking=False):
            raise RuntimeError(f"LLMEngine.{method.__name__}() called from thread "
                               f"{threading.current_thread().name!r} while {self._busy or 'another call'} is "
                               "running: one engine, one thread. Let one thread own the engine and step it, and "
                               "hand it requests through a queue.Queue (see LLMEngine's docstring)")
        outer, self._busy = self._busy, f"{method.__name__}() in thread {threading.current_thread().name!r}"
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy = outer
            self._guard.release()
    return guarded


def check_request(config: GPT2Config, prompt_token_ids, params, request_id, arrival_time, now: float,
                  requests) -> tuple[tuple[int, ...], SamplingParams]:
    """The checked (prompt, params) of a request; refuses every bad argument, naming the value and the fix.
    `now` is the engine's clock (`time.perf_counter()`), `requests` the ids in use."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params is a {type(params).__name__}; pass a SamplingParams (or None for the defaults)")
    prompt_token_ids = tuple(check_prompt(config, prompt_token_ids, params.max_tokens))
    vocab = config.vocab_size
    for t in params.stop_token_ids:
        if t >= vocab:
            raise ValueError(f"stop token id {t} is outside the vocabulary of {vocab} tokens (ids 0 to "
                             f"{vocab - 1}): it could never be generated; drop it or use the model's tokenizer")
    ends = set(params.stop_token_ids) | ({config.eos_token_id} if not params.ignore_eos else set())
    if params.min_tokens and len(ends - {None}) >= vocab:  # min_tokens masks them all: no token could be drawn
        raise ValueError(f"min_tokens={params.min_tokens} with stop token ids (and the end of text) covering all "
                         f"{vocab} tokens: until min_tokens every token is masked, so none could be chosen; "
                         "drop min_tokens or some stop token ids")
    if arrival_time is not None:
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
                or not math.isfinite(arrival_time) or arrival_time > now:
            raise ValueError(f"arrival_time={arrival_time!r} must be a time.perf_counter() reading no later "
                             f"than now ({now:.3f}); time.time() is another clock. Leave it out to mean now")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} is a {type(request_id).__name__}; it must be a str "
                             f"(str({request_id!r}) will do), or None for an automatic one")
        if request_id in requests:
            raise ValueError(f"request id {request_id!r} is already in use; ids must be unique "
                             "(pass another, or none for an automatic one)")
    return prompt_token_ids, params


def check_samples(n: int, scheduler_config: SchedulerConfig) -> None:
    """Refuse a request whose `n` samples could never run side by side, before a single one is built: the check
    costs nothing whatever `n` is (a caller's n = 10⁹ must not allocate 10⁹ sequences first)."""
    if n > scheduler_config.max_num_seqs:
        raise ValueError(f"n={n} samples run side by side, but max_num_seqs={scheduler_config.max_num_seqs} "
                         f"sequences fit in a step; lower n or raise max_num_seqs to at least {n}")


def check_fits(seq: Sequence, block_manager: BlockManager, scheduler_config: SchedulerConfig, n: int = 1) -> None:
    """Reject now a request that could never run, rather than let it wait forever: its `n` samples, sharing the
    prompt's full blocks, must fit in the pool at once (`check_samples` has made sure they fit in a batch)."""
    tokens, bs = seq.max_total_tokens(), block_manager.block_size
    blocks = group_blocks(len(seq.prompt_token_ids), tokens, n, bs)
    if blocks > block_manager.num_blocks:
        each = f"{n} samples of " if n > 1 else ""
        raise ValueError(f"request needs up to {each}{tokens} tokens of KV = {blocks} blocks of {bs}, but the whole "
                         f"pool has {block_manager.num_blocks} blocks; lower {'n, ' if n > 1 else ''}max_tokens, "
                         "shorten the prompt, or give the engine more KV memory (num_blocks / kv_cache_memory_bytes)")
    budget = scheduler_config.max_num_batched_tokens
    if not scheduler_config.enable_chunked_prefill and tokens > budget:
        raise ValueError(f"with chunked prefill off, a request is (re)computed in one step, and this one can "
                         f"reach {tokens} tokens > max_num_batched_tokens={budget}; raise the budget to at "
                         f"least {tokens} or set enable_chunked_prefill=True")
