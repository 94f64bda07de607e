"""Disaggregated prefill: a KV connector that moves a prompt's keys and values from a prefill worker to a decode worker.

Why split the phases
--------------------
Prefill is compute-bound (a prompt's tokens go through each weight matrix
together), decode is memory-bound (every step reads every weight for one token
per sequence; lessons 01 and 04). One engine serving both makes them
interfere: a long prompt's prefill shares a step with the running decodes, so
every stream stalls (lesson 07); chunking bounds the stall but pays for it in
TTFT and extra steps. Disaggregation runs the two phases on separate workers,
each an `LLMEngine` in its own process on its own cores (or GPU):

    prefill worker: computes the prompt, samples the first token, sends the KV
    decode worker:  receives the KV into its own pool, through its own block table, and decodes on

so the decode worker's steps never carry a prefill, and TTFT and ITL can be
tuned apart (DistServe, Splitwise, Mooncake; vLLM's disaggregated prefill).
What it does not buy is throughput: the same work is done on the same cores,
plus the transfer (vLLM's documentation says so, and lesson 13 measures it).

What it costs
-------------
Every prompt's KV crosses the link once:

    bytes moved per request = prompt_len · 2 · n_layer · n_embd · dtype bytes      (K and V, every layer)
    TTFT grows by about      bytes moved / link bandwidth  (less what overlaps the prefill, below)

gpt2 in fp32: 73,728 bytes per token, 75.5 MB for a 1,024-token prompt.

The interface, as vLLM's `KVConnectorBase_V1` names it
------------------------------------------------------
On the decode side (`KVConsumer`), scheduler half:

    get_num_new_matched_tokens(request)  the prompt tokens whose KV will come from elsewhere, and
                                         whether they arrive asynchronously (always: another process sends them)
    update_state_after_alloc(...)        blocks were allocated for them: remember where each arriving block goes
    request_finished(request_id)         a request ended (aborted): True while its transfer is still in flight,
                                         so its blocks stay held until the last byte lands, then are freed

and its worker half:

    start_load_kv()                      answer the headers that arrived (allocate, then let the receives land
                                         straight into the pool), and start the requests whose KV has landed

vLLM's `wait_for_layer_load(layer)`, which a layer's attention calls when a
connector loads KV in the very step that reads it, has no counterpart here: a
request joins the decode batch only once all its layers have landed, so a
running stream never waits for another request's transfer.

On the prefill side (`KVProducer`), worker half only, called from inside the
forward pass through the cache seam (the model hands each layer's (q, k, v) to
its cache; `SavingCache` answers and then saves):

    save_kv_layer(layer)                 once a layer has written the step's keys and values: send that layer
                                         of every prompt that completes in this step, without waiting
    wait_for_save(first_tokens)          after the step: send the first tokens, wait for every send

Sending layer by layer overlaps the transfer of layer i with the compute of
layers i+1 .. n_layer−1. A block's KV for one layer is contiguous in the pool,
[block_size, K|V, head, head_dim], so each message is a view of the pool on
both sides: no copy is made to send or to receive. The producer's blocks are
freed when its request finishes, at the end of the step that sampled the first
token, and `wait_for_save` runs before the next step can write a block.

The wire (one torch.distributed process group of two ranks: 0 prefill, 1 decode; gloo on the CPU, NCCL on
CUDA, the same code; every message in order, as NCCL matches them):

    header   int64 [1 + 2·MAX_REQUESTS_PER_STEP]: count, then (key, prompt_len) per request completing its
             prompt in the step; count −1: the producer is closing
    KV       for each layer, for each request in header order, for each block: that block's filled slots
    trailer  int64 [count]: each request's first token, or −1 if the step failed (the request fails; both
             sides free its blocks)

Invariants held by the tests: greedy tokens (and their logits) of a request
prefilled on one worker and decoded on another are those of one engine serving
it alone, for prompts ending inside a block and on a block boundary; the bytes
moved are exactly prompt_len · 2 · n_layer · n_embd · dtype bytes; a transfer
aborted in flight, refused or failed frees its blocks on both sides once it
ends, and when all is done every block of both pools is free.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from .engine import LLMEngine
from .kv_cache import Segment
from .paged_attention import PagedKVCache, PagedMetadata
from .sampling_params import FINISH_ABORT, SamplingParams
from .sequence import CompletionOutput, RequestMetrics, RequestOutput

PREFILL_RANK, DECODE_RANK = 0, 1
MAX_REQUESTS_PER_STEP = 256  # header slots: the most prompts one prefill step may complete (its max_num_seqs)
CLOSING = -1                 # a header count: the producer is closing, the consumer's receiver stops
FAILED = -1                  # a trailer token: the step failed, the request fails on both sides
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """2 · n_layer · n_embd · dtype bytes: K and V of one token in every layer, what crosses the link per token."""
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for the pools' device: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def block_views(cache: PagedKVCache, layer: int, table: list[int], num_tokens: int) -> list[torch.Tensor]:
    """The filled slots of each block of `table` in one layer: contiguous views of the pool, one per block."""
    bs = cache.block_size
    return [cache.layers[layer][block, :min(bs, num_tokens - i * bs)]
            for i, block in enumerate(table[:cache.blocks.blocks_for(num_tokens)])]


def check_transferable(params: SamplingParams) -> None:
    """Refuse what this connector cannot carry: it moves a prompt's KV and its first token, one sample, and no
    log-probabilities (the prefill worker's would be lost on the way)."""
    if params.n > 1:
        raise ValueError(f"n={params.n}: a request prefilled on one worker and decoded on another has one sample "
                         "here; ask for n=1, or serve without --disaggregate to draw several")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise ValueError(f"{name}={getattr(params, name)}: the KV connector does not carry log-probabilities "
                             "from the prefill worker; leave the field out, or serve without --disaggregate")


def check_peer(engine: LLMEngine, peer: int) -> None:
    """Both workers must hold the same model shape, dtype and block size, or every view would be cut wrong:
    exchange them once and refuse, on both sides, naming the two."""
    cache, c = engine.cache, engine.config
    dtype = cache.pool.dtype
    mine = torch.tensor([cache.block_size, c.n_layer, c.n_head, c.head_dim, DTYPES.index(dtype)],
                        dtype=torch.int64, device=cache.pool.device)
    both = [torch.zeros_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    theirs = both[peer].tolist()
    if theirs != mine.tolist():
        names = "block_size, n_layer, n_head, head_dim, dtype"
        show = lambda v: f"({', '.join(map(str, v[:4]))}, {DTYPES[v[4]]})"  # noqa: E731
        raise ValueError(f"the two workers' KV pools differ: ({names}) = {show(mine.tolist())} here, "
                         f"{show(theirs)} on rank {peer}; build both engines from the same model, dtype and "
                         "block_size")


# ---- the prefill side --------------------------------------------------------------------------


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
            header = torch.zeros(1 + 2 * MAX_REQUESTS_PER_STEP, dtype=torch.int64, device=self.device)
            header[0] = len(self.step_requests)
            header[1:1 + 2 * len(self.step_requests)] = torch.tensor(
                [x for r in self.step_requests for x in (r.key, r.prompt_len)], dtype=torch.int64)
            self.works.append(dist.isend(header, self.peer))

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
        header = torch.zeros(1 + 2 * MAX_REQUESTS_PER_STEP, dtype=torch.int64, device=self.device)
        header[0] = CLOSING
        dist.send(header, self.peer)


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


# ---- the decode side ---------------------------------------------------------------------------


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
        held = []
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
            held.append(r)
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
            self.bytes_received += r.prompt_len * kv_bytes_per_token(self.engine.config, self.cache.pool.dtype)
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
                header = torch.zeros(1 + 2 * MAX_REQUESTS_PER_STEP, dtype=torch.int64, device=device)
                dist.recv(header, self.peer)
                count = int(header[0])
                if count == CLOSING:
                    return
                pairs = header[1:1 + 2 * count].view(count, 2).tolist()
                transfer = Transfer([Incoming(k, n) for k, n in pairs])
                self._headers.put(transfer)
                self.notify()
                transfer.ready.wait()
                for layer in range(c.n_layer):
                    for r in transfer.requests:
                        for view in r.views[layer]:
                            dist.recv(view, self.peer)
                trailer = torch.zeros(count, dtype=torch.int64, device=device)
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
