"""The device's ceilings and the roofline: how close a timed step came to the hardware.

A speed figure on its own ("40 ms per token") says little. The same figure as a fraction of what the
device can do ("82% of the memory bandwidth") says whether there is anything left to win, and where.

The roofline. A step that does F FLOPs and moves B bytes cannot beat either limit:

    time ≥ max(F / peak, B / bandwidth)        so   F / time ≤ min(peak, I · bandwidth),   I = F / B

I is the step's arithmetic intensity (FLOP per byte). The *ridge*, peak ÷ bandwidth, is the intensity at
which both limits meet: a step left of it is memory-bound (time ≈ B / bandwidth), right of it compute-bound
(time ≈ F / peak).

The ceilings are measured on the device, in the model's dtype and weight format, in this process with the
threads torch and numpy have now (the engine's), each with the kernels the engine itself runs:

    peak        the fastest of: a large square torch.matmul, and the model's own product as the engine runs
                it for several rows (the module `cpu_layout` swaps in for this device and dtype: a oneDNN-packed
                copy where packing pays, F.linear over W elsewhere; on CUDA that is the plain matmul), at
                n × n × n, large enough to keep the units busy; on a CPU that product on one thread too (a
                busy core stalls a product on every thread at each barrier, and small products run on one);
                with int8 weights (`quantize.py`) also the int8 module's product (on a CPU: the weights
                widened to bf16, then a bf16 matmul).
    bandwidth   the fastest of the read streams over buffers far larger than any cache: a copy (read +
                write bytes counted), a sum and a matrix-vector product over the whole buffer (read only,
                on torch's threads), and the engine's one-row product (the kernel of a batch-1 decode: numpy's
                BLAS or F.linear over W, bf16's packed copy; int8's fused kernel) over a stack of weight
                matrices (their bytes as stored counted).

Each kernel is timed several times and its *best* repeat kept; each ceiling is its best kernel. A ceiling
is a maximum: load that slows some repeats lowers it only if it slows them all. Why that bounds our steps:
a step's products run these kernels, at shapes no friendlier than these, and everything else it does only
adds time; so its FLOP/s cannot beat the fastest product, nor its bytes/s the fastest read. Where a step
does beat one (a peer's kernel, a shape the kernels missed), `raised_to` raises the ceiling to the step's own
rate, names the step as the kernel that set it, and lists it in `raised`: the ceiling is at least what was
achieved, and a share is never printed above 100%. Datasheet figures, where known, are labelled and never
used to judge.

`achieved(cost, seconds, ceilings)` sets a timed step's analytic cost (`cost.py`) against them;
`ceilings_from(kernels, times)` makes ceilings from kernels timed elsewhere (a lesson times them in turns
with its steps). A new kernel (another dtype, another weight format) joins by a `Kernel` in `ceiling_kernels`.

Invariant held by the tests: on the tiny shapes, in fp32, bf16 and int8, every share of a ceiling that `bench`
or a lesson prints or plots is ≤ 100% with `raised` empty: the measured kernels alone bound the steps, so the
ceiling is measured, not raised or clamped; a ceiling measured with a deliberately slow kernel makes that
check fail. A step above a measured kernel is a gap in `ceiling_kernels`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from ..config import dtype_bytes
from ..device import set_num_threads
from .. import cpu_layout
from ..cpu_layout import linear_in_layout, numpy_blas_pays, packing_pays
from ..model import Conv1D
from ..quantize import MODULES, check_quantization
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
    quantization: str | None = None  # the weight format the kernels ran ("int8", "w8a8"; None: the dtype's own)
    raised: list = field(default_factory=list)  # names of steps that beat a measured kernel (`raised_to`)

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

    def raised_to(self, name: str, flops_per_s: float = 0.0, bytes_per_s: float = 0.0) -> "Ceilings":
        """These ceilings, with the peak raised to `flops_per_s` and the bandwidth to `bytes_per_s` where a step
        `name` achieved more than the measured kernels: the step joins `kernels` as the one that set that ceiling,
        and `raised`. Unchanged (the same object) where the kernels bound the step."""
        c = self
        for roof, rate, top in (("compute", flops_per_s, "matmul_flops"), ("memory", bytes_per_s, "bandwidth")):
            if rate > getattr(c, top):
                key = f"{name} ({roof})"
                c = replace(c, **{top: rate}, raised=[*c.raised, key], kernels={**c.kernels, key: {
                    "roof": roof, "rate": rate, "what": f"{name}, which beat every measured kernel: the ceiling "
                                                        "is at least what it achieved"}})
        return c

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


_CEILINGS: dict[tuple, Ceilings] = {}  # measured once per process and thread count


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


def ceiling_kernels(device: torch.device | str, dtype: torch.dtype, quick: bool = False,
                    quantization: str | None = None) -> dict[str, Kernel]:
    """The kernels that define the ceilings, each in `dtype` on `device`, the engine's products in its layout.

    compute: "matmul" (torch.matmul of two n × n matrices), "product" (n rows through the engine's projection
    module of an n × n W) and, on a CPU with several threads, "product, one thread"; memory: "copy", "sum" and "matrix-vector" over a buffer far larger than
    any cache, and "one-row product" (one row through a stack of the engine's [1024, 4096] projection modules,
    as large). With a quantization ("int8", "w8a8"), "int8 product" and "int8 one-row product" too: the same,
    through `quantize.py`'s module for it, the weights' bytes counted as stored (int8, with scales and biases).
    """
    check_quantization(quantization)
    device = torch.device(device)
    on_gpu, b, name = device.type == "cuda", dtype_bytes(dtype), str(dtype).removeprefix("torch.")
    n = (4096 if quick else 8192) if on_gpu else (1024 if quick else 2048)
    nbytes = (1 << 30 if on_gpu else 128 << 20) if quick else (2 << 30 if on_gpu else 256 << 20)
    layout = engine_layout(device, dtype)
    a, bm = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def module(shape, int8=False):  # drawn on the device itself: a CPU would take seconds to draw a GPU's gigabytes
        with torch.device(device):
            conv = Conv1D(*shape).to(dtype)
            return (MODULES[quantization][0].from_conv1d(conv) if int8 else
                    linear_in_layout(conv, layout["packed"], layout["numpy_one_row"]))
    src = torch.ones(nbytes // b, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    width, vector = (1024, 4096), torch.ones(4096, device=device, dtype=dtype)
    row = torch.randn(1, width[0], device=device).to(dtype)

    def products(int8: bool) -> tuple[Callable, Callable, int, int]:
        proj = module((n, n), int8)
        per = width[0] * width[1] * (1 if int8 else b)
        stack = [module(width, int8) for _ in range(max(1, nbytes // per))]
        stored = sum(t.nbytes for m in stack for t in (*m.buffers(), *m.parameters()) if t.dim() > 0)
        return (torch.inference_mode()(lambda: proj(a)), torch.inference_mode()(lambda: [m(row) for m in stack]),
                len(stack), stored)
    kind = "F.linear over W" if not layout["packed"] else "a oneDNN-packed copy of W"
    one = ("numpy's BLAS over W" if layout["numpy_one_row"] and dtype == torch.float32 else
           "a oneDNN-packed copy of W" if layout["packed"] and dtype == torch.bfloat16 else "F.linear over W")
    product, one_row, count, stack_bytes = products(int8=False)
    kernels = {
        "matmul": Kernel(lambda: torch.matmul(a, bm, out=out), 2 * n ** 3, 3 * n * n * b, "compute",
                         f"torch.matmul {n}×{n} @ {n}×{n} in {name}"),
        "product": Kernel(product, 2 * n ** 3, 3 * n * n * b, "compute",
                          f"the engine's projection, {n} rows × [{n}, {n}] via {kind}, in {name}"),
        "copy": Kernel(lambda: dst.copy_(src), 0, 2 * src.nbytes, "memory",
                       f"a copy of {src.nbytes >> 20} MiB, read + write counted"),
        "sum": Kernel(lambda: src.sum(), 0, src.nbytes, "memory", f"a sum of {src.nbytes >> 20} MiB, read only"),
        "matrix-vector": Kernel(lambda: src.view(-1, vector.numel()) @ vector, 0, src.nbytes, "memory",
                                f"a matrix-vector product over {src.nbytes >> 20} MiB, read only"),
        "one-row product": Kernel(one_row, 2 * stack_bytes // b, stack_bytes, "memory",
                                  f"one row through {count} [{width[0]}, {width[1]}] projections "
                                  f"({stack_bytes >> 20} MiB) via {one}")}
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:  # a busy core stalls every barrier of a product on all threads: one
        kernels["product, one thread"] = Kernel(on_one_thread(product, threads), 2 * n ** 3, 3 * n * n * b, "compute",
                                                "the engine's projection as above, on one thread")
    if quantization is not None:
        product, one_row, count, stack_bytes = products(int8=True)
        fused = ("int8 activations, torch._int_mm" if quantization == "w8a8" else
                 "torch's fused int8 kernel" if device.type == "cpu" else "F.linear over q widened")
        many = ("x rounded to int8, then torch._int_mm" if quantization == "w8a8" else
                f"q widened, then a {'bf16' if device.type == 'cpu' else name} matmul")
        kernels |= {
            "int8 product": Kernel(product, 2 * n ** 3, n * n * (2 * b + 1), "compute",
                                   f"the engine's {quantization} projection, {n} rows × [{n}, {n}] ({many})"),
            "int8 one-row product": Kernel(one_row, 2 * count * width[0] * width[1], stack_bytes, "memory",
                                           f"one row through {count} int8 [{width[0]}, {width[1]}] projections "
                                           f"({stack_bytes >> 20} MiB as stored) via {fused}")}
    return kernels


def on_one_thread(fn: Callable, threads: int) -> Callable:
    """`fn` run on one thread, then `threads` again (small products, and a machine whose other cores are busy,
    run that way)."""
    def run():
        set_num_threads(1)
        try:
            return fn()
        finally:
            set_num_threads(threads)
    return run


def ceilings_from(kernels: dict[str, Kernel], times: dict[str, list[float]], device: torch.device | str,
                  dtype: torch.dtype, quantization: str | None = None) -> Ceilings:
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
                    copy_bytes=read // 2, datasheet=datasheet_for(device, dtype), kernels=best,
                    quantization=quantization)


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, quick: bool = False,
                     progress: Callable[[str], None] = lambda message: None,
                     quantization: str | None = None) -> Ceilings:
    """Measure the peak and the bandwidth on `device` in `dtype`, with `quantization`'s weights too (see the
    module's docstring), with torch's threads as they are now; cached per process and thread count.

    `progress(message)` is called as each kernel's measurement starts."""
    device = torch.device(device)
    key = (str(device), str(dtype), quick, torch.get_num_threads(), quantization)
    if key in _CEILINGS:
        return _CEILINGS[key]
    kernels = ceiling_kernels(device, dtype, quick, quantization)
    repeats = 5 if quick else 7
    times = {}
    for name, kernel in kernels.items():
        progress(f"{'peak FLOP/s' if kernel.roof == 'compute' else 'bandwidth'}: best of {repeats} "
                 f"(after 2 untimed) of {kernel.what}")
        times[name] = time_fn(kernel.fn, device, warmup=2, repeats=repeats).times_s
    result = ceilings_from(kernels, times, device, dtype, quantization)
    del kernels
    _CEILINGS[key] = result
    return result


def raised_for_steps(ceilings: Ceilings, steps: dict[str, tuple[StepCost, float]]) -> Ceilings:
    """`ceilings` raised (`Ceilings.raised_to`) to each step's FLOP/s and bytes/s where it beat the measured kernels;
    `steps[name]` = (its cost, its fastest time in seconds)."""
    for name, (cost, seconds) in steps.items():
        ceilings = ceilings.raised_to(name, cost.flops / seconds, cost.bytes / seconds)
    return ceilings


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
