"""Weight layouts for a CPU, chosen once the weights are in: the same products, read from copies laid out for
the kernel that runs them.

The model keeps the copies (`GPT2.use_lm_head_copy`, `GPT2.pack_linears`),
made from the weights as they are: whoever loads or changes the weights makes
them afterwards (`checkpoints.load.choose_layout`); `lm_head_layout` and
`linears_layout` name the layout in use.

Which kernel runs a product depends on its rows: one row (a batch-1 decode) is
a matrix-vector product that streams each weight once, at the bandwidth;
several rows (a batch of decodes, a verification pass, a prefill chunk) are a
matmul. On the 2-core AVX2 EPYC (one thread, others' load 4 to 5):

    LM head, 1 row      F.linear(h, wte) 26.9 ms, h @ [C, V] copy 20.8 ms, oneDNN packed 31.3 ms
    LM head, 16 rows    126 ms, 104 ms, 61 ms
    12 × c_fc, 1 row    MKL over W 10.4 ms, oneDNN packed 18.2 ms
    12 × c_fc, 16 rows  119 ms, 65 ms

so each product keeps what serves it: the head's [C, V] copy and each W for one
row, the packed copies for several. Cost in memory: one more copy of each
matrix per layout (gpt2 fp32: 154 MB per head copy, 340 MB for the packed
blocks); in bytes read per step: none, a step reads one copy of each.
A packed copy is oneDNN's opaque blocked layout (what torch.compile's CPU
weight prepacking makes): it is never saved, never moved by `.to()` (a product
on another device or dtype falls back to W), and a deep copy of its module
makes its own. Invariant held by the tests: every layout gives W's logits
(fp32: 1e-5), in the model, the engine and against transformers' reference.

Which library streams one row also depends on the CPU. torch's BLAS is
Intel's MKL, whose matrix-vector kernel reads fp32 weights near the bandwidth
on Intel chips and well below it on AMD's; numpy's wheels link OpenBLAS, whose
Zen kernels do not. The 12 layers' four projections of gpt2 (340 MB), one row,
two threads, on the 2-core EPYC (Zen 3, AVX2):

    torch (MKL)          22–25 ms    14–15 GB/s
    numpy (OpenBLAS)     15–16 ms    21–23 GB/s     (a read-only stream: 25 GB/s)

So on an AMD CPU in fp32 the loader sends every one-row product (a batch-1
decode's) through numpy's BLAS (`GPT2.use_numpy_blas`), as CTranslate2 keeps
MKL for Intel's. numpy computes on the tensors' own memory: no copy, and a
change made to W in place is seen. `python -m minillm bench --blas-check`
times the batch-1 step both ways in turns; on that EPYC, quiet, torch's took
1.13× numpy's (1.05–1.35, 7 rounds), and the step came to 1.08× the
weight-read floor (1.71–1.77× through MKL, before).

OpenBLAS brings a thread pool of its own, beside torch's OpenMP one, and two
things follow. `set_num_threads` sizes both, from the cores found free. And
its idle threads must sleep: by default they spin for 2²⁸ cycles after each
product, on the core torch's next kernel needs (a batch-4 step right after a
one-row one took 89.5 ms against 47.2), so importing minillm before torch
(whose import loads numpy) sets
OPENBLAS_THREAD_TIMEOUT to its least, and the loader keeps torch's BLAS where
it was not (`openblas_threads_sleep`). The price that remains: OpenBLAS's two
threads wait for each other at the end of a product, so a core another process
takes after the threads were counted slows this path where MKL's holds
(beside a busy loop the step took 49.1 ms against torch's 35.9; on one thread,
which counting the free cores first gives, the two ran even: 0.95–1.17). Where the load
comes and goes, `--threads 1` avoids that.

bf16 (`--dtype bf16`, as vLLM's CPU backend defaults to) halves the bytes a
step reads, and pays only where the CPU multiplies bf16 in hardware
(`native_bf16`: AVX512_BF16 or AMX); elsewhere each product converts. There
oneDNN's packed bf16 copies serve every product, one row included, and the head
needs no [C, V] copy (`packing_pays`). The 12 layers' projections, two threads
(OMP_WAIT_POLICY unset: they spin a while at barriers), on a 2-core Xeon
(AMX; Sapphire Rapids or later):

    1 row       F.linear 15.9 ms, packed 8.1 ms   (fp32: MKL 12.2 ms)
    16 rows     15.5 ms, 8.7 ms                   (fp32: packed 22.6 ms)
    LM head     1 row 3.8 ms (x @ W) against 1.7 packed; 16 rows 3.7 against 1.9

and on the 2-core EPYC (Zen 4, AVX512_BF16, no AMX): 1 row 15.8 → 11.5 ms, 16
rows 23.8 → 13.3 ms. oneDNN refuses to pack bf16 on a CPU without AVX-512
("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and
avx512dq"), so no test can take this path on an AVX2 machine; on the Xeon the
engine's logits in it stay within the bf16 tolerance of tests/test_engine.py.
Attention in bf16 is torch's fused kernel, except one query per row on a CPU
with AVX512_BF16 and no AMX (`bf16_decode_by_hand_pays`, model.py).
"""
from __future__ import annotations

