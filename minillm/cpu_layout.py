"""Kernels for a CPU, swapped into a loaded model: the same products, read from copies laid out for the kernel
that runs them.

`model.py` is GPT-2 as written: each projection is `F.linear` over W as stored, the head `F.linear` over wte,
attention torch's fused kernel. Once the weights are final, `choose_layout` (the loader calls it) replaces
modules, as gpt-fast's quantize.py does, and leaves that file alone:

    setattr(block.mlp, "c_fc", CPUConv1D(...))   each Conv1D: its own W and b, plus a packed copy, or numpy
    model.lm_head = CPULMHead(...)                the tied head: a [C, V] copy of wte, a packed copy, or numpy

Which kernel serves a product depends on its rows. One row (a batch-1 decode) is a matrix-vector product that
streams each weight once, at the bandwidth: W as stored, or the head's contiguous [C, V] copy; on an AMD CPU in
fp32 through numpy's OpenBLAS, which streams fp32 faster than torch's MKL there (`numpy_blas_pays`). Several
rows (a batch of decodes, a verification pass, a prefill chunk) are a matmul, served by a oneDNN-packed copy
(oneDNN's blocked layout: what torch.compile's CPU weight prepacking makes). In bf16, on a CPU that multiplies
bf16 in hardware (AVX512_BF16 or AMX, `native_bf16`), the packed copies serve every row count and the head needs
no [C, V] copy; elsewhere bf16 stays on F.linear (`packing_pays`).

Attention: every cache ends in `model.causal_attention` (their exercise regions call it by name), which calls
the kernel named `model.scaled_dot_product_attention`. On a CPU with AVX512_BF16 but no AMX, torch's fused
kernel is the slow one for one bf16 query per row, so `use_decode_attention_by_hand` puts
`attention_with_decode_by_hand` in its place: the same call, with one query per row in bf16 on the CPU computed
by `decode_attention` in fp32. The swap is process-wide, as the CPU is; the seam `cache.attend(layer, q, k, v)`
does not change.

What it costs: memory, one more copy per layout, made from the weights as they are (V·C·bytes for the head's
[C, V] copy; V·C·bytes + 12·n_layer·C²·bytes for the packed copies); bytes read per step, none more (a step
reads one copy of each matrix). Whoever changes the weights afterwards lays the model out again. A packed copy
is never saved, never moved by `.to()` (a product on another device or dtype falls back to W), and cloned by a
deep copy; the head's [C, V] copy is a buffer `.to()` moves and casts, never saved.

Invariants held by the tests: every layout gives the plain model's logits (fp32: 1e-5; bf16 within its
tolerance), in the model, the engine and against transformers' reference; state_dict is the plain model's;
where nothing pays (a GPU) the modules stay model.py's. The measurements behind each choice, with the commands
that made them: docs/cpu_kernels.md.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

from . import model as gpt2_module
from .device import cpu_vendor, cpuinfo, numpy_blas, openblas_threads_sleep
from .model import GPT2, Conv1D, LMHead

# ---- which kernel serves a product ---------------------------------------------------------------------------


def onednn_pack(weight_out_in: torch.Tensor) -> torch.Tensor:
    """A copy of W [out, in] reordered once into oneDNN's blocked layout (tuned for 16 rows). `serves_packed`
    says which products it computes."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.detach().contiguous(), 16)


