"""Launch overhead: a decode step with static shapes, replayed as a CUDA graph.

The bottleneck
--------------
A decode step of a small model gives each kernel almost nothing to do, yet
the host still pays for every op it dispatches: Python, the dispatcher, a
kernel launch, a few µs each. The device waits for the host:

    step time ≈ max(device time, ops per step · host time per op)

`gpt2` in bf16 reads 0.25 GB of weights per step (`cost.decode_cost`), 0.05
ms at an H200's 4.8 TB/s datasheet bandwidth, but one engine step dispatches
hundreds of ops (`steps.count_ops` counts them; lesson 03 prints the count):
at a few µs each, milliseconds of host time. Such a step is bound by launch
overhead, not by memory; the larger the model, the more work each launch
carries, until memory binds again (lesson 03 finds the crossover).

The fix: CUDA graphs
--------------------
Record every kernel of one step once, then replay them all with a single
launch, as vLLM, nano-vLLM and SGLang do. A replay reruns the same kernels on
the same addresses with the same shapes; only the values at those addresses
may change. So a step that can be captured must be

    static in shape    the batch padded to its bucket: 1, 2, 4, 8, then
                       multiples of 8 up to max_num_seqs (vLLM's sizes); each
                       block table padded to a width bucket: 1, 2, 4, 8, ...
                       blocks, up to a whole context
    static in address  its integers (token ids, positions, slot mapping, block
                       tables, context lengths) in buffers allocated once and
                       refilled in place (`StaticBuffer`), its
                       metadata made once per shape and reused
    free of syncs      nothing in the forward pass reads a value back to the host

A bucket's graph is captured the first time a step of its shape runs (the
largest bucket's first of all), all in one memory pool, on one stream of the
runner's own: the graph memory is about the activations of the largest step,
and an engine that only ever decodes a few sequences at short contexts
captures a few graphs, not all of them (gpt2-xl has 245 buckets). vLLM needs no width buckets, because its
attention kernel stops at each sequence's own length; here attention gathers
the whole padded width (paged_attention.py), so a short context must not pay
for the longest one.

What padding costs: a batch of n runs as bucket(n) rows (< 2n), and a decode
reads up to 2× the keys its longest context needs (`python -m minillm bench`
times a decode step; lesson 03 sets eager, static and graph side by side).
Padding pays off only
where a shape is replayed. So the runner has three modes for one and the same code:

    eager    exact shapes on the static buffers: the CPU's decode, and CUDA's
             with enforce_eager; no padding, no graph
    static   shapes padded to buckets, run eagerly: what a graph replays,
             checkable on any device (and what torch.compile sees as static)
    graph    static, captured per bucket on first use (CUDA), replayed after

Prefill and mixed chunked steps have a shape per step, and stay eager.

Invariants held by the tests: eager, static and graph decode give the same
greedy tokens and logits as `kv_cache.generate`, while sequences join and
leave; a compiled static step (torch.compile) does not recompile while the
batch and the contexts change within their buckets.
"""
from __future__ import annotations

import bisect

import torch

from .kv_cache import Segment
from .model import GPT2

MODES = ("eager", "static", "graph")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes for graphs: 1, 2, 4, 8, then multiples of 8, and max_num_seqs itself."""
    return sorted({b for b in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if b <= max_num_seqs} | {max_num_seqs})


def width_buckets(max_width: int) -> list[int]:
    """Block-table widths: powers of two up to `max_width`, and `max_width` itself."""
    return sorted({1 << i for i in range(max_width.bit_length()) if 1 << i <= max_width} | {max_width})


def can_capture(device: torch.device) -> bool:
    """CUDA graphs exist on CUDA devices only."""
    return device.type == "cuda"


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest size ≥ n."""
    return sizes[bisect.bisect_left(sizes, n)]


