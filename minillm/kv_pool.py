"""Sizing the engine's KV pool: how many blocks fit, and, on a GPU, a profile run to find out.

Give `num_gpu_blocks_override` directly; or a byte budget `kv_cache_memory_bytes`; or, on
CUDA, `gpu_memory_utilization`, the share of the GPU's memory the engine may
fill. As vLLM does, the engine then profiles: it runs its largest prefill and
decode steps on a throwaway pool and reads the allocator's peak, captures its
largest graph and reads what that holds, and gives the pool what is left of
its share:

    pool = total · utilization − memory outside torch (CUDA context, other processes)
           − live tensors (the weights) − activation peak − graph memory

Memory the caching allocator keeps after an earlier engine let go of it is not
subtracted: the new pool reuses it. On the CPU the default budget is 1 GiB, and
a pool larger than the memory there is is refused before it is allocated.

The knobs travel together in a `CacheConfig`, as vLLM's do. One call,
`size_pool`, answers the engine: the number of blocks, and how it
was reached (block bytes, budget, activation peak, graph bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .block_manager import DEFAULT_BLOCK_SIZE, BlockManager
from .config import check_int, check_real
from .cuda_graphs import DecodeRunner
from .kv_cache import Segment
from .device import available_memory
from .model import GPT2
from .paged_attention import PagedKVCache
from .sampling import sample
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig
from .sequence import RequestMetrics, Sequence

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV pool's knobs, under vLLM's names, each checked when made.

    block_size                tokens per block
    num_gpu_blocks_override   the pool in blocks, given outright (no sizing)
    kv_cache_memory_bytes     else a byte budget for the pool
    gpu_memory_utilization    else, on CUDA, the share of the GPU the engine may fill (a profile run sizes it)
    enable_prefix_caching     keep full blocks by the hash of their prefix (prefix_caching.py)
    """
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False

    def __post_init__(self):
        """Each knob's type and range, whatever the device: a knob that does nothing here is still checked."""
        check_int("block_size", self.block_size, 1)
        if self.num_gpu_blocks_override is not None:
            check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1,
                      hint=": the pool needs at least one block")
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if not 0 < check_real("gpu_memory_utilization", self.gpu_memory_utilization) <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]: it is the "
                             "share of the GPU's memory the engine may fill (0.9 leaves a tenth for everything else)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")


def size_pool(model: GPT2, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
              use_graphs: bool) -> tuple[int, dict[str, int]]:
    """The engine's pool in blocks, and how it was sized (empty when `num_gpu_blocks_override` is given)."""
    block_size, num_blocks = cache_config.block_size, cache_config.num_gpu_blocks_override
    memory: dict[str, int] = {}
    kv_bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
    if num_blocks is None:
        block_bytes = block_size * kv_bytes_per_token
        memory["block_bytes"] = block_bytes
        budget = cache_config.kv_cache_memory_bytes
        if budget is None and model.device.type == "cuda":
            activation_peak, graph_bytes = _profile(model, scheduler_config, block_size, use_graphs)
            budget = gpu_kv_budget(model.device, cache_config.gpu_memory_utilization, activation_peak, graph_bytes)
            memory.update(activation_peak=activation_peak, graph_bytes=graph_bytes)
        elif budget is None:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes - 1  # the pool holds one block more: the pad block (paged_attention.py)
        memory.update(kv_budget=budget)
        if num_blocks < 1:
            raise ValueError(f"the KV budget of {budget / 2**20:.1f} MiB holds no block of {block_bytes / 2**20:.2f} "
                             f"MiB ({block_size} tokens) besides the pad block; raise kv_cache_memory_bytes or "
                             "gpu_memory_utilization, or use a smaller model")
    # Refuse a pool larger than the memory there is, before allocating it: on the CPU an oversized
    # allocation is not an error but a process the kernel kills later, without a word.
    device = model.device
    pool = (num_blocks + 1) * block_size * kv_bytes_per_token  # + the pad block
    have = available_memory(device)
    if pool > have:
        raise ValueError(f"num_gpu_blocks_override={num_blocks} blocks of {block_size} tokens need "
                         f"{pool / 2**30:,.1f} GiB of KV cache, but {device} has {have / 2**30:,.1f} GiB available; "
                         "lower num_gpu_blocks_override, or leave it out and size the pool with kv_cache_memory_bytes")
    return num_blocks, memory


