"""Measuring a forward step, and knowing how close it came to the hardware.

A speed figure on its own ("40 ms per token") says little. The same figure as a
fraction of what the device can do ("82% of the memory bandwidth") says whether
there is anything left to win, and where. This module gives every lesson and the
`bench` command five things:

Timing
    `time_fn(fn, device)` runs warm-up calls, then repeats, and reports the
    median. On a GPU work is queued asynchronously, so it times with CUDA events
    (or a synchronize) around the work; on the CPU `time.perf_counter` suffices.
    `Stopwatch` times the laps of a loop, such as the steps of one generation.

Memory
    On CUDA the allocator's own statistics (allocated now, peak since a reset).
    On the CPU there is no such allocator to ask: the OS's count of the pages a
    process holds (`resident_bytes`) is the measurement, and the bytes that the
    weights and the caches own are *accounted* bytes, labelled as such.

The analytic cost of one forward step (`step_cost`)
    For a step that pushes n_i new tokens through sequence i, which already holds
    c_i cached tokens, with L layers, width C, vocabulary V and b bytes per element:

        FLOPs  = 2 · 12·L·C² · Σ n_i                        (the block matmuls)
               + 4 · L · C · Σ_i Σ_{j<n_i} (c_i + j + 1)     (q·kᵀ and p·v, causal)
               + 2 · V · C · rows                            (LM head, only the rows we sample)
        bytes  = block weights + ln_f + (V·C if rows > 0)    (every weight read once)
               + 2 · L · C · b · Σ c_i                       (cached K and V read)
               + 2 · L · C · b · Σ n_i                       (new K and V written)
               + embedding rows gathered + logits written
        arithmetic intensity = FLOPs / bytes

    These are the *minimum* bytes: activations are assumed to stay in cache, so
    a real step moves at least this much. Decode (n = 1) does ~2 FLOPs per weight
    read, i.e. 0.5 FLOP/byte in fp32; a 512-token prefill does ~512 times that.

The device's ceilings (`measure_ceilings`)
    Measured on the device itself, in the working dtype: matmul FLOP/s from a
    large square matmul, memory bandwidth from a large copy (read + write bytes
    counted), and their ratio, the *ridge point* in FLOP/byte. A step whose
    intensity lies left of the ridge is memory-bound (time ≈ bytes / bandwidth),
    right of it compute-bound (time ≈ FLOPs / FLOP/s). Datasheet figures, where
    known, are reported beside them and labelled as datasheet.

Launch overhead (lesson 09)
    `count_ops(fn)` counts the ATen ops one call dispatches from Python, views
    included: each costs the host time, and the non-view ones are roughly the
    kernels a GPU launches. `weight_read_floor` is the fastest a decode step
    can be, every weight read once at the measured bandwidth; `time_decode(...,
    mode=)` times the same decode step eager, on static buffers, or replayed as
    a CUDA graph (`cuda_graphs.py`), so a lesson sets each against that floor.

`si` prints every figure's magnitude the same way (1.23e9 → "1.23 G"), for
the lessons and `bench` alike.

Invariants held by the tests: `step_cost` equals a hand count for the tiny
shape; a decode step's FLOPs equal `GPT2Config.flops_per_token`; half precision
halves the bytes, not the FLOPs; `time_fn` runs warm-up + repeats and reports
their median.
"""
from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .config import GPT2Config, dtype_bytes

# ---- timing --------------------------------------------------------------------


def synchronize(device: torch.device | str) -> None:
    """Wait until all queued work on `device` has finished (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call: the median of `times_s`, the list of every timed repeat."""
    median_s: float
    times_s: list[float]
    warmup: int
    method: str  # "cuda-events" or "perf_counter"


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu",
            warmup: int = 2, repeats: int = 5) -> Timing:
    """Call `fn` `warmup` times untimed, then `repeats` times timed; report the median.

    Warm-up matters: the first calls pay for allocation, kernel selection and
    cold caches. The median ignores the odd repeat disturbed by another process.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1; pass repeats=1 or more")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms → s
        method = "cuda-events"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        method = "perf_counter"
    return Timing(statistics.median(times), times, warmup, method)


class Stopwatch:
    """Lap times of a loop, device-aware: `start()` once, `lap()` after each step.

    On CUDA each lap records an event, and the durations are read out at the end
    with a single synchronize, so timing adds no stall inside the loop. The loop
    itself must consume its results (e.g. pick tokens on the host) for the laps
    to mean latency as a user sees it; generation loops do.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [self._mark()]

    def lap(self) -> None:
        if not self._marks:
            raise RuntimeError("Stopwatch.lap() before start(); call start() before the loop")
        self._marks.append(self._mark())

    def laps_s(self) -> list[float]:
        """Seconds between consecutive marks: lap i is the time of step i."""
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