class StaticBuffer:
    """Integers allocated once on the device, refilled from the host every step, in place.

    Write through `host` (a NumPy view: filling it from Python lists dispatches
    no torch op), then `upload(n)` the first n entries. On the CPU the host and
    the device tensor are one, and `upload` does nothing. On CUDA the host side
    is pinned and the copy non_blocking; `host` waits for the last copy out of
    it to finish first, so a refill never races an upload still in flight.
    """

    def __init__(self, size: int, device: torch.device):
        self.tensor = torch.zeros(size, dtype=torch.long, device=device)
        self._pinned = None
        if device.type != "cpu":
            self._pinned = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
            self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._host = (self.tensor if self._pinned is None else self._pinned).numpy()

    @property
    def host(self):
        if self._pinned is not None and self._copied is not None:
            self._copied.synchronize()  # the previous upload has read the buffer (returns at once if it has)
        return self._host

    def upload(self, n: int) -> None:
        if self._pinned is not None:
            self.tensor[:n].copy_(self._pinned[:n], non_blocking=self._copied is not None)
            if self._copied is not None:
                self._copied.record()


class StaticInputs:
    """The integer inputs of a cache's static decode steps, in buffers allocated once.

    Laid out as positions | context lengths | the cache's own (its rows, or its
    slot mapping and block tables). `prepare(segments, batch, width)` writes a
    step padded to `batch` rows that read `width` units of keys, and returns
    the cache's metadata for that (batch, width), made the first time the shape
    is used and then reused, so a graph captured on it reads each step's values
    from the same addresses. Padding rows feed position 0 and see one key; the
    cache says where they write. The cache offers `width_unit`,
    `max_decode_width`, `decode_keys`, `decode_inputs_size`,
    `fill_decode_inputs` and `decode_metadata`.
    """

    def __init__(self, cache, max_batch: int, device: torch.device):
        self.cache, self.max_batch = cache, max_batch
        self._own = cache.decode_inputs_size(max_batch)
        self.buffer = StaticBuffer(2 * max_batch + self._own, device)
        L = cache.decode_keys(cache.max_decode_width)
        self._mask = torch.zeros(max_batch * L, dtype=torch.bool, device=device)
        self._keys = torch.arange(L, device=device)
        self._steps: dict[tuple[int, int], tuple] = {}  # (batch, width) → (metadata, key positions, context lens, mask)

    def prepare(self, segments: list[Segment], batch: int, width: int):
        """Fill the step's integers, upload them in one copy, and return its metadata (also `cache.metadata`)."""
        n, B, cache = len(segments), self.max_batch, self.cache
        L = cache.decode_keys(width)
        if not 0 < batch <= B or n > batch or not 0 < width <= cache.max_decode_width or \
                any(s.num_new != 1 or s.start + 1 > L for s in segments):
            raise ValueError(f"a static decode step of {batch} rows × {L} keys (at most {B} rows × "
                             f"{cache.max_decode_width} units of {cache.width_unit}) cannot hold segments "
                             f"{segments}: each feeds one token, and start + 1 ≤ {L}")
        host = self.buffer.host
        host[:batch] = [s.start for s in segments] + [0] * (batch - n)             # positions
        host[B:B + batch] = [s.start + 1 for s in segments] + [1] * (batch - n)    # context lengths
        used = cache.fill_decode_inputs(host[2 * B:], segments, batch, width)
        self.buffer.upload(2 * B + used)
        if (batch, width) not in self._steps:
            buf = self.buffer.tensor
            mask = self._mask[:batch * L].view(batch, L)
            meta = cache.decode_metadata(buf[:batch], buf[2 * B:], mask.view(batch, 1, 1, L), batch, width)
            self._steps[(batch, width)] = meta, self._keys[:L], buf[B:B + batch].view(batch, 1), mask
        meta, keys, context_lens, mask = self._steps[(batch, width)]
        torch.lt(keys, context_lens, out=mask)  # key j is visible to a row iff j < its context length
        cache.metadata = meta
        return meta


