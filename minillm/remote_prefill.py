"""A prompt prefilled elsewhere: the decode engine's side of disaggregated prefill (lesson 15).

Disaggregated, one worker prefills a prompt and another decodes it
(`kv_connector.py` moves the keys and values between them). The decode engine
must hold blocks for KV it never computes, and then let the request join its
running batch at its first token, as if its own prefill had just ended. Two
calls of `LLMEngine` (this class is mixed into it) do that:

    allocate_remote_prefill   hold the prompt's blocks outside the scheduler, so that no step
                              reads or frees them while the KV travels; None while the pool is full
    start_remote_decode       the KV has landed: the scheduler's `start_running`, then its `update`
                              with the prefill worker's first token (the one stop rule may end it)

`abort_request` frees the blocks either way. Such a prompt cannot join a prefix
cache (its blocks would be hashed before their KV lands), so the decode engine
runs without one.

    cost: ⌈P / block_size⌉ blocks held for a prompt of P tokens from allocation until it finishes

Invariant held by the tests: a request prefilled on one worker and decoded on
another gets exactly the tokens one engine gives it, and when every request has
finished or been aborted no block is held on either side.
"""
from __future__ import annotations

import time

from .prefix_caching import PrefixCachingBlockManager
from .request_checks import one_thread
from .sampling_params import SamplingParams
from .sequence import RequestOutput, Sequence


class RemotePrefill:
    """`LLMEngine`'s two calls for a prompt whose KV another worker computes; the requests between the two
    wait in `_remote`, holding their blocks, in no queue of the scheduler."""

    _remote: dict[str, Sequence]

    @one_thread
    def allocate_remote_prefill(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                                request_id: str | None = None, arrival_time: float | None = None) -> list[int] | None:
        """Hold blocks for a request whose prompt's keys and values another worker computes and sends; returns
        the block table that KV is to be written through, or None while the pool has not the room (ask again
        after a step has freed some). The request waits outside the scheduler, holding its blocks, until
        `start_remote_decode`; `abort_request` frees them. A request that could never fit is refused
        (ValueError), as `add_request` refuses it."""
        if request_id is not None and request_id in self._remote:
            raise ValueError(f"request_id {request_id!r} already waits for its KV here; pick a new id")
        if isinstance(self.block_manager, PrefixCachingBlockManager):
            raise ValueError("a prompt whose KV comes from elsewhere cannot join the prefix cache here (its blocks "
                             "would be hashed before their KV lands); build the decode engine with "
                             "enable_prefix_caching=False")
        seq = self._new_sequence(prompt_token_ids, params, request_id, arrival_time)
        num_prompt = len(seq.prompt_token_ids)
        if not self.block_manager.can_append(seq, num_prompt):
            return None
        self.block_manager.append_slots(seq, num_prompt)
        self._remote[seq.request_id] = seq
        return list(self.block_manager.block_tables[seq.seq_id])

    @one_thread
    def start_remote_decode(self, request_id: str, first_token: int, first_token_time: float | None = None
                            ) -> RequestOutput:
        """The prompt's KV of a request held by `allocate_remote_prefill` is in its blocks now, and `first_token`
        is what the worker that prefilled it sampled: the request joins the running batch, decoding, and its
        first token counts as made at `first_token_time` (by default now). Returns its output so far, finished
        already if that token ended it."""
        seq = self._remote.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} holds no blocks for a remote prefill here; hold them with "
                             "allocate_remote_prefill first")
        if isinstance(first_token, bool) or not isinstance(first_token, int) \
                or not 0 <= first_token < self.config.vocab_size:
            raise ValueError(f"first_token={first_token!r} of request {request_id!r} is no token id of this "
                             f"model's vocabulary (0 to {self.config.vocab_size - 1}); the two workers must "
                             "serve the same model")
        self.requests[request_id] = seq = self._remote.pop(request_id)
        now = time.perf_counter()
        seq.num_computed_tokens, seq.num_cached_tokens = len(seq.prompt_token_ids), 0  # none from a prefix cache
        seq.metrics.first_scheduled_time = now
        self.scheduler.start_running(seq)
        self.scheduler.update([(seq, first_token, None)], now)
        if first_token_time is not None:  # made by the prefill worker, on the same clock
            seq.metrics.token_times[-1] = first_token_time
        return self._report(seq)
