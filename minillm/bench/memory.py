"""Memory: what a device holds, what it could still give, and what a process owns.

On CUDA the allocator's own statistics answer (allocated now, peak since a
reset, reserved). On the CPU there is no such allocator to ask: the OS's count
of the pages a process holds (`resident_bytes`) is the measurement, and the
bytes that the weights and the caches own are *accounted* bytes, labelled as
such. `mem_available` is the one reader of Linux's MemAvailable.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from ..config import dtype_bytes
from ..device import mem_available


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


def layout_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copies a CPU weight layout keeps beside the weights (`cpu_layout.py`): the head's [C, V]
    copy and each oneDNN-packed copy, each as large as the matrix it copies."""
    head = getattr(model, "lm_head", None)
    head_t = getattr(head, "wte_t", None)
    total = head_t.nbytes if head_t is not None else 0
    if getattr(head, "packed", None) is not None:
        total += model.wte.weight.nbytes
    return total + sum(m.weight.nbytes for m in model.modules() if getattr(m, "packed", None) is not None
                       and m is not head)


def layout_copy_bytes_of(config, dtype: torch.dtype, head_copy: bool, packed: bool) -> int:
    """`layout_copy_bytes` of a model of this shape, without building it: the head's [C, V] copy (V·C), and with
    packed copies one more of the head and of every block projection (c_attn 3C², c_proj C², c_fc 4C², the
    MLP's c_proj 4C²: 12·C² a layer)."""
    head = config.vocab_size * config.n_embd * dtype_bytes(dtype)
    blocks = 12 * config.n_layer * config.n_embd ** 2 * dtype_bytes(dtype)
    return head * head_copy + (head + blocks) * packed


def accounted_memory(model: torch.nn.Module | None = None, caches: Sequence = ()) -> dict:
    """Bytes the weights, their layout's copies and the caches own; on the CPU this stands in for a measurement."""
    weights = sum(t.nbytes for t in model.state_dict().values()) if model is not None else 0  # int8 ones too
    copies = layout_copy_bytes(model) if model is not None else 0
    kv = sum(c.nbytes for c in caches)
    return {"weights": weights, "layout_copies": copies, "kv_cache": kv, "total": weights + copies + kv,
            "kind": "accounted"}


def memory_budget(device: torch.device | str) -> dict:
    """The memory a device offers: CUDA's total, or the machine's RAM on the CPU (a stated budget)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"bytes": total, "free_bytes": free, "source": "torch.cuda.mem_get_info total"}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"bytes": total, "free_bytes": mem_available(),
            "source": "stated budget: total RAM from os.sysconf (shared with the OS and other processes)"}


def release_free_memory() -> None:
    """Hand the pages that the C allocator holds free back to the OS (glibc's `malloc_trim(0)`), so that the
    resident set counts only memory in use. Without it a new tensor may be carved from an arena left large by
    earlier, freed ones: its pages are resident already, and filling it moves `resident_bytes` by nothing.
    Where the C library has no `malloc_trim` (not glibc) it does nothing."""
    import ctypes
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory as the OS counts it (Linux's /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None