class DecodeRunner:
    """Runs the decode-only steps of `model` over `cache` on buffers allocated once.

    The cache is a `KVCache` or a `PagedKVCache`: anything `StaticInputs`
    can fill. `run(segments, tokens)` returns the step's logits.
    """

    def __init__(self, model: GPT2, cache, max_num_seqs: int, mode: str = "eager"):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; the modes are {', '.join(MODES)}")
        if mode == "graph" and not can_capture(model.device):
            raise ValueError(f"CUDA graphs need a CUDA device, and the model is on {model.device}; "
                             "use mode='static' to run the same padded step without a graph")
        self.model, self.cache, self.mode = model, cache, mode
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.widths = width_buckets(cache.max_decode_width)
        self.inputs = StaticInputs(cache, max_num_seqs, model.device)
        self.input_ids = StaticBuffer(max_num_seqs, model.device)
        self._ids: dict[int, torch.Tensor] = {}  # per batch size: the ids buffer shaped like the cache's positions
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # captured so far
        self.logits: torch.Tensor | None = None  # the graphs' output buffer, made with the first graph
        self._stream: torch.cuda.Stream | None = None  # warm-up and capture run here, and only here
        self._pool = None  # the memory pool all of this runner's graphs share

    def shape(self, segments: list[Segment]) -> tuple[int, int]:
        """(rows, table width in width units) of the step: exact when eager, else padded to buckets."""
        longest = max(s.start for s in segments) + 1
        width = -(-longest // self.cache.width_unit)
        if self.mode == "eager":
            return len(segments), width
        return bucket(len(segments), self.batch_sizes), bucket(width, self.widths)

    @torch.inference_mode()
    def run(self, segments: list[Segment], tokens: list[int]) -> torch.Tensor:
        """Logits (n, vocab) of one decode step: segment i (one token after `start` cached) feeds tokens[i].

        The returned tensor belongs to the runner until its next call (with
        graphs it is the graphs' output buffer): sample from it first.
        """
        n = len(segments)
        batch, width = self.shape(segments)
        if self.mode == "graph" and (batch, width) not in self.graphs:  # before this step's inputs are written:
            self.capture([(self.batch_sizes[-1], self.widths[-1]), (batch, width)])  # a capture fills them too
        host = self.input_ids.host
        host[:n] = tokens
        host[n:batch] = 0  # padding rows feed token 0; nobody samples them
        self.input_ids.upload(batch)
        self.inputs.prepare(segments, batch, width)
        if self.mode == "graph":
            self.graphs[(batch, width)].replay()
            return self.logits[:n]
        return self.forward(self._input_ids(batch)).view(batch, -1)[:n]

    @torch.inference_mode()
    def run_largest(self) -> torch.Tensor:
        """The largest step this runner can take, eagerly, on padding rows only: what a profile run measures."""
        batch, width = self.batch_sizes[-1], self.widths[-1]
        self.inputs.prepare([], batch, width)
        return self.forward(self._input_ids(batch))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The device work of a step, on the cache's prepared metadata: what a graph captures, and what
        torch.compile may trace (the tests do, to prove its shapes static)."""
        return self.model(input_ids, self.cache.metadata.positions, cache=self.cache)

    def _input_ids(self, batch: int) -> torch.Tensor:
        if batch not in self._ids:  # made once per batch size, so a graph always reads the same tensor
            self._ids[batch] = self.input_ids.tensor[:batch].view(self.cache.metadata.positions.shape)
        return self._ids[batch]

    @torch.inference_mode()
    def capture(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """Capture the graphs of `shapes` (default: every bucket) not captured yet, in that order, into this
        runner's one memory pool, as nano-vLLM's `capture_cudagraph` does largest first: each smaller graph
        then reuses the memory of the larger ones."""
        shapes = shapes or [(b, w) for b in reversed(self.batch_sizes) for w in reversed(self.widths)]
        if self.logits is None:
            self.logits = torch.empty(self.batch_sizes[-1], self.model.config.vocab_size, device=self.model.device,
                                      dtype=self.model.dtype)
        for batch, width in dict.fromkeys(shapes):
            if (batch, width) not in self.graphs:
                self.graphs[(batch, width)] = self._record(batch, width)

    def _record(self, batch: int, width: int) -> torch.cuda.CUDAGraph:
        """Warm up and capture one bucket's step on padding rows (the addresses every step of it fills), both on
        the runner's own stream: lazy initialisation stays outside the graph, and no other runner's capture or
        freed graph shares the stream: replays on a shared capture stream can crash with an illegal address once
        another graph captured there is freed (https://github.com/pytorch/pytorch/issues/193402)."""
        device = self.model.device
        self._stream = self._stream or torch.cuda.Stream(device)
        self.inputs.prepare([], batch, width)
        ids = self._input_ids(batch)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the inputs' upload comes first
        with torch.cuda.stream(self._stream):
            self.logits[:batch] = self.forward(ids).view(batch, -1)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            self.logits[:batch] = self.forward(ids).view(batch, -1)
        torch.cuda.current_stream(device).wait_stream(self._stream)
        self._pool = graph.pool()
        return graph
