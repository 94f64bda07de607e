"""Fewer bytes per token: int8 weights (and with `w8a8`, int8 activations), swapped into a loaded model.

A decode step reads every weight once to push one token per sequence through the model: about 2 FLOPs per
weight read, far left of any device's ridge point, so its time is the bytes it reads ÷ the bandwidth. The one
lever that follows is to read fewer bytes per weight. Weight-only int8 stores each projection as int8 with one
floating scale per output channel, and widens the weights back to the activations' precision inside the product:

    scale_o = max_i |W[o, i]| / 127              one per output channel (row of W [out, in]), symmetric
    q[o, i] = round(W[o, i] / scale_o)           round half to even, clamped to [-127, 127], stored int8
    y       = x · (q · scale)ᵀ + b               = (x · qᵀ) · scale + b: the scale leaves the sum

Per channel, not per tensor: one scale for the whole matrix would let its largest row set the step size of every
row, and a row of small weights would round to a few levels, or to zero. With one scale per row each row uses
all 255 levels, and its error per element is at most scale_o / 2.

What it costs, in bytes a decode step reads (L layers, width C, vocabulary V, b bytes per element otherwise):

    int8:   (12·L·C² + V·C) · 1  +  (9·L·C + V) · 4         the weights, and one fp32 scale per row
    fp32:   (12·L·C² + V·C) · 4          bf16: · 2           (biases and LayerNorms, ~13·L·C·b, in both)

so about a quarter of fp32's bytes and half of bf16's: the floor under a memory-bound step falls by that ratio
(`bench` prints a step beside the floor for the bytes it reads; how close it comes is the kernel's business,
below). As the batch grows a step turns compute-bound and the saving fades: the FLOPs are the same, and
each int8 weight must still be widened before it is multiplied. Prefill is compute-bound from the start, and
most CPUs have no instruction that multiplies int8 weights by floating activations: the weights are widened to a
floating dtype (a transient copy of each matrix; bf16 on a CPU, below) and multiplied there, so prefill pays the
widening and gains nothing. What it costs in accuracy is the rounding above; the tests bound it in logits.

Which kernel computes the product (`int8_product`). On a CPU, whatever the model's dtype, a product takes the
activations rounded to bf16, sums in fp32, and rounds its output to bf16; one fp32 epilogue then multiplies it
by the scales and adds the bias (`addcmul`, one pass over the output, rounded once to the model's dtype).
Up to `FUSED_MAX_ROWS` rows (decode steps) go through torch's fused `_weight_int8pack_mm`, which reads the int8
weights once and widens them in registers; it vectorises for bf16 activations only (in fp32 it is a scalar
loop, slower than fp32's own product), and takes `in` 16 at a time (every GPT-2 width; other widths take the
matmul). More rows (prefill) go through a bf16 matmul over q widened to bf16: the same numbers up to the order
of the sums, so a row's logits do not depend on how many rows share its step. The two bf16 roundings err about
a third as much as the weights' own; the tests bound the total. On a CPU without bf16 instructions that matmul
is emulated, and prefill in int8 is slower than in fp32. On any other device (a GPU, where gpt-fast leaves the
fusion to torch.compile) the product widens q to the activations' dtype, `F.linear(x, q.to(x.dtype))` as
gpt-fast writes it, and the same fp32 epilogue follows.

The tied head. vLLM and gpt-fast keep embeddings in full precision, and so does this file: `wte` stays as it is
for the lookup, which reads only one row per token. But the head, logits = x·wteᵀ, is the largest matmul in
GPT-2 (V·C = 38.6M of gpt2's 124M weights) and a decode step reads all of it, so the head gets an int8 copy of its
own (V·C bytes more memory), and reads that. The model then holds wte, wpe and the LayerNorms in its dtype,
every projection and the head in int8 with fp32 scales.

The swap, as gpt-fast's quantize.py does it and `cpu_layout.py` does for a CPU's layouts: once the weights are
in, `quantize(model, "int8")` replaces each `Conv1D` with a `WeightOnlyInt8Linear` (W transposed to [out, in],
the layout the fused kernel reads) and the `LMHead` with a `WeightOnlyInt8LMHead`; model.py stays as written,
and `cpu_layout.lay_out` lays out only the modules that are still model.py's. The knob is vLLM's
`--quantization`. vLLM has no plain `int8` value: its closest methods are a `compressed-tensors` checkpoint with
8-bit weights and 16-bit activations (W8A16, made offline by llm-compressor), and `experts_int8`, which
quantizes MoE expert weights to per-channel int8 as they load; here every projection is, with no calibration.

state_dict of a quantized model: each projection's `weight` (int8 [out, in]), `scales` (fp32 [out]) and `bias`,
`lm_head.weight` (int8 [V, C]) and `lm_head.scales`, and the rest as the plain model's. It loads into a model
quantized either way, int8 or w8a8: the method is the modules' class, not the state_dict (strict: a plain
state_dict lacks the scales and is refused); the checkpoint format is the plain model's, so `save_pretrained`
refuses a quantized model.

Int8 activations too (`--quantization w8a8`). Widening an int8 weight costs the product a conversion per
weight before each multiply-add, so on a CPU core weight-only int8 can run out of arithmetic before it runs out
of bandwidth, and its time grows with the rows (docs/quantize.md measures where). llama.cpp's Q8_0 and
CTranslate2's int8 round the activations to int8 too (Q8_0 in blocks of 32 inputs, a scale each; CTranslate2
per row), so that the product itself is integer (VNNI on x86: 64 int8 multiply-adds an instruction). `w8a8`
does that with the same stored weights: each row of x gets its own symmetric scale, by the rule the weights
get one per output channel (`quantize_per_channel`'s, with a floor of 1e-30 on max |x|), and `torch._int_mm`
sums in int32 (on a CPU without VNNI its pairs would saturate in int16: there, `int8_sums_in_two_parts`):

    y = (x_q · qᵀ) · s_x[:, None] · scale + b       x_q int8 [rows, in], s_x fp32 [rows]; the sum is exact

Its costs: each activation errs by up to s_x / 2 too (a row with one outlier spends most of its 255 levels on
it, and inputs far below the outlier round to 0), and each call pays 7 small ops to quantize x. Its gains: the
sum is integer, so a row's product is the same bits alone, in any batch and in any chunk (attention's sums are
still floating, so the logits need not be), and a prefill's rows run integer arithmetic too. vLLM runs this
scheme (W8A8 int8, dynamic per-token) from a compressed-tensors checkpoint, torchao calls it
Int8DynamicActivationInt8Weight; here it is made at load time, on a CPU only (`check_quantization`).

Invariants held by the tests: the round trip errs by at most scale/2 per element, with one scale per output
channel; on a context-sensitive model the int8 logits stay within a stated max |diff| and KL of fp32's, and int8's
greedy choice agrees with fp32's along a long generation at a stated rate; the engine (paged, batched, chunked)
gives the int8 model its own tokens; a row's logits do not depend on its batch (w8a8's product: bit for bit,
its int32 sums equal int64 ones at any row count, on a CPU whose kernel saturates too); `cpu_layout` leaves int8
alone.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import GPT2, Conv1D, LMHead

QUANTIZATIONS = ("int8", "w8a8")  # vLLM's knob, --quantization; None: the weights stay in the model's dtype
FUSED_MAX_ROWS = 16  # on a CPU, the fused kernel up to this many rows; above, the bf16 matmul (docs/quantize.md)


def check_quantization(quantization: str | None, device: torch.device | str = "cpu") -> None:
    """A ValueError naming the value and the choices, for anything but None or a method this file implements,
    and for w8a8 off a CPU (CUDA's `_int_mm` takes more than 16 rows, and widths in multiples of 8)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r} is not a method minillm implements; choose one of "
                         f"{', '.join(QUANTIZATIONS)}, or leave it out to keep the weights in the model's dtype")
    if quantization == "w8a8" and torch.device(device).type != "cpu":
        raise ValueError(f"--quantization w8a8 runs on a CPU, and this model is on {device}: torch._int_mm on CUDA "
                         "takes more than 16 rows and widths in multiples of 8 (gpt2's vocabulary is 50,257); use "
                         "--quantization int8 there, or --device cpu")


