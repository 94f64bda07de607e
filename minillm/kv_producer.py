"""The prefill side of disaggregated prefill: a worker that prefills each prompt and sends its KV as it is written.

The idea
--------
The prefill worker's engine runs a prompt as any engine does, asked for one
token: its first. The producer sends the prompt's keys and values to the decode
worker from inside the forward pass, through the cache seam (the model hands
each layer's (q, k, v) to its cache; `SavingCache` answers, then saves), with
the worker half of vLLM's `KVConnectorBase_V1`:

    save_kv_layer(layer)                 once a layer has written the step's keys and values: send that layer
                                         of every prompt that completes in this step, without waiting
    wait_for_save(first_tokens)          after the step: send the first tokens, wait for every send

Sending layer by layer overlaps the transfer of layer i with the compute of
layers i+1 .. n_layer−1. The wire and the checks both sides make are in
`kv_connector.py`; the decode side is `kv_consumer.py`.

What it costs
-------------
    messages per step = 1 header + n_layer · Σ blocks of the completing prompts + 1 trailer
    bytes sent        = Σ prompt_len · 2 · n_layer · n_embd · dtype bytes     (views of the pool: no copy)

Invariant: a producer's blocks are freed when its request finishes, at the end
of the step that sampled the first token, and `wait_for_save` runs before the
next step can write a block, so no block is reused while a send reads it. A step
that raised still sends every layer and a trailer of −1, so that the consumer's
next header lands in its header.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .engine import LLMEngine
from .kv_cache import Segment
from .kv_connector import DECODE_RANK, FAILED, MAX_REQUESTS_PER_STEP, block_views, check_peer, header
from .paged_attention import PagedKVCache, PagedMetadata
from .sampling_params import FINISH_ABORT, SamplingParams
from .sequence import RequestOutput


@dataclass
class _Outgoing:
    key: int
    prompt_len: int
    table: list[int]


class KVProducer:
    """The prefill worker's connector: its engine prefills each prompt, samples its first token, and sends both.

    `add_request(key, prompt, params)` queues a prompt whose decode runs elsewhere (the engine is asked for one
    token only); after every `engine.step()` the worker calls `wait_for_save(outputs)`. Install it before the
    first step: it replaces `engine.cache` by a `SavingCache` around it."""

    def __init__(self, engine: LLMEngine, peer: int = DECODE_RANK):
        if engine.scheduler_config.max_num_seqs > MAX_REQUESTS_PER_STEP:
            raise ValueError(f"max_num_seqs={engine.scheduler_config.max_num_seqs} of the prefill engine exceeds the "
                             f"{MAX_REQUESTS_PER_STEP} prompts a header can name; lower it to at most "
                             f"{MAX_REQUESTS_PER_STEP}")
        check_peer(engine, peer)
        self.engine, self.peer = engine, peer
        self.cache = engine.cache
        engine.cache = SavingCache(self.cache, self)
        self.keys: dict[int, tuple[int, str]] = {}  # seq_id → (key, request_id) of every prompt not yet sent
        self.step_requests: list[_Outgoing] = []    # the prompts completing in the step under way
        self.layers_saved = 0
        self.works: list = []
        self.bytes_sent = 0
        self.requests_sent = 0
        self.failed: set[str] = set()  # aborted here because their step failed: the decode worker reports them
        self.device = self.cache.pool.device

    def add_request(self, key: int, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt to prefill here and decode elsewhere, under `key` (an integer both sides know it by)."""
        params = params or SamplingParams()  # the first token only: decode is elsewhere
        params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        request_id = self.engine.add_request(prompt_token_ids, params, request_id, arrival_time)
        self.keys[self.engine.requests[request_id].seq_id] = (key, request_id)
        return request_id

    def start_save(self, segments: list[Segment]) -> None:
        """Before a forward pass: name the prompts that complete in it, in a header sent at once."""
        self.step_requests, self.layers_saved = [], 0
        tables = self.cache.blocks.block_tables
        for s in segments:
            if s.is_decode or s.seq_id not in self.keys:
                continue
            seq = self.engine.requests[self.keys[s.seq_id][1]]
            if s.start + s.num_new == len(seq.prompt_token_ids):
                self.step_requests.append(_Outgoing(self.keys[s.seq_id][0], len(seq.prompt_token_ids),
                                                    tables[s.seq_id]))
        if self.step_requests:
            pairs = [(r.key, r.prompt_len) for r in self.step_requests]
            self.works.append(dist.isend(header(pairs, self.device), self.peer))

    def save_kv_layer(self, layer: int) -> None:
        """This layer's keys and values are in the pool: send it for every prompt completing in this step."""
        for r in self.step_requests:
            for view in block_views(self.cache, layer, r.table, r.prompt_len):
                self.works.append(dist.isend(view, self.peer))
                self.bytes_sent += view.nbytes
        if self.step_requests:
            self.layers_saved = layer + 1

    def wait_for_save(self, outputs: list[RequestOutput] | None) -> None:
        """After a step: send each completed prompt's first token (all −1 if the step raised: `outputs` None,
        and those requests are aborted here too), and wait until every send of the step is done. A step that
        raised mid-forward still sends the layers it did not reach, so that the receiver's next header lands in
        its header."""
        if not self.step_requests:
            return
        for layer in range(self.layers_saved, self.config.n_layer):  # pad: their content is discarded
            self.save_kv_layer(layer)
        first = {o.request_id: o.output_token_ids[0] for o in outputs or [] if o.output_token_ids}
        by_key = {key: rid for key, rid in self.keys.values()}
        tokens = [first.get(by_key[r.key], FAILED) for r in self.step_requests]
        for r, token in zip(self.step_requests, tokens):
            if token == FAILED:  # it fails on both sides: here too, or the engine would redo its prompt
                self.engine.abort_request(by_key[r.key])
                self.failed.add(by_key[r.key])
        self.works.append(dist.isend(torch.tensor(tokens, dtype=torch.int64, device=self.device), self.peer))
        for work in self.works:
            work.wait()
        self.works.clear()
        self.requests_sent += sum(t != FAILED for t in tokens)
        for seq_id in [s for s, (key, _) in self.keys.items() if key in {r.key for r in self.step_requests}]:
            del self.keys[seq_id]  # sent, or failed (the worker reports that): no longer this connector's
        self.step_requests = []

    @property
    def config(self):
        return self.engine.config

    def reports(self, out: RequestOutput) -> bool:
        """Whether this worker reports `out`: only its aborts, and not those of a failed step, which the decode
        worker reports with their reason (the trailer's −1); the rest of a request's outputs come from there."""
        if out.request_id in self.failed:
            self.failed.discard(out.request_id)
            return False
        return out.finish_reason == FINISH_ABORT

    def forget(self, request_id: str) -> None:
        """A request that ended before its prompt was sent (aborted): nothing will be sent for it."""
        self.keys = {s: (k, r) for s, (k, r) in self.keys.items() if r != request_id}

    def close(self) -> None:
        """Tell the consumer that nothing more will come, so that its receiver stops."""
        dist.send(header(None, self.device), self.peer)


class SavingCache:
    """The producer's side of the cache seam: the engine's `PagedKVCache`, saving each layer once it is written.

    `prepare` names the step's completing prompts (the header); `attend` answers as the paged cache does, then
    calls `save_kv_layer`. Everything else is the paged cache's own."""

    def __init__(self, cache: PagedKVCache, producer: KVProducer):
        self._cache, self._producer = cache, producer

    def prepare(self, segments: list[Segment]) -> PagedMetadata:
        self._producer.start_save(segments)
        return self._cache.prepare(segments)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._cache.attend(layer_idx, q, k, v)
        self._producer.save_kv_layer(layer_idx)
        return out

    def __getattr__(self, name):
        return getattr(self._cache, name)