# ---- memory ----------------------------------------------------------------------


def cuda_memory(device: torch.device | str) -> dict:
    """The CUDA allocator's statistics in bytes: allocated now, peak, reserved."""
    device = torch.device(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "kind": "measured"}


def reset_peak_memory(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def tensor_bytes(module_or_tensors) -> int:
    """Bytes owned by a module's parameters and buffers, or by a list of tensors."""
    if isinstance(module_or_tensors, torch.nn.Module):
        tensors = list(module_or_tensors.parameters()) + list(module_or_tensors.buffers())
    else:
        tensors = list(module_or_tensors)
    return sum(t.nbytes for t in tensors)


def accounted_memory(model: torch.nn.Module | None = None, caches: Sequence = ()) -> dict:
    """Bytes the weights and the caches own; on the CPU this stands in for a measurement."""
    weights = tensor_bytes(model) if model is not None else 0
    kv = sum(c.nbytes for c in caches)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv, "kind": "accounted"}


def memory_budget(device: torch.device | str) -> dict:
    """The memory a device offers: CUDA's total, or the machine's RAM on the CPU (a stated budget)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"bytes": total, "free_bytes": free, "source": "torch.cuda.mem_get_info total"}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"bytes": total, "free_bytes": _mem_available(),
            "source": "stated budget: total RAM from os.sysconf (shared with the OS and other processes)"}


def _mem_available() -> int | None:
    """What the OS could give this process now without swapping (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def resident_bytes() -> int | None:
    """This process's resident memory as the OS counts it (Linux's /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


# ---- the analytic cost of one forward step -----------------------------------------


@dataclass
class StepCost:
    """Minimum work of one forward step; bytes split by what they are."""
    flops: int
    weight_bytes: int      # every weight the step touches, read once (LM head included when used)
    kv_read_bytes: int     # cached keys and values read by attention
    kv_write_bytes: int    # this step's new keys and values stored
    other_bytes: int       # embedding rows gathered, logits written
    tokens: int            # new tokens pushed through the model
    lm_head_rows: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.other_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP per byte."""
        return self.flops / self.bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "intensity": self.intensity}