import copy
import os
import platform

import numpy  # noqa: F401  loaded before threadpoolctl looks for numpy's BLAS
import torch
import torch.nn as nn

try:
    import threadpoolctl
except ImportError:  # a machine with fixed packages (the GPU one's): numpy's BLAS is then never chosen
    threadpoolctl = None


def onednn_pack(weight_out_in: torch.Tensor) -> torch.Tensor:
    """A copy of W [out, in] reordered once into oneDNN's blocked layout (tuned for 16 rows; what torch.compile's
    CPU weight prepacking makes). `serves_packed` says which products it computes."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.contiguous(), 16)


def deepcopy_repacking(module: nn.Module, memo: dict, name: str, repack) -> nn.Module:
    """copy.deepcopy for a module holding a oneDNN copy in attribute `name` (opaque: it cannot be copied): copy
    the rest, then make the twin's own copy from its own weights, `repack(twin)`."""
    twin = module.__class__.__new__(module.__class__)
    memo[id(module)] = twin
    twin.__dict__.update({k: None if k == name else copy.deepcopy(v, memo) for k, v in module.__dict__.items()})
    if getattr(module, name) is not None:
        setattr(twin, name, repack(twin))
    return twin


def serves_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a packed copy computes this product: inference on the CPU in the copy's dtype, for several rows,
    or for one in bf16 (where oneDNN's kernel streams the copy faster than any other; fp32's one row reads W)."""
    return (packed is not None and not torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == packed.dtype and (x.numel() > x.shape[-1] or x.dtype == torch.bfloat16))


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


def native_bf16(flags: str) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags multiplies bf16 in hardware (AVX512_BF16's dot products, or
    AMX's tiles), as vLLM's CPU backend requires before it defaults to bf16; elsewhere bf16 is converted."""
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def bf16_decode_by_hand_pays(flags: str) -> bool:
    """Whether one bf16 query per row attends faster written out in fp32 (`model.decode_attention`) than through
    torch's fused kernel on a CPU with these flags: where it has AVX512_BF16 but no AMX. With AMX the fused
    kernel runs bf16 tiles and wins (a Xeon with AMX: 16 rows × 12 heads over 129 keys, 0.30 ms against
    7.4 written out); without, it converts block by block and loses (EPYC, Zen 4: 1.71 ms against 0.42).
    Elsewhere bf16 is emulated and the fused kernel is kept, as torch ships it."""
    flags = set(flags.split())
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def packing_pays(device: torch.device, dtype: torch.dtype, flags: str) -> bool:
    """Whether the loader keeps oneDNN-packed copies (`GPT2.pack_linears`): on a CPU, in fp32, or in bf16 where
    the CPU computes it natively (`native_bf16`); the figures are in this module's docstring."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or dtype == torch.bfloat16 and native_bf16(flags)))


def numpy_blas() -> str:
    """Which BLAS numpy computes with ("openblas", "mkl", ...: threadpoolctl's name), "" if none it knows.

    (torch's MKL is linked into torch itself, where threadpoolctl does not look: the BLAS it finds is numpy's.
    Without threadpoolctl, "": its threads could not be sized, so the loader keeps torch's BLAS.)"""
    if threadpoolctl is None:
        return ""
    return next((lib["internal_api"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"), "")


def openblas_threads_sleep() -> bool:
    """Whether numpy's OpenBLAS threads sleep as soon as they are idle: OPENBLAS_THREAD_TIMEOUT held 4 (its least,
    2⁴ cycles of spinning) as numpy loaded, which importing minillm before torch (it loads numpy) sees to. By default they spin
    for 2²⁸ cycles (~0.1 s) after each product, on the core torch's next kernel needs."""
    try:
        return int(os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")) <= 4
    except ValueError:
        return False


def numpy_blas_pays(device: torch.device, dtype: torch.dtype, vendor: str, blas: str, threads_sleep: bool) -> bool:
    """Whether one-row products should go through numpy's BLAS: fp32 on an AMD CPU, where numpy links OpenBLAS
    whose idle threads sleep (the measurements are in this module's docstring; on Intel MKL streams as fast)."""
    return (device.type == "cpu" and dtype == torch.float32 and vendor == "AuthenticAMD" and blas == "openblas"
            and threads_sleep)


def serves_one_row(x: torch.Tensor) -> bool:
    """Whether numpy's BLAS can compute this product: one row, inference, fp32 on the CPU."""
    return (x.numel() == x.shape[-1] and not torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == torch.float32)


def numpy_product(x: torch.Tensor, weight_in_out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·W (+ b) for one row x [..., in] and W [in, out], computed by numpy's BLAS on the tensors' own memory."""
    y = torch.from_numpy(x.detach().reshape(1, -1).numpy() @ weight_in_out.detach().numpy())
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], -1)


def set_num_threads(n: int) -> None:
    """Threads for torch's kernels and for numpy's BLAS alike: a one-row product may run on either library."""
    torch.set_num_threads(n)
    if threadpoolctl is not None:
        threadpoolctl.threadpool_limits(n, user_api="blas")