@torch.inference_mode()
def _profile(model: GPT2, sc: SchedulerConfig, block_size: int, use_graphs: bool) -> tuple[int, int]:
    """vLLM's profile run, on a throwaway pool: the allocator's peak over the engine's largest prefill
    (max_num_batched_tokens, sampled) and largest decode step (max_num_seqs rows over whole-context tables),
    and the memory that the largest CUDA graph holds (0 without graphs)."""
    device = model.device
    prefill, decoder = profile_steps(model, sc.max_num_batched_tokens, sc.max_num_seqs, block_size)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)  # the throwaway pool is not an activation: measure above it
    torch.cuda.reset_peak_memory_stats(device)
    prefill()
    decoder.run_largest()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - base
    graph_bytes = 0
    if use_graphs:  # torch.cuda.graph empties the allocator's cache on entry: measure from an empty one,
        torch.cuda.empty_cache()  # and to one with nothing cached but the graph's pool and its output buffer
        before = torch.cuda.memory_reserved(device)
        decoder.capture([(decoder.batch_sizes[-1], decoder.widths[-1])])
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        graph_bytes = torch.cuda.memory_reserved(device) - before
    del prefill, decoder
    torch.cuda.empty_cache()
    return activation_peak, graph_bytes


def gpu_kv_budget(device: torch.device, utilization: float, activation_peak: int, graph_bytes: int) -> int:
    """Bytes for the KV pool: the engine's share of the GPU, less what is spoken for.

    The share is total · utilization. Spoken for: memory used outside this
    process's torch allocator (the CUDA context, other processes: used − reserved),
    the live tensors (allocated: the weights, anything still held), the activation
    peak of the largest step, and the graphs' memory. What the caching allocator
    has reserved but no tensor uses, say the pool of an engine deleted before, is
    free for this one (counting it as used, total − free, would leave a second
    engine in one process no room at all).
    """
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    live = torch.cuda.memory_allocated(device)
    return int(total * utilization) - outside_torch - live - activation_peak - graph_bytes


def profile_steps(model: GPT2, max_num_batched_tokens: int, max_num_seqs: int,
                  block_size: int) -> tuple[Callable[[], list[int]], DecodeRunner]:
    """The largest steps an engine of these limits can take, on a throwaway pool, for a profile run.

    Returns a function that runs the largest prefill (max_num_batched_tokens
    tokens in prompts of at most n_ctx, then the LM head and a top-k/top-p
    sampler on max_num_seqs rows), and a static `DecodeRunner` whose
    `run_largest` takes max_num_seqs rows over whole-context tables. Runs on
    any device, so the CPU tests check its shapes.
    """
    cfg, device = model.config, model.device
    lens = [min(cfg.n_ctx, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens, cfg.n_ctx)]
    blocks = BlockManager(sum(-(-n // block_size) for n in lens), block_size)
    cache = PagedKVCache(cfg, blocks, device, model.dtype)
    segments = []
    for n in lens:  # sequences of n prompt tokens each, given their slots as the scheduler would
        seq = Sequence("profile", (0,) * n, SamplingParams(max_tokens=1), RequestMetrics(arrival_time=0.0))
        blocks.append_slots(seq, n)
        segments.append(Segment(seq.seq_id, 0, n))
    rows = min(max_num_seqs, sum(lens))
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * rows

    @torch.inference_mode()
    def prefill():
        meta = cache.prepare(segments)
        logits = model(torch.zeros(1, sum(lens), dtype=torch.long, device=device), meta.positions, cache=cache,
                       logits_indices=torch.arange(rows, device=device))
        return sample(logits, params)

    return prefill, DecodeRunner(model, cache, max_num_seqs, "static")