def step_cost(config: GPT2Config, new_tokens: Sequence[int], cached_lens: Sequence[int],
              dtype: torch.dtype = torch.float32, lm_head_rows: int | None = None) -> StepCost:
    """The analytic cost of one forward pass over a batch of sequences.

    new_tokens[i]  tokens sequence i pushes through the model this step
    cached_lens[i] tokens sequence i already holds in its KV cache
    lm_head_rows   rows the LM head is applied to (default: one per sequence,
                   as prefill with `logits_indices` and decode both do)
    """
    if len(new_tokens) != len(cached_lens) or not new_tokens:
        raise ValueError(f"new_tokens ({len(new_tokens)}) and cached_lens ({len(cached_lens)}) must "
                         "name the same, non-zero number of sequences")
    if any(n < 1 for n in new_tokens) or any(c < 0 for c in cached_lens):
        raise ValueError(f"new_tokens={list(new_tokens)} must be ≥ 1 and cached_lens={list(cached_lens)} ≥ 0")
    L, C, V = config.n_layer, config.n_embd, config.vocab_size
    b = dtype_bytes(dtype)
    rows = len(new_tokens) if lm_head_rows is None else lm_head_rows
    tokens = sum(new_tokens)
    # Keys each new token attends to: token j of sequence i sees c_i + j + 1 of them.
    attended = sum(n * c + n * (n + 1) // 2 for n, c in zip(new_tokens, cached_lens))
    flops = 2 * L * 12 * C * C * tokens + 4 * L * C * attended + 2 * V * C * rows

    block_params = config.num_params() - (V + config.n_ctx) * C  # blocks and ln_f
    head_params = V * C if rows else 0
    kv_per_token = config.kv_bytes_per_token(dtype)
    return StepCost(
        flops=flops,
        weight_bytes=(block_params + head_params) * b,
        kv_read_bytes=kv_per_token * sum(cached_lens),
        kv_write_bytes=kv_per_token * tokens,
        other_bytes=2 * C * b * tokens + V * b * rows,  # wte + wpe rows in, logits out
        tokens=tokens, lm_head_rows=rows)


def prefill_cost(config: GPT2Config, prompt_len: int, batch: int = 1,
                 dtype: torch.dtype = torch.float32) -> StepCost:
    """A prefill of `batch` fresh prompts of `prompt_len` tokens, LM head on each last token."""
    return step_cost(config, [prompt_len] * batch, [0] * batch, dtype)


def decode_cost(config: GPT2Config, cached_len: int, batch: int = 1,
                dtype: torch.dtype = torch.float32) -> StepCost:
    """One decode step: `batch` sequences each add one token after `cached_len` cached ones."""
    return step_cost(config, [1] * batch, [cached_len] * batch, dtype)


# ---- the device's ceilings ----------------------------------------------------------

# Vendor figures, dense (no sparsity), for labelling only; the lessons use measured ceilings.
DATASHEET = {
    "H200": {"bf16_flops": 989e12, "fp16_flops": 989e12, "fp32_flops": 67e12, "bytes_per_s": 4.8e12},
    "H100": {"bf16_flops": 989e12, "fp16_flops": 989e12, "fp32_flops": 67e12, "bytes_per_s": 3.35e12},
    "A100": {"bf16_flops": 312e12, "fp16_flops": 312e12, "fp32_flops": 19.5e12, "bytes_per_s": 2.0e12},
}


@dataclass
class Ceilings:
    device: str
    dtype: str
    matmul_flops: float        # FLOP/s, measured
    bandwidth: float           # bytes/s, measured by a copy (read + write counted)
    matmul_size: int
    copy_bytes: int
    datasheet: dict = field(default_factory=dict)

    @property
    def ridge(self) -> float:
        """FLOP per byte at which compute time equals memory time."""
        return self.matmul_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The roofline: the best FLOP/s a step of this intensity can reach."""
        return min(self.matmul_flops, intensity * self.bandwidth)

    def as_dict(self) -> dict:
        return {**asdict(self), "ridge": self.ridge,
                "method": {"matmul_flops": f"median of a {self.matmul_size}² @ {self.matmul_size}² matmul in {self.dtype}",
                           "bandwidth": f"median of a {self.copy_bytes / 2**20:.0f} MiB tensor copy, read + write bytes counted"}}


_CEILINGS: dict[tuple[str, str, bool], Ceilings] = {}


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def datasheet_for(device: torch.device | str, dtype: torch.dtype) -> dict:
    """The vendor's figures for this GPU and dtype, if we know them (labelled, never used to judge)."""
    name = device_name(device)
    for key, figures in DATASHEET.items():
        if torch.device(device).type == "cuda" and key in name:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
            return {"source": f"datasheet ({key}, dense)", "matmul_flops": figures[f"{short}_flops"],
                    "bandwidth": figures["bytes_per_s"]}
    return {}


@dataclass
class Kernel:
    """A callable that does a known amount of work: `flops` FLOPs and `bytes` bytes of memory traffic per call."""
    fn: Callable[[], object]
    flops: int
    bytes: int


def ceiling_kernels(device: torch.device | str, dtype: torch.dtype, quick: bool = False) -> dict[str, Kernel]:
    """The two kernels that define the ceilings: a large square matmul and a large copy.

    Sizes are chosen to defeat caches: the copy moves far more than any CPU's L3,
    and the matmul is large enough to reach the units' steady state. A lesson
    that times them in turns with its own steps compares each step with the
    ceiling measured in the same moment, which a busy machine disturbs alike.
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    n = (4096 if quick else 8192) if on_gpu else (1024 if quick else 2048)
    copy_bytes = (1 << 30 if on_gpu else 128 << 20) if quick else (2 << 30 if on_gpu else 512 << 20)
    a = torch.randn(n, n, device=device).to(dtype)
    bm = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    src = torch.ones(copy_bytes // dtype_bytes(dtype), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return {"matmul": Kernel(lambda: torch.matmul(a, bm, out=out), 2 * n ** 3, 3 * n * n * dtype_bytes(dtype)),
            "copy": Kernel(lambda: dst.copy_(src), 0, 2 * src.nbytes)}  # read + write counted


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, quick: bool = False,
                     progress: Callable[[str], None] = lambda message: None) -> Ceilings:
    """Measure matmul FLOP/s and copy bandwidth on `device` in `dtype`; cached per process.

    `progress(message)` is called as each of the two measurements starts.
    """
    device = torch.device(device)
    key = (str(device), str(dtype), quick)
    if key in _CEILINGS:
        return _CEILINGS[key]
    kernels = ceiling_kernels(device, dtype, quick)
    mm, copy = kernels["matmul"], kernels["copy"]
    mm_size = round((mm.flops / 2) ** (1 / 3))
    repeats = 3 if quick else 7
    progress(f"matmul FLOP/s: 2 + {repeats} products of two {mm_size}×{mm_size} matrices in "
             f"{str(dtype).removeprefix('torch.')}")
    t_mm = time_fn(mm.fn, device, warmup=2, repeats=repeats)
    progress(f"copy bandwidth: 2 + {repeats} copies of {copy.bytes // 2 >> 20} MiB")
    t_copy = time_fn(copy.fn, device, warmup=2, repeats=repeats)
    del kernels
    result = Ceilings(device=device_name(device), dtype=str(dtype).replace("torch.", ""),
                      matmul_flops=mm.flops / t_mm.median_s, bandwidth=copy.bytes / t_copy.median_s,
                      matmul_size=mm_size, copy_bytes=copy.bytes // 2,
                      datasheet=datasheet_for(device, dtype))
    _CEILINGS[key] = result
    return result


def achieved(cost: StepCost, seconds: float, ceilings: Ceilings) -> dict:
    """Where a timed step lands against the ceilings: achieved FLOP/s and bytes/s, and their fractions."""
    flops_per_s = cost.flops / seconds
    bytes_per_s = cost.bytes / seconds
    return {"seconds": seconds, "flops": cost.flops, "bytes": cost.bytes, "intensity": cost.intensity,
            "flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s,
            "weight_bytes_per_s": cost.weight_bytes / seconds,
            "frac_matmul_flops": flops_per_s / ceilings.matmul_flops,
            "frac_bandwidth": bytes_per_s / ceilings.bandwidth,
            "frac_roofline": flops_per_s / ceilings.attainable(cost.intensity),
            "bound": "compute" if cost.intensity >= ceilings.ridge else "memory"}


# ---- timed steps with the contiguous KV cache ------------------------------------------


def prefill_step(model, prompt_len: int, batch: int = 1, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A function that runs one prefill of `batch` prompts of `prompt_len` tokens into a fresh KV cache.

    The LM head runs on each prompt's last position only, as a serving engine does.
    """
    from .kv_cache import KVCache, Segment  # here, not at the top: kv_cache imports the model, lessons only need costs

    cfg, device = model.config, model.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    last = torch.arange(batch, device=device) * prompt_len + (prompt_len - 1)
    cache = KVCache(cfg, batch, prompt_len, device, model.dtype)
    segments = [Segment(row, 0, prompt_len) for row in range(batch)]  # every call starts fresh, same reservation

    @torch.inference_mode()
    def step():
        meta = cache.prepare(segments)
        return model(ids, meta.positions, cache=cache, logits_indices=last)

    return step


def decode_step(model, cached_len: int, batch: int = 1, seed: int = 0,
                mode: str = "eager") -> Callable[[], torch.Tensor]:
    """A function that runs one decode step: `batch` sequences each add a token after `cached_len` cached ones.

    Time does not depend on the values in the cache, so instead of running a
    prefill we declare the first `cached_len` slots filled (they hold zeros).
    Every call prepares the same step at the same length, so it does the same work.

    mode "eager"   `cache.prepare` and a forward pass, new metadata tensors each step
         "static"  the same step on buffers allocated once (`cuda_graphs.DecodeRunner`);
                   its rows are read through an index, a copy of their keys and
                   values that eager's consecutive rows (a view) do not pay
         "graph"   that static step replayed as a CUDA graph (CUDA only): the
                   same kernels as "static", so the difference is launch overhead
    Each call includes the host's work: filling the step's inputs, and the
    launches (or the one replay).
    """
    from .cuda_graphs import DecodeRunner
    from .kv_cache import KVCache, Segment

    cfg, device = model.config, model.device
    if cached_len + 1 > cfg.n_ctx:
        raise ValueError(f"cached_len={cached_len} leaves no room for a new token in n_ctx={cfg.n_ctx}; "
                         f"use cached_len ≤ {cfg.n_ctx - 1}")
    if mode not in ("eager", "static", "graph"):
        raise ValueError(f"mode={mode!r}; use eager, static or graph")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g).tolist()
    cache = KVCache(cfg, batch, cached_len + 1, device, model.dtype)
    segments = [Segment(row, cached_len, 1, is_decode=True) for row in range(batch)]
    if mode == "eager":
        ids = torch.tensor(tokens, device=device)[:, None]

        @torch.inference_mode()
        def step():
            meta = cache.prepare(segments)
            return model(ids, meta.positions, cache=cache)
    else:  # max_num_seqs = batch: the batch is its own bucket, nothing is padded
        step = functools.partial(DecodeRunner(model, cache, batch, mode).run, segments, tokens)
    return step


