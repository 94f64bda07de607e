"""Where tensors live: the device and dtype a run asks for, and the few calls that touch a device directly.

Every other file names a device only through these, so that "CUDA if present, else the CPU" is
decided in one place:

    resolve_device("auto")  → cuda when available, else cpu
    resolve_dtype("auto")   → bf16 on CUDA (half the bytes of fp32, fp32's range), fp32 on a CPU
    to_device(list)         → a host list on the device without making the host wait (pinned memory)
    synchronize(device)     → wait for queued GPU work, which a timer must do before it reads the clock
    available_memory(device)→ what a new allocation could take: the KV pool's ceiling

and what a CPU is, for the kernels that run on it (`cpu_layout.py`) and the threads that run them:

    cpuinfo("flags")        → a field of /proc/cpuinfo (the ISA extensions: avx2, avx512_bf16, amx_bf16, ...)
    numpy_blas()            → the BLAS numpy links ("openblas"), whose thread pool is not torch's
    set_num_threads(n)      → n threads for torch's kernels and numpy's BLAS alike
    wait_policy()           → how idle threads wait, as `minillm.let_idle_threads_sleep` left it

The invariant its tests hold: an unknown or absent device or dtype is a ValueError that names it and
the choices, never a silent fallback.
"""
from __future__ import annotations

import math
import os
import platform

import numpy  # noqa: F401  loaded before threadpoolctl looks for numpy's BLAS
import torch

try:
    import threadpoolctl
except ImportError:  # a machine with fixed packages (the GPU one's): numpy's BLAS is then never chosen
    threadpoolctl = None

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" or None → CUDA when available, else CPU; anything else as torch spells it."""
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # meta, mps, xla, ...: not devices minillm runs on
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use 'cpu' or 'auto'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" or None → bf16 on CUDA (half the bytes, fp32's range), fp32 on CPU
    (where half-precision matmuls are slow or emulated)."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a tensor on `device`, without making the host wait.

    `torch.tensor(values, device="cuda")` copies from pageable memory, and such
    a copy waits for the GPU to finish everything queued before it: one hidden
    sync per tensor. Copied from pinned (page-locked) memory with
    non_blocking=True, it is queued behind that work instead, and the host goes on.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def synchronize(device: torch.device | str) -> None:
    """Wait until all queued work on `device` has finished (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def mem_available() -> int | None:
    """What the OS could give this process now without swapping (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def available_memory(device: torch.device) -> float:
    """Bytes a new allocation could take: CUDA's free memory; on the CPU, what Linux calls MemAvailable, else
    the total RAM (inf where the OS tells neither)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = mem_available()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return math.inf


# ---- the CPU and its threads ------------------------------------------------------------------------------------

def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("vendor_id", "model name", "flags"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def cpu_vendor() -> str:
    """The CPU's vendor string ("AuthenticAMD", "GenuineIntel"; on other systems what `platform` says)."""
    return cpuinfo("vendor_id") or platform.processor()


def numpy_blas() -> str:
    """Which BLAS numpy computes with ("openblas", "mkl", ...: threadpoolctl's name), "" if none it knows.

    (torch's MKL is linked into torch itself, where threadpoolctl does not look: the BLAS it finds is numpy's.
    Without threadpoolctl, "": its threads could not be sized, so the loader keeps torch's BLAS.)"""
    if threadpoolctl is None:
        return ""
    return next((lib["internal_api"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"), "")


def set_num_threads(n: int) -> None:
    """Threads for torch's kernels and for numpy's BLAS alike: a one-row product may run on either library."""
    torch.set_num_threads(n)
    if threadpoolctl is not None:
        threadpoolctl.threadpool_limits(n, user_api="blas")


def wait_policy() -> str:
    """How this process's OpenMP threads wait at a barrier: what OMP_WAIT_POLICY held as torch loaded."""
    value = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    if value == "PASSIVE":
        return "sleep at barriers (OMP_WAIT_POLICY=PASSIVE)"
    if value == "ACTIVE":
        return "spin at barriers (OMP_WAIT_POLICY=ACTIVE)"
    return "spin, then sleep, at barriers (OMP_WAIT_POLICY unset: the runtime's default)"


def openblas_threads_sleep() -> bool:
    """Whether numpy's OpenBLAS threads sleep as soon as they are idle: OPENBLAS_THREAD_TIMEOUT held 4 (its least,
    2⁴ cycles of spinning) as numpy loaded, as `minillm.let_idle_threads_sleep` sees to. By default they spin for
    2²⁸ cycles after each product, on the core torch's next kernel needs."""
    try:
        return int(os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")) <= 4
    except ValueError:
        return False