def quantize_per_channel(weight_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] → (q int8 [out, in], scales fp32 [out]): one symmetric scale per output channel, so that
    q · scale[:, None] is W to within scale / 2 per element."""
    w = weight_out_in.detach().float()
    # >>> exercise quantize-per-channel (lesson 06, 2 pts): one symmetric int8 scale per output channel, then round and clamp
    # hint: row o of W [out, in] gets a scale of its own: which one puts the row's largest magnitude on 127, the top of int8's symmetric range? What scale keeps a row of zeros finite (its q stays 0 whatever the scale)? Which rounding keeps every element within half a step of W / scale, and which range keeps -q an int8 too? Return q as int8 [out, in] and the fp32 scales [out]. Off limits: quantize_per_channel_affine, fake_quantize_per_channel_affine, quantize_per_tensor, fake_quantize_per_tensor_affine.
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale gives zeros
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in], row-major
    # <<< exercise
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q int8 [out, in] and scales [out] → the fp32 W [out, in] they stand for."""
    return q.float() * scales.float()[:, None]


@functools.lru_cache(maxsize=None)
def unit_scales(out: int) -> torch.Tensor:
    """The fused kernel's own scales, all ones (bf16 [out]), made once per width: the real ones are applied
    after, in fp32."""
    return torch.ones(out, dtype=torch.bfloat16, device="cpu")  # not the default device: the kernel is the CPU's


