"""Disaggregated prefill: a KV connector that moves a prompt's keys and values from a prefill worker to a decode worker.

Why split the phases
--------------------
Prefill is compute-bound (a prompt's tokens go through each weight matrix
together), decode is memory-bound (every step reads every weight for one token
per sequence; lessons 02 and 04). One engine serving both makes them
interfere: a long prompt's prefill shares a step with the running decodes, so
every stream stalls (lesson 10); chunking bounds the stall but pays for it in
TTFT and extra steps. Disaggregation runs the two phases on separate workers,
each an `LLMEngine` in its own process on its own cores (or GPU):

    prefill worker: computes the prompt, samples the first token, sends the KV        (kv_producer.py)
    decode worker:  receives the KV into its own pool, through its own block table,   (kv_consumer.py)
                    and decodes on

so the decode worker's steps never carry a prefill, and TTFT and ITL can be
tuned apart (DistServe, Splitwise, Mooncake; vLLM's disaggregated prefill).
What it does not buy is throughput: the same work is done on the same cores,
plus the transfer (vLLM's documentation says so, and lesson 15 measures it).

What it costs
-------------
Every prompt's KV crosses the link once:

    bytes moved per request = prompt_len · 2 · n_layer · n_embd · dtype bytes      (K and V, every layer)
    TTFT grows by about      bytes moved / link bandwidth  (less what overlaps the prefill)

gpt2 in fp32: 73,728 bytes per token, 75.5 MB for a 1,024-token prompt.

The interface keeps vLLM's `KVConnectorBase_V1` verbs: the producer's
`save_kv_layer` and `wait_for_save`; the consumer's `get_num_new_matched_tokens`,
`update_state_after_alloc`, `request_finished` and `start_load_kv`. This file
holds what both sides must agree on: the wire, and the checks made before it
carries anything.

The wire (one torch.distributed process group of two ranks: 0 prefill, 1 decode; gloo on the CPU, NCCL on
CUDA, the same code; every message in order, as NCCL matches them):

    header   int64 [1 + 2·MAX_REQUESTS_PER_STEP]: count, then (key, prompt_len) per request completing its
             prompt in the step; count −1: the producer is closing
    KV       for each layer, for each request in header order, for each block: that block's filled slots
    trailer  int64 [count]: each request's first token, or −1 if the step failed (the request fails; both
             sides free its blocks)

A block's KV for one layer is contiguous in the pool, [block_size, K|V, head,
head_dim], so each KV message is a view of the pool on both sides
(`block_views`): no copy is made to send or to receive.

Invariants held by the tests: greedy tokens (and their logits) of a request
prefilled on one worker and decoded on another are those of one engine serving
it alone, for prompts ending inside a block and on a block boundary; the bytes
moved are exactly prompt_len · 2 · n_layer · n_embd · dtype bytes; a transfer
aborted in flight, refused or failed frees its blocks on both sides once it
ends, and when all is done every block of both pools is free.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .engine import LLMEngine
from .paged_attention import PagedKVCache
from .sampling_params import SamplingParams

PREFILL_RANK, DECODE_RANK = 0, 1
MAX_REQUESTS_PER_STEP = 256  # header slots: the most prompts one prefill step may complete (its max_num_seqs)
CLOSING = -1                 # a header count: the producer is closing, the consumer's receiver stops
FAILED = -1                  # a trailer token: the step failed, the request fails on both sides
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for the pools' device: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def header(pairs: list[tuple[int, int]] | None, device: torch.device) -> torch.Tensor:
    """The header of a step: its (key, prompt_len) pairs; None: the closing header (count −1)."""
    out = torch.zeros(1 + 2 * MAX_REQUESTS_PER_STEP, dtype=torch.int64, device=device)
    if pairs is None:
        out[0] = CLOSING
    else:
        out[0] = len(pairs)
        out[1:1 + 2 * len(pairs)] = torch.tensor([x for pair in pairs for x in pair], dtype=torch.int64)
    return out


def read_header(out: torch.Tensor) -> list[tuple[int, int]] | None:
    """The (key, prompt_len) pairs a received header names; None for the closing header."""
    count = int(out[0])
    if count == CLOSING:
        return None
    return [tuple(pair) for pair in out[1:1 + 2 * count].view(count, 2).tolist()]


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
