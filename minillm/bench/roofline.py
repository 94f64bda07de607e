"""The device's ceilings and the roofline: how close a timed step came to the hardware.

A speed figure on its own ("40 ms per token") says little. The same figure as a fraction of what the
device can do ("82% of the memory bandwidth") says whether there is anything left to win, and where.

The roofline. A step that does F FLOPs and moves B bytes cannot beat either limit:

    time ≥ max(F / peak, B / bandwidth)        so   F / time ≤ min(peak, I · bandwidth),   I = F / B

I is the step's arithmetic intensity (FLOP per byte). The *ridge*, peak ÷ bandwidth, is the intensity at
which both limits meet: a step left of it is memory-bound (time ≈ B / bandwidth), right of it compute-bound
(time ≈ F / peak).

The ceilings are measured on the device, in the working dtype, in this process with the threads torch and
numpy have now (the engine's), each with the kernels the engine itself runs:

    peak        the fastest of: a large square torch.matmul, and the model's own product as the engine runs
                it for several rows (the module `cpu_layout` swaps in for this device and dtype: a oneDNN-packed
                copy where packing pays, F.linear over W elsewhere; on CUDA that is the plain matmul), at
                n × n × n, large enough to keep the units busy.
    bandwidth   the fastest of three read streams over buffers far larger than any cache: a copy (read +
                write bytes counted), a sum (read only), and the engine's one-row product (the kernel of a
                batch-1 decode: numpy's BLAS or F.linear over W, bf16's packed copy) over a stack of weight
                matrices (their bytes counted).

Each kernel is timed several times and its *best* repeat kept; each ceiling is its best kernel. A ceiling
is a maximum: load that slows some repeats lowers it only if it slows them all. Why that bounds our steps:
a step's products run these kernels, at shapes no friendlier than these, and everything else it does only
adds time; so its FLOP/s cannot beat the fastest product, nor its bytes/s the fastest read. (The bandwidth
is memory's: a model small enough to stay in the caches could read faster, but per-step overhead holds such
a model far below it.) Datasheet figures, where known, are labelled and never used to judge.

`achieved(cost, seconds, ceilings)` sets a timed step's analytic cost (`cost.py`) against them;
`ceilings_from(kernels, times)` makes ceilings from kernels timed elsewhere (a lesson times them in turns
with its steps). A new kernel (another dtype, int8 weights) joins by a `Kernel` in `ceiling_kernels`.

Invariant held by the tests: no share of a ceiling that `bench` or a lesson prints or plots exceeds 100%,
because the ceiling is measured, not because a figure is clamped; a ceiling measured with a deliberately
slow kernel makes that check fail. A figure above its ceiling is a bug in the ceiling.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..config import dtype_bytes
from .. import cpu_layout
from ..cpu_layout import linear_in_layout, numpy_blas_pays, packing_pays
from ..model import Conv1D
from .cost import StepCost
from .timing import device_name, time_fn


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
    matmul_flops: float        # FLOP/s: the peak, the fastest compute kernel's best repeat
    bandwidth: float           # bytes/s: the fastest read stream's best repeat
    matmul_size: int           # n of the n × n × n products
    copy_bytes: int            # bytes of each read stream's buffer
    datasheet: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)  # name → {"roof", "rate", "what"}: every kernel's best

    @property
    def ridge(self) -> float:
        """FLOP per byte at which compute time equals memory time."""
        return self.matmul_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The roofline: the best FLOP/s a step of this intensity can reach."""
        return min(self.matmul_flops, intensity * self.bandwidth)

    def fastest(self, roof: str) -> str:
        """What the kernel that set this ceiling ("compute": the peak, "memory": the bandwidth) is."""
        return max((k for k in self.kernels.values() if k["roof"] == roof), key=lambda k: k["rate"])["what"]

    def as_dict(self) -> dict:
        said = {roof: " | ".join(f"{k['what']}: {k['rate']:.4g}" for k in self.kernels.values() if k["roof"] == roof)
                for roof in ("compute", "memory")}
        return {**asdict(self), "ridge": self.ridge,
                "method": {"matmul_flops": f"the fastest kernel's best repeat, in FLOP/s, of: {said['compute']}",
                           "bandwidth": f"the fastest read stream's best repeat, in bytes/s, of: {said['memory']}"}}


@dataclass
class Kernel:
    """A callable that does a known amount of work per call: `flops` FLOPs and `bytes` bytes of memory traffic;
    `roof` says which ceiling it measures ("compute": FLOP/s, "memory": bytes/s), `what` what it is."""
    fn: Callable[[], object]
    flops: int
    bytes: int
    roof: str = "compute"
    what: str = ""

    def rate(self, seconds: float) -> float:
        """FLOP/s for a compute kernel, bytes/s for a memory one, at `seconds` per call."""
        return (self.flops if self.roof == "compute" else self.bytes) / seconds


_CEILINGS: dict[tuple[str, str, bool, int], Ceilings] = {}  # measured once per process and thread count


def datasheet_for(device: torch.device | str, dtype: torch.dtype) -> dict:
    """The vendor's figures for this GPU and dtype, if we know them (labelled, never used to judge)."""
    name = device_name(device)
    for key, figures in DATASHEET.items():
        if torch.device(device).type == "cuda" and key in name:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
            return {"source": f"datasheet ({key}, dense)", "matmul_flops": figures[f"{short}_flops"],
                    "bandwidth": figures["bytes_per_s"]}
    return {}


