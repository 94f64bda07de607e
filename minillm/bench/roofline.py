"""The device's ceilings and the roofline: how close a timed step came to the hardware.

A speed figure on its own ("40 ms per token") says little. The same figure as a
fraction of what the device can do ("82% of the memory bandwidth") says whether
there is anything left to win, and where.

    Measured on the device itself, in the working dtype: matmul FLOP/s from a
    large square matmul, memory bandwidth from a large copy (read + write bytes
    counted), and their ratio, the *ridge point* in FLOP/byte. A step whose
    intensity lies left of the ridge is memory-bound (time ≈ bytes / bandwidth),
    right of it compute-bound (time ≈ FLOPs / FLOP/s). Datasheet figures, where
    known, are reported beside them and labelled as datasheet.

`achieved(cost, seconds, ceilings)` sets a timed step's analytic cost
(`cost.py`) against them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..config import dtype_bytes
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


_CEILINGS: dict[tuple[str, str, bool], Ceilings] = {}  # measured once per process


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