def serves_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a packed copy computes this product: inference on the CPU in the copy's dtype, for several rows,
    or for one in bf16 (where oneDNN's kernel streams the copy faster than any other; fp32's one row reads W)."""
    return (packed is not None and not torch.is_grad_enabled() and x.device.type == "cpu"
            and x.dtype == packed.dtype and (x.numel() > x.shape[-1] or x.dtype == torch.bfloat16))


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


class KeepsPackedCopy:
    """A deep copy clones the packed copy whole (oneDNN's opaque tensor has no storage to copy element-wise)."""

    def __deepcopy__(self, memo):
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        if self.packed is not None:
            memo[id(self.packed)] = self.packed.clone()
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin


class CPUConv1D(KeepsPackedCopy, Conv1D):
    """A Conv1D with the same W and b, computing y = x·W + b with the kernel that serves x's rows: the packed copy
    (`serves_packed`), numpy's BLAS over W for one row (`serves_one_row`), else F.linear over W as Conv1D does."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter, packed: torch.Tensor | None,
                 numpy_one_row: bool):
        with torch.device("meta"):  # Conv1D's own init would draw a W: this module takes the loaded one's
            super().__init__(*weight.shape)
        self.weight, self.bias = weight, bias
        self.packed, self.numpy_one_row = packed, numpy_one_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if serves_packed(x, self.packed):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.numpy_one_row and serves_one_row(x):
            return numpy_product(x, self.weight, self.bias)
        return super().forward(x)


class CPULMHead(KeepsPackedCopy, LMHead):
    """The tied head, logits = x·wteᵀ, from the packed copy of wte where it serves, else from its [C, V] copy
    (`x @ wte_t`, one row through numpy's BLAS if chosen), else from wte itself as LMHead does."""

    def __init__(self, wte_t: torch.Tensor | None, packed: torch.Tensor | None, numpy_one_row: bool):
        super().__init__()
        self.register_buffer("wte_t", wte_t, persistent=False)
        self.packed, self.numpy_one_row = packed, numpy_one_row

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        if serves_packed(x, self.packed):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.numpy_one_row and serves_one_row(x):
            return numpy_product(x, wte.t() if self.wte_t is None else self.wte_t)
        return super().forward(x, wte) if self.wte_t is None else x @ self.wte_t


# ---- the swap -------------------------------------------------------------------------------------------------


def linear_in_layout(conv: Conv1D, packed: bool | None = None, numpy_one_row: bool | None = None) -> Conv1D:
    """`conv`'s W and b in a module for this layout: a packed copy made now (packed=True) or none (False), one row
    through numpy or not; None keeps what `conv` has. With neither, a plain Conv1D."""
    copy_ = getattr(conv, "packed", None) if packed is None else onednn_pack(conv.weight.t()) if packed else None
    numpy_ = getattr(conv, "numpy_one_row", False) if numpy_one_row is None else numpy_one_row
    if copy_ is not None or numpy_:
        return CPUConv1D(conv.weight, conv.bias, copy_, numpy_)
    if type(conv) is Conv1D:
        return conv
    with torch.device("meta"):
        plain = Conv1D(*conv.weight.shape)
    plain.weight, plain.bias = conv.weight, conv.bias
    return plain


def head_in_layout(head: LMHead, wte: torch.Tensor, head_copy: bool | None = None, packed: bool | None = None,
                   numpy_one_row: bool | None = None) -> LMHead:
    """The head for this layout, as `linear_in_layout` does for a Conv1D; `head_copy`: a [C, V] copy of wte."""
    wte = wte.detach()
    copy_t = getattr(head, "wte_t", None) if head_copy is None else wte.t().contiguous() if head_copy else None
    copy_ = getattr(head, "packed", None) if packed is None else onednn_pack(wte) if packed else None
    numpy_ = getattr(head, "numpy_one_row", False) if numpy_one_row is None else numpy_one_row
    return CPULMHead(copy_t, copy_, numpy_) if copy_t is not None or copy_ is not None or numpy_ else LMHead()


@torch.no_grad()
def lay_out(model: GPT2, head_copy: bool | None = None, packed: bool | None = None,
            numpy_one_row: bool | None = None) -> GPT2:
    """Swap every Conv1D and the head for its module in this layout (True: a copy made now from the weights as
    they are; False: none; None: keep what the model has). Everything False puts model.py's modules back."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                setattr(parent, name, linear_in_layout(child, packed, numpy_one_row))
    if isinstance(model.lm_head, LMHead):  # another file's head (quantize.py's int8 copy) is left as it is
        model.lm_head = head_in_layout(model.lm_head, model.wte.weight, head_copy, packed, numpy_one_row)
    return model


def layout_of(model: GPT2) -> dict:
    """What `lay_out` gave this model: {"head_copy", "packed", "numpy_one_row"}."""
    head, fc = model.lm_head, model.h[0].mlp.c_fc
    return {"head_copy": getattr(head, "wte_t", None) is not None, "packed": getattr(fc, "packed", None) is not None,
            "numpy_one_row": getattr(fc, "numpy_one_row", False)}


# ---- what this CPU pays for -------------------------------------------------------------------------------------


def native_bf16(flags: str) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags multiplies bf16 in hardware (AVX512_BF16's dot products, or
    AMX's tiles), as vLLM's CPU backend requires before it defaults to bf16; elsewhere bf16 is converted."""
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def bf16_decode_by_hand_pays(flags: str) -> bool:
    """Whether one bf16 query per row attends faster written out in fp32 (`decode_attention`) than through
    torch's fused kernel on a CPU with these flags: where it has AVX512_BF16 but no AMX. With AMX the fused
    kernel runs bf16 tiles and wins; without, it converts block by block and loses. Elsewhere bf16 is emulated
    and the fused kernel is kept, as torch ships it."""
    flags = set(flags.split())
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def packing_pays(device: torch.device, dtype: torch.dtype, flags: str) -> bool:
    """Whether oneDNN-packed copies pay: on a CPU, in fp32, or in bf16 where the CPU computes it natively."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or dtype == torch.bfloat16 and native_bf16(flags)))


def numpy_blas_pays(device: torch.device, dtype: torch.dtype, vendor: str, blas: str, threads_sleep: bool) -> bool:
    """Whether one-row products should go through numpy's BLAS: fp32 on an AMD CPU, where numpy links OpenBLAS
    whose idle threads sleep (`device.openblas_threads_sleep`); on Intel's, MKL streams as fast."""
    return (device.type == "cpu" and dtype == torch.float32 and vendor == "AuthenticAMD" and blas == "openblas"
            and threads_sleep)


NUMPY_LOADED_FIRST = (
    "numpy's OpenBLAS was loaded before minillm (`import torch` loads it), so its idle threads spin and one-row "
    "products stay on torch's BLAS, which streams fp32 more slowly on this AMD CPU (and torch's OpenMP threads spin "
    "at barriers, which a busy machine pays at every kernel): every step at batch 1, the engine's most, is slower "
    "than `python -m minillm bench` times. Import minillm before torch and numpy, or set OMP_WAIT_POLICY=PASSIVE "
    "and OPENBLAS_THREAD_TIMEOUT=4 in the environment (docs/bench.md: the engine's step against the forward step)")


def choose_layout(model: GPT2, numpy_one_row: bool | None = None, packed: bool | None = None) -> GPT2:
    """Lay the model out for its device, once the weights are final (the loader calls it), and choose this CPU's
    attention kernel (`use_decode_attention_by_hand`).

    On a CPU: packed copies where `packing_pays`; the head's [C, V] copy, unless bf16's packed copy serves every
    row; one row through numpy's BLAS where `numpy_blas_pays`. On a GPU cuBLAS reads either layout at the same
    speed: model.py's modules. `numpy_one_row` and `packed` override this machine's answers. Where numpy's BLAS
    would pay but its threads spin (numpy loaded before minillm), a RuntimeWarning says so and how to import."""
    on_cpu, flags = model.device.type == "cpu", cpuinfo("flags")
    packs = packing_pays(model.device, model.dtype, flags) if packed is None else packed
    if numpy_one_row is None:
        vendor, blas, sleeps = cpu_vendor(), numpy_blas(), openblas_threads_sleep()
        numpy_one_row = numpy_blas_pays(model.device, model.dtype, vendor, blas, sleeps)
        if not sleeps and numpy_blas_pays(model.device, model.dtype, vendor, blas, True) and \
                isinstance(model.h[0].mlp.c_fc, Conv1D):  # int8's modules (quantize.py) never take numpy's BLAS
            warnings.warn(NUMPY_LOADED_FIRST, RuntimeWarning, stacklevel=2)
    use_decode_attention_by_hand(bf16_decode_by_hand_pays(flags))
    return lay_out(model, head_copy=on_cpu and not (packs and model.dtype == torch.bfloat16), packed=packs,
                   numpy_one_row=numpy_one_row)


# ---- attention, one bf16 query per row --------------------------------------------------------------------------


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_attention` for one query per row, (B, H, 1, D), which sees every key its mask allows: the scores
    as one batched matmul, their softmax, and the weighted values as another, in fp32 whatever q's dtype (as
    the fused kernel accumulates: scores rounded to bf16 would err several times as much), the output in q's.

    `mask` is boolean, True where a key is seen, as every cache builds it, and each row sees at least its own
    key (a row that saw none would give NaN here where the fused kernel gives zeros). More than one query per
    row is refused: no causal triangle is applied here."""
    if q.shape[-2] != 1:
        raise ValueError(f"decode_attention takes one query per row, q of shape (B, H, 1, D), not "
                         f"{tuple(q.shape)}; use model.causal_attention for several")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"decode_attention takes a boolean mask (True: the key is seen), not {mask.dtype}")
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, 1, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def attention_with_decode_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, with one bf16 query per row on the CPU computed by `decode_attention`."""
    if q.shape[-2] == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return decode_attention(q, k, v, attn_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def use_decode_attention_by_hand(on: bool) -> None:
    """Put `attention_with_decode_by_hand` behind `model.causal_attention` (on), or torch's fused kernel (off)."""
    gpt2_module.scaled_dot_product_attention = attention_with_decode_by_hand if on else F.scaled_dot_product_attention


# ---- what is in use ---------------------------------------------------------------------------------------------


def numpy_serves(model: GPT2) -> bool:
    """Whether numpy's BLAS computes this model's one-row products: chosen, and fp32 on the CPU."""
    return layout_of(model)["numpy_one_row"] and model.device.type == "cpu" and model.dtype == torch.float32


def lm_head_layout(model: GPT2) -> str:
    if not isinstance(model.lm_head, LMHead):
        return f"{type(model.lm_head).__name__} ({model.lm_head.extra_repr()})"
    packed = getattr(model.lm_head, "packed", None)
    if packed is not None and packed.dtype == torch.bfloat16:
        return "a oneDNN-packed copy of wte, for every row count"
    layout = "a [C, V] copy of wte via x @ W" if layout_of(model)["head_copy"] else "tied wte [V, C] via F.linear"
    return layout + (", numpy's BLAS for one row" if numpy_serves(model) else "")


def linears_layout(model: GPT2) -> str:
    if not isinstance(model.h[0].mlp.c_fc, Conv1D):
        return f"{type(model.h[0].mlp.c_fc).__name__} ({model.h[0].mlp.c_fc.extra_repr()})"
    one_row = "numpy" if numpy_serves(model) else "F.linear"
    packed = getattr(model.h[0].mlp.c_fc, "packed", None)
    if packed is not None and packed.dtype == torch.bfloat16:
        return "a oneDNN-packed copy of W for every row count (LM head too)"
    if packed is not None:
        return f"W [in, out] via {one_row} for one row, a oneDNN-packed copy for several (LM head too)"
    return "W [in, out] via numpy for one row, F.linear for several" if numpy_serves(model) else \
        "W [in, out] as stored, via F.linear"


def attention_layout(model: GPT2) -> str:
    if (model.device.type == "cpu" and model.dtype == torch.bfloat16
            and gpt2_module.scaled_dot_product_attention is attention_with_decode_by_hand):
        return "torch's fused kernel, one query per row written out in fp32 (decode_attention)"
    return "torch's fused kernel (scaled_dot_product_attention)"


def kernels(model: GPT2) -> str:
    """The kernel path every step of this model takes, in one line."""
    return (f"LM head {lm_head_layout(model)}; block projections {linears_layout(model)}; "
            f"attention {attention_layout(model)}")