def engine_layout(device: torch.device, dtype: torch.dtype) -> dict:
    """What `cpu_layout.choose_layout` gives a model of this dtype on this device: {"packed", "numpy_one_row"}
    (read from the CPU through `cpu_layout`'s own names, as `choose_layout` reads it)."""
    c = cpu_layout
    return {"packed": packing_pays(device, dtype, c.cpuinfo("flags")),
            "numpy_one_row": numpy_blas_pays(device, dtype, c.cpu_vendor(), c.numpy_blas(), c.openblas_threads_sleep())}


def ceiling_kernels(device: torch.device | str, dtype: torch.dtype, quick: bool = False) -> dict[str, Kernel]:
    """The kernels that define the ceilings, each in `dtype` on `device`, the engine's products in its layout.

    compute: "matmul" (torch.matmul of two n × n matrices) and "product" (n rows through the engine's
    projection module of an n × n W); memory: "copy" and "sum" over a buffer far larger than any cache, and
    "one-row product" (one row through a stack of the engine's [1024, 4096] projection modules, as large).
    """
    device = torch.device(device)
    on_gpu, b, name = device.type == "cuda", dtype_bytes(dtype), str(dtype).removeprefix("torch.")
    n = (4096 if quick else 8192) if on_gpu else (1024 if quick else 2048)
    nbytes = (1 << 30 if on_gpu else 128 << 20) if quick else (2 << 30 if on_gpu else 256 << 20)
    layout = engine_layout(device, dtype)
    a, bm = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    def module(shape):  # drawn on the device itself: a CPU would take seconds to draw a GPU's gigabytes
        with torch.device(device):
            return linear_in_layout(Conv1D(*shape).to(dtype), layout["packed"], layout["numpy_one_row"])
    proj = module((n, n))
    src = torch.ones(nbytes // b, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    width = (1024, 4096)
    stack = [module(width) for _ in range(max(1, nbytes // (width[0] * width[1] * b)))]
    row = torch.randn(1, width[0], device=device).to(dtype)

    @torch.inference_mode()
    def product():
        return proj(a)

    @torch.inference_mode()
    def one_row():
        return [layer(row) for layer in stack]
    kind = "F.linear over W" if not layout["packed"] else "a oneDNN-packed copy of W"
    one = ("numpy's BLAS over W" if layout["numpy_one_row"] and dtype == torch.float32 else
           "a oneDNN-packed copy of W" if layout["packed"] and dtype == torch.bfloat16 else "F.linear over W")
    stack_bytes = sum(m.weight.nbytes + m.bias.nbytes for m in stack)
    return {"matmul": Kernel(lambda: torch.matmul(a, bm, out=out), 2 * n ** 3, 3 * n * n * b, "compute",
                             f"torch.matmul {n}×{n} @ {n}×{n} in {name}"),
            "product": Kernel(product, 2 * n ** 3, 3 * n * n * b, "compute",
                              f"the engine's projection, {n} rows × [{n}, {n}] via {kind}, in {name}"),
            "copy": Kernel(lambda: dst.copy_(src), 0, 2 * src.nbytes, "memory",
                           f"a copy of {src.nbytes >> 20} MiB, read + write counted"),
            "sum": Kernel(lambda: src.sum(), 0, src.nbytes, "memory", f"a sum of {src.nbytes >> 20} MiB, read only"),
            "one-row product": Kernel(one_row, 2 * stack_bytes // b, stack_bytes, "memory",
                                      f"one row through {len(stack)} [{width[0]}, {width[1]}] projections "
                                      f"({stack_bytes >> 20} MiB) via {one}")}


def ceilings_from(kernels: dict[str, Kernel], times: dict[str, list[float]], device: torch.device | str,
                  dtype: torch.dtype) -> Ceilings:
    """The ceilings from kernels timed `times[name]` (seconds per call): each kernel's best repeat, and each
    ceiling its fastest kernel. `times` may hold other names (a lesson's steps), which are ignored."""
    best = {name: {"roof": k.roof, "rate": k.rate(min(times[name])), "what": k.what}
            for name, k in kernels.items()}
    peak = max(v["rate"] for v in best.values() if v["roof"] == "compute")
    bandwidth = max(v["rate"] for v in best.values() if v["roof"] == "memory")
    square = next((k for k in kernels.values() if k.roof == "compute"), None)
    read = max((k.bytes for k in kernels.values() if k.roof == "memory"), default=0)
    return Ceilings(device=device_name(device), dtype=str(dtype).removeprefix("torch."), matmul_flops=peak,
                    bandwidth=bandwidth, matmul_size=round((square.flops / 2) ** (1 / 3)) if square else 0,
                    copy_bytes=read // 2, datasheet=datasheet_for(device, dtype), kernels=best)


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, quick: bool = False,
                     progress: Callable[[str], None] = lambda message: None) -> Ceilings:
    """Measure the peak and the bandwidth on `device` in `dtype` (see the module's docstring), with torch's threads
    as they are now; cached per process and thread count.

    `progress(message)` is called as each kernel's measurement starts."""
    device = torch.device(device)
    key = (str(device), str(dtype), quick, torch.get_num_threads())
    if key in _CEILINGS:
        return _CEILINGS[key]
    kernels = ceiling_kernels(device, dtype, quick)
    repeats = 5 if quick else 7
    times = {}
    for name, kernel in kernels.items():
        progress(f"{'peak FLOP/s' if kernel.roof == 'compute' else 'bandwidth'}: best of {repeats} "
                 f"(after 2 untimed) of {kernel.what}")
        times[name] = time_fn(kernel.fn, device, warmup=2, repeats=repeats).times_s
    result = ceilings_from(kernels, times, device, dtype)
    del kernels
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