def int8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] · (q · scales)ᵀ + bias → [..., out], in x's dtype. The product: on a CPU in bf16 with fp32
    sums, fused for a few rows, a bf16 matmul over q widened for more; elsewhere q widened to x's dtype. Then, on
    every device, one fp32 epilogue (scales and bias in one pass), rounded once to x's dtype."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu":
        y = F.linear(x, q.to(x.dtype))
    elif rows <= FUSED_MAX_ROWS and x.shape[-1] % 16 == 0:  # the kernel takes `in` 16 at a time
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).reshape(rows, -1), q, unit_scales(q.shape[0]))
        y = y.view(*x.shape[:-1], -1)
    else:
        y = F.linear(x.to(torch.bfloat16), q.to(torch.bfloat16))
    y = y.float() * scales if bias is None else torch.addcmul(bias.float(), y.float(), scales)
    return y.to(x.dtype)


@functools.lru_cache(maxsize=None)
def int_mm_is_exact() -> bool:
    """Whether this CPU's `torch._int_mm` sums int8 products exactly at full range, tried once on the worst case.
    With VNNI it does (4 products added straight into int32). Without it, oneDNN shifts the left operand to u8
    (+128) and adds each pair of u8·s8 products in int16, which saturates: 255·127 + 255·127 = 64,770 > 32,767."""
    x = torch.full((32, 64), 127, dtype=torch.int8, device="cpu")  # not the default device: the CPU's kernel
    q = torch.full((16, 64), 127, dtype=torch.int8, device="cpu")
    q[1::2] = -127
    return all(torch.equal(torch._int_mm(rows, q.t()).long(), rows.long() @ q.long().t()) for rows in (x[:1], x))


