"""The decode side of disaggregated prefill: a worker that receives each prompt's KV into its own pool and decodes on.

The idea
--------
The decode worker's engine never prefills a prompt that another worker sends:
it allocates the prompt's blocks, lets the sent keys and values land straight
in them (views of its pool: no copy), and starts the request at its first token
once every layer has landed. The consumer answers vLLM's `KVConnectorBase_V1`
verbs, scheduler half:

    get_num_new_matched_tokens(request)  the prompt tokens whose KV will come from elsewhere, and
                                         whether they arrive asynchronously (always: another process sends them)
    update_state_after_alloc(...)        blocks were allocated for them: remember where each arriving block goes
    request_finished(request_id)         a request ended (aborted): True while its transfer is still in flight,
                                         so its blocks stay held until the last byte lands, then are freed

and worker half:

    start_load_kv()                      answer the headers that arrived (allocate, then let the receives land
                                         straight into the pool), and start the requests whose KV has landed

vLLM's `wait_for_layer_load(layer)`, which a layer's attention calls when a
connector loads KV in the very step that reads it, has no counterpart here: a
request joins the decode batch only once all its layers have landed, so a
running stream never waits for another request's transfer. The wire is in
`kv_connector.py`; the prefill side is `kv_producer.py`.

What it costs
-------------
    blocks held per request = ⌈prompt_len / block_size⌉, from its header's answer until it finishes
    bytes received          = prompt_len · 2 · n_layer · n_embd · dtype bytes

Invariant: one receiver thread does every receive, in the order sent; only the
engine's own thread touches the engine. A request aborted while its KV is still
arriving keeps its blocks until its transfer ends, then frees them; one that
could never fit here is drained into scratch tensors and reported as failed.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .engine import LLMEngine
from .kv_connector import FAILED, PREFILL_RANK, block_views, check_peer, header, read_header
from .paged_attention import PagedKVCache
from .sampling_params import FINISH_ABORT, SamplingParams
from .sequence import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class Incoming:
    """One request announced by a header: where each of its arriving blocks goes, and what became of it."""
    key: int
    prompt_len: int
    request_id: str | None = None        # None: no such request here (aborted before its KV came): drained
    views: list[list[torch.Tensor]] = field(default_factory=list)  # per layer, per block: pool views or scratch
    holds_blocks: bool = False
    aborted: bool = False
    first_token: int = FAILED


@dataclass
class Transfer:
    """One header's worth of requests, received in order by the receiver thread."""
    requests: list[Incoming]
    ready: threading.Event = field(default_factory=threading.Event)  # set once every view is known
    landed_at: float | None = None


@dataclass
class _Expected:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    arrival_time: float | None