def time_prefill(model, prompt_len: int, batch: int = 1, warmup: int = 1, repeats: int = 3,
                 seed: int = 0) -> Timing:
    """Time `prefill_step`: one prefill of `batch` prompts of `prompt_len` tokens."""
    return time_fn(prefill_step(model, prompt_len, batch, seed), model.device, warmup, repeats)


def time_decode(model, cached_len: int, batch: int = 1, warmup: int = 1, repeats: int = 5,
                seed: int = 0, mode: str = "eager") -> Timing:
    """Time `decode_step` (same arguments): `batch` sequences each add a token after `cached_len` cached ones."""
    return time_fn(decode_step(model, cached_len, batch, seed, mode), model.device, warmup, repeats)


# ---- launch overhead ------------------------------------------------------------------


@dataclass
class OpCount:
    """The ATen ops one call dispatched from Python: `total`, of which `views` only reinterpret memory."""
    total: int
    views: int
    by_op: dict[str, int]

    @property
    def kernels(self) -> int:
        """Ops that are not views: on a GPU, roughly the kernels launched."""
        return self.total - self.views

    def as_dict(self) -> dict:
        return {**asdict(self), "kernels": self.kernels}


class _Dispatches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> OpCount:
    """Count the ATen ops that one call of `fn` dispatches: what the host pays for, op by op.

    It runs under inference_mode, as the engine does, where an op reaches the
    count as Python called it: `F.linear` is one op, whatever it calls inside.
    A replayed CUDA graph is a single call, not an op, so only the host's own
    work around it (filling and uploading the step's inputs) counts.
    """
    counter = _Dispatches()
    with torch.inference_mode(), counter:
        fn()
    views = sum(n for op, n in counter.ops.items() if op.is_view)
    by_op = {str(op).removeprefix("aten."): n for op, n in counter.ops.most_common()}
    return OpCount(sum(counter.ops.values()), views, by_op)


def weight_read_floor(config: GPT2Config, dtype: torch.dtype, bandwidth: float, batch: int = 1) -> float:
    """Seconds a decode step cannot beat: every weight it uses (the LM head included) read once at
    `bandwidth` bytes/s, the measured copy bandwidth. Its KV reads come on top; at short contexts they are small."""
    return decode_cost(config, 0, batch, dtype).weight_bytes / bandwidth


def si(x: float, unit: str = "") -> str:
    """1.23e9 → '1.23 G' + unit: readable magnitudes for printed figures."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g} {unit}".strip()
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def environment(device: torch.device | str, dtype: torch.dtype) -> dict:
    """What a result needs beside it to be reproducible."""
    device = torch.device(device)
    env = {"device": str(device), "device_name": device_name(device), "dtype": str(dtype).replace("torch.", ""),
           "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    try:
        env["load_average"] = os.getloadavg()
    except OSError:
        pass
    return env