def int8_sums(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """xq [rows, in] (integers in [-127, 127]) · qᵀ → int32 [rows, out], where `int_mm_is_exact()`."""
    return torch._int_mm(xq.to(torch.int8), q.t())


def int8_sums_in_two_parts(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The same sums, exact on any CPU: q as the shifted operand, and each activation as 64·h + l with h in [-2, 1]
    and l in [0, 63], so that no pair of products leaves int16 (255·64·2 = 32,640). Both parts ride one call as
    2·rows columns: q is read once, and the arithmetic doubles."""
    high = torch.div(xq, 64, rounding_mode="floor")
    acc = torch._int_mm(q, torch.cat([high, xq - 64 * high]).to(torch.int8).t())  # [out, 2·rows]
    return (acc[:, :len(xq)] * 64 + acc[:, len(xq):]).t()


def w8a8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] · (q · scales)ᵀ + bias → [..., out], in x's dtype, with x rounded to int8 row by row (one
    symmetric scale each) and the sums in int32, then one fp32 epilogue (both scales and bias)."""
    check_quantization("w8a8", x.device)  # a model moved off the CPU after quantizing
    rows = x.reshape(-1, x.shape[-1]).float()
    # quantize_per_channel's rule for each row, in fewer calls: |x| / s_x ≤ 127 up to rounding, so no clamp
    sx = rows.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30).div_(127)  # s_x [rows, 1]
    xq = (rows / sx).round_()  # integers in [-127, 127], still fp32
    acc = int8_sums(xq, q) if int_mm_is_exact() else int8_sums_in_two_parts(xq, q)
    y = acc * sx  # int32 · fp32 → fp32
    y = y.mul_(scales) if bias is None else torch.addcmul(bias.float(), y, scales)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


class WeightOnlyInt8Linear(nn.Module):
    """y = x·W + b, with W held as int8 [out, in] and an fp32 scale per output channel (`int8_product`)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_conv1d(cls, conv: Conv1D) -> "WeightOnlyInt8Linear":
        q, scales = quantize_per_channel(conv.weight.t())  # Conv1D stores [in, out]: one scale per column of it
        return cls(q, scales, conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"int8 weight {tuple(self.weight.shape)} [out, in], per-channel scales"


class W8A8Int8Linear(WeightOnlyInt8Linear):
    """The same int8 weights and scales, with the activations rounded to int8 per row too (`w8a8_product`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_product(x, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"int8 weight {tuple(self.weight.shape)} [out, in], per-channel scales; int8 activations, per row"


class WeightOnlyInt8LMHead(nn.Module):
    """The tied head as its own int8 copy of wte [V, C] with a scale per token: logits = x · (q · scale)ᵀ.
    The model still hands it wte at each call (for the lookup wte stays as it was); it reads its copy instead."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_wte(cls, wte: torch.Tensor) -> "WeightOnlyInt8LMHead":
        return cls(*quantize_per_channel(wte))

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        return int8_product(x, self.weight, self.scales)

    def extra_repr(self) -> str:
        return f"int8 copy of wte {tuple(self.weight.shape)}, per-token scales"


class W8A8Int8LMHead(WeightOnlyInt8LMHead):
    """The head's int8 copy of wte, multiplied by int8 activations (`w8a8_product`)."""

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        return w8a8_product(x, self.weight, self.scales)

    def extra_repr(self) -> str:
        return f"int8 copy of wte {tuple(self.weight.shape)}, per-token scales; int8 activations, per row"


MODULES = {"int8": (WeightOnlyInt8Linear, WeightOnlyInt8LMHead), "w8a8": (W8A8Int8Linear, W8A8Int8LMHead)}


@torch.no_grad()
def quantize(model: GPT2, quantization: str | None = "int8") -> GPT2:
    """Swap every Conv1D (a CPU layout's included) and the head for `quantization`'s int8 module, from the weights
    as they are now; None leaves the model as it is. Call it once the weights are final, before `choose_layout`."""
    check_quantization(quantization, model.wte.weight.device)
    if quantization is None:
        return model
    if quantization_of(model) not in (None, quantization):
        raise ValueError(f"--quantization {quantization}: this model's projections are already "
                         f"{quantization_of(model)}; quantize the plain model (load it without --quantization)")
    linear, head = MODULES[quantization]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                setattr(parent, name, linear.from_conv1d(child))
    if isinstance(model.lm_head, LMHead):
        model.lm_head = head.from_wte(model.wte.weight)
    return model


def quantization_of(model: GPT2) -> str | None:
    """The method this model's projections were quantized with ("int8", "w8a8"), or None for the model's dtype."""
    return next((name for name, (linear, _) in reversed(MODULES.items())  # w8a8 first: its module is an int8 one
                 if isinstance(model.h[0].mlp.c_fc, linear)), None)