class KVConsumer:
    """The decode worker's connector: its engine decodes requests whose prompt KV another worker sends.

    The worker registers each request before its prefill starts (`add_request`), and calls `start_load_kv()`
    between steps: it returns the outputs of requests that started (their first token) or failed. A receiver
    thread does every receive, in order; only the engine's own thread touches the engine. `notify` is called
    (from that thread) whenever there is something for `start_load_kv` to do, to wake an idle worker."""

    def __init__(self, engine: LLMEngine, peer: int = PREFILL_RANK, notify: Callable[[], None] = lambda: None):
        check_peer(engine, peer)
        self.engine, self.peer, self.notify = engine, peer, notify
        self.cache: PagedKVCache = engine.cache
        self.expected: dict[int, _Expected] = {}       # key → a registered request whose header has not come
        self.aborted: set[int] = set()                 # keys aborted before their header came: drained
        self.in_flight: dict[str, Incoming] = {}       # request_id → its blocks are being received into
        self._headers: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
        self._landed: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
        self._unanswered: list[Transfer] = []
        self.bytes_received = 0
        self.failures: dict[str, str] = {}            # request_id → why it failed here, for the worker to report
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="kv-receiver", daemon=True)
        self._thread.start()

    # -- the scheduler half --

    def add_request(self, key: int, prompt_token_ids: list[int], params: SamplingParams | None,
                    request_id: str, arrival_time: float | None = None) -> None:
        """Register a request whose prompt another worker is about to prefill and send under `key`."""
        self.expected[key] = _Expected(list(prompt_token_ids), params or SamplingParams(), request_id, arrival_time)

    def get_num_new_matched_tokens(self, key: int, prompt_len: int) -> tuple[int, bool]:
        """(tokens whose KV will come from the other worker, whether they come asynchronously): the whole
        prompt, asynchronously, for a registered request; nothing for one aborted before its header."""
        return (prompt_len, True) if key in self.expected else (0, False)

    def update_state_after_alloc(self, incoming: Incoming, table: list[int] | None) -> None:
        """Blocks were allocated (table) or the request must be drained (None): the views each block lands in."""
        config, H, D = self.engine.config, self.engine.config.n_head, self.engine.config.head_dim
        if table is None:
            bs, n = self.cache.block_size, incoming.prompt_len
            sizes = [min(bs, n - i * bs) for i in range(self.cache.blocks.blocks_for(n))]
            incoming.views = [[torch.empty(r, 2, H, D, dtype=self.cache.pool.dtype, device=self.cache.pool.device)
                               for r in sizes] for _ in range(config.n_layer)]
        else:
            incoming.holds_blocks = True
            incoming.views = [block_views(self.cache, layer, table, incoming.prompt_len)
                              for layer in range(config.n_layer)]
            self.in_flight[incoming.request_id] = incoming

    def request_finished(self, request_id: str) -> bool:
        """`request_id` was aborted. True while its KV is still arriving: its blocks stay held, and are freed
        (the engine reports the abort) once its transfer ends. False when the connector holds nothing for it."""
        for key, e in list(self.expected.items()):
            if e.request_id == request_id:
                del self.expected[key]
                self.aborted.add(key)
                return False
        incoming = self.in_flight.get(request_id)
        if incoming is None:
            return False
        incoming.aborted = True
        return True

    # -- the worker half --

    def start_load_kv(self) -> list[RequestOutput]:
        """Answer the headers that came (allocate their blocks; while the pool has no room, retried at the next call),
        then start every request whose KV has landed. Returns their outputs: a first token, or a failure."""
        if self.error is not None:
            raise RuntimeError(f"the KV receiver failed: {self.error}") from self.error
        while True:
            try:
                self._unanswered.append(self._headers.get_nowait())
            except queue.Empty:
                break
        while self._unanswered and self._answer(self._unanswered[0]):
            self._unanswered.pop(0)
        outputs = []
        while True:
            try:
                transfer = self._landed.get_nowait()
            except queue.Empty:
                break
            outputs += self._start(transfer)
        return outputs

    @property
    def waiting_for_room(self) -> bool:
        """A header is still unanswered: call `start_load_kv` again once a step has freed blocks, or once the
        inbox has been read."""
        return bool(self._unanswered)

    def _answer(self, transfer: Transfer) -> bool:
        """Give each request of a header its views. False, answering no more of them, while the pool has not the
        room or a request's registration has not been read yet: the router registers a request here before the
        prefill worker sees it, but this worker reads its inbox between steps, and the header may come first."""
        for r in transfer.requests:
            if r.views:
                continue
            matched, _ = self.get_num_new_matched_tokens(r.key, r.prompt_len)
            if not matched and r.key not in self.aborted:
                return False  # its registration is still in this worker's inbox (the header overtook it): later
            if not matched:
                self.aborted.discard(r.key)
                self.update_state_after_alloc(r, None)
                continue
            e = self.expected[r.key]
            try:
                table = self.engine.allocate_remote_prefill(e.prompt, e.params, e.request_id, e.arrival_time)
            except ValueError:  # it can never fit here: drain it; _start reports the failure
                r.request_id = e.request_id
                del self.expected[r.key]
                self.update_state_after_alloc(r, None)
                continue
            if table is None:  # no room now: wait for decode steps to free some; nothing is received meanwhile
                return False
            r.request_id = e.request_id
            del self.expected[r.key]
            self.update_state_after_alloc(r, table)
        transfer.ready.set()
        return True

    def _start(self, transfer: Transfer) -> list[RequestOutput]:
        outputs = []
        for r in transfer.requests:
            if r.request_id is None:
                continue  # drained: nobody waits for it here
            if not r.holds_blocks:  # refused: it could never fit in this pool
                outputs.append(self._failed(r, "the decode worker's KV pool can never hold its prompt"))
                continue
            del self.in_flight[r.request_id]
            if r.aborted or r.first_token == FAILED:
                self.engine.abort_request(r.request_id)  # its transfer has ended: now its blocks may go
                if not r.aborted:  # the engine's next step reports it ("abort"); here is why
                    self.failures[r.request_id] = "its prefill step failed on the prefill worker"
                continue
            self.bytes_received += r.prompt_len * self.engine.config.kv_bytes_per_token(self.cache.pool.dtype)
            outputs.append(self.engine.start_remote_decode(r.request_id, r.first_token, transfer.landed_at))
        return outputs

    def _failed(self, r: Incoming, why: str) -> RequestOutput:
        """The output of a request that failed here before the engine took it: finished, "abort"."""
        self.failures[r.request_id] = why
        return RequestOutput(r.request_id, (), [CompletionOutput(0, [], FINISH_ABORT)], True,
                             RequestMetrics(time.perf_counter()))

    def _receive(self) -> None:
        """The receiver thread: headers, then each layer's blocks, then the trailer, in the order they were sent."""
        c, device = self.engine.config, self.cache.pool.device
        try:
            while True:
                received = header([], device)
                dist.recv(received, self.peer)
                pairs = read_header(received)
                if pairs is None:  # the producer is closing
                    return
                transfer = Transfer([Incoming(k, n) for k, n in pairs])
                self._headers.put(transfer)
                self.notify()
                transfer.ready.wait()
                for layer in range(c.n_layer):
                    for r in transfer.requests:
                        for view in r.views[layer]:
                            dist.recv(view, self.peer)
                trailer = torch.zeros(len(pairs), dtype=torch.int64, device=device)
                dist.recv(trailer, self.peer)
                for r, token in zip(transfer.requests, trailer.tolist()):
                    r.first_token = token
                transfer.landed_at = time.perf_counter()
                self._landed.put(transfer)
                self.notify()
        except BaseException as e:  # the peer died or the group broke: start_load_kv raises it on the engine thread
            self.error = e
            self.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the receiver to read the producer's closing header."""
        self._thread.join(timeout)
