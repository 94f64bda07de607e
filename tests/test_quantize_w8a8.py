"""Int8 activations too (`--quantization w8a8`, minillm/quantize.py): exact integer sums, one activation scale per
row, and what it costs on a model whose next token depends on its context (tests/models.py).

w8a8 keeps int8's stored weights and rounds each row of activations too, so it errs a little more than weight-only
int8; this file holds it to int8's own bounds (tests/test_quantize.py):

    logits against fp32:   max |diff| ≤ 2.0, mean KL(fp32 ‖ w8a8) ≤ 0.01 nats, max KL ≤ 0.25
    greedy agreement:      w8a8's greedy choice equals fp32's at ≥ 90% of the positions of a long fp32 generation

(the greedy agreement and the engine's tokens are tests/test_quantize.py's, run on both methods).
"""
import copy
import os
import subprocess
import sys

import pytest
import torch

import minillm.cli as cli
import minillm.quantize as qz

from minillm import PRESETS
from minillm.bench import peers, roofline
from minillm.bench.cost import weight_bytes_read
from minillm.checkpoints import load as load_module
from minillm.checkpoints.load import load_model, random_model, save_pretrained
from minillm.cli import main
from minillm.cpu_layout import choose_layout, kernels
from minillm.quantize import (W8A8Int8Linear, W8A8Int8LMHead, dequantize, int8_product, quantization_of,
                              quantize, quantize_per_channel, w8a8_product)
from models import context_model, random_prompts

MAX_ABS_DIFF, MEAN_KL, MAX_KL = 2.0, 0.01, 0.25


@pytest.fixture(scope="module")
def fp32():
    return context_model()


@pytest.fixture(scope="module")
def w8a8(fp32):
    return choose_layout(quantize(copy.deepcopy(fp32), "w8a8"))


def kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    p, q = reference.log_softmax(-1), other.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


# ---- the product --------------------------------------------------------------------------------------------------

def test_the_integer_sums_are_exact_at_the_extremes():
    """±127 · ±127 over 3,072 inputs is 49.5M, past fp32's 2²⁴ and int16's range: the product's int32 sums must equal
    int64's on any CPU, straight from torch._int_mm where `int_mm_is_exact()` found it exact, in two parts where it
    did not (without VNNI it adds pairs of products in int16, which saturates). The probe must tell the truth at a
    model's width, and the two-part sums are exact everywhere."""
    g = torch.Generator().manual_seed(0)
    x = torch.full((3, 3072), 127, dtype=torch.int8)
    x[1] = -127
    x[2] = torch.randint(-127, 128, (3072,), generator=g, dtype=torch.int8)
    q = torch.full((24, 3072), -127, dtype=torch.int8)
    q[1::2] = torch.randint(-127, 128, (12, 3072), generator=g, dtype=torch.int8)
    sums = x.long() @ q.long().t()
    assert qz.int_mm_is_exact() == torch.equal(torch._int_mm(x, q.t()).long(), sums), "the probe is wrong here"
    assert torch.equal(qz.int8_sums_in_two_parts(x.float(), q).long(), sums)
    w = dequantize(q, torch.full((24,), 0.5))
    rows = x.float() * 2.0  # one scale per row, 2/127: rounding gives x back
    got = w8a8_product(rows, q, torch.full((24,), 0.5))
    exact = rows.double() @ w.double().t()
    assert ((got.double() - exact).abs() <= 2 ** -22 * exact.abs() + 1e-6).all()


def test_on_a_cpu_whose_int8_kernel_saturates_the_sums_are_still_exact():
    """oneDNN told to use AVX2 at most (ONEDNN_MAX_CPU_ISA, read when it starts: a process of its own) runs the
    int8 kernel of a CPU without VNNI, which saturates: the probe must see it, and w8a8's sums stay exact. (On a
    CPU that is not x86 the variable means nothing; the sums must be exact all the same.)"""
    code = ("import torch, minillm.quantize as qz\n"
            "x = torch.full((2, 768), 127.0); x[1, ::2] = -127.0\n"
            "q = torch.full((8, 768), 127, dtype=torch.int8); q[1::2] = -127\n"
            "got = qz.w8a8_product(x, q, torch.ones(8))\n"
            "print(qz.int_mm_is_exact(), torch.equal(got.long(), x.long() @ q.long().t()), torch.equal(\n"
            "      torch._int_mm(x.to(torch.int8), q.t()).long(), x.long() @ q.long().t()))\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    probe, exact, kernel_exact = out.stdout.split()
    assert exact == "True", f"w8a8's sums under AVX2 are not exact (probe {probe}, the kernel alone {kernel_exact})"
    assert probe == kernel_exact, f"the probe said {probe} where the kernel's exactness is {kernel_exact}"


def test_the_product_sums_in_integers_where_floating_sums_round():
    """65,536 inputs of ±127·127 that cancel to a small result: the partial sums pass 2²⁴ by far, where fp32 (and
    bf16) sums round; integer sums give the exact result, which w8a8_product returns through scales of 1."""
    k = 1 << 16
    x = torch.full((2, k), 127.0)
    x[:, 0], x[1, 1::2] = 1.0, -127.0  # each row's largest |x| is 127: its scale is 1, and x_q = x
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[:, k // 2:] = -127
    q[1::2, 3::7] = 5
    exact = x.long() @ q.long().t()
    assert (exact.abs() < 2 ** 24).all() and not torch.equal((x @ q.float().t()).long(), exact), \
        "the case must be one that fp32 sums get wrong"
    assert torch.equal(w8a8_product(x, q, torch.ones(16)).long(), exact)


def test_each_row_of_activations_gets_its_own_scale():
    """Rows of magnitude 1e-3 to 1e3 side by side: each row errs within its own rounding, which one scale for the
    whole batch would exceed by orders of magnitude for the small rows (they would round to zero)."""
    g = torch.Generator().manual_seed(1)
    q, scales = quantize_per_channel(torch.randn(64, 96, generator=g))
    w = dequantize(q, scales).double()
    x = torch.randn(5, 96, generator=g) * torch.tensor([1e-3, 1e-1, 1.0, 1e1, 1e3])[:, None]
    got, exact = w8a8_product(x, q, scales).double(), x.double() @ w.t()
    step = x.abs().amax(dim=1, keepdim=True).double() / 127  # each row's own step
    bound = step / 2 * w.abs().sum(dim=1) + 1e-5 * exact.abs()  # half a step per input, through |w|
    assert ((got - exact).abs() <= bound).all()
    assert (got[0] != 0).all(), "the smallest row must keep its values"


def test_a_row_gets_the_same_bits_alone_in_a_batch_and_in_chunks():
    """Integer sums do not depend on their order: a row's output is the same bits whatever rows share its call."""
    g = torch.Generator().manual_seed(2)
    q, scales = quantize_per_channel(torch.randn(80, 64, generator=g))
    x, bias = torch.randn(40, 64, generator=g), torch.randn(80, generator=g)
    many = w8a8_product(x, q, scales, bias)
    assert torch.equal(many, torch.cat([w8a8_product(x[i:i + 7], q, scales, bias) for i in range(0, 40, 7)]))
    assert torch.equal(many[13], w8a8_product(x[13:14], q, scales, bias)[0])
    assert torch.equal(w8a8_product(x.bfloat16(), q, scales).float(), w8a8_product(x.bfloat16().float(), q, scales)
                       .bfloat16().float()), "a bf16 model's rows: the same sums, rounded once to bf16"


# ---- the model ----------------------------------------------------------------------------------------------------

def test_quantize_swaps_in_the_w8a8_modules_over_the_same_int8_weights(fp32, w8a8):
    assert quantization_of(w8a8) == "w8a8" and isinstance(w8a8.lm_head, W8A8Int8LMHead)
    assert sum(isinstance(m, W8A8Int8Linear) for m in w8a8.modules()) == 4 * fp32.config.n_layer
    int8 = quantize(copy.deepcopy(fp32), "int8")
    assert quantization_of(int8) == "int8"
    a, b = w8a8.state_dict(), int8.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the stored weights are int8's"
    assert weight_bytes_read(w8a8) == weight_bytes_read(int8)


@pytest.mark.parametrize("shape", [(1, 12), (4, 32)])
def test_w8a8_logits_stay_within_the_stated_bounds_of_fp32(fp32, w8a8, shape):
    ids = torch.tensor(random_prompts(shape[0], [shape[1]], seed=3))
    with torch.no_grad():
        ref, got = fp32(ids), w8a8(ids)
    divergence = kl(ref, got)
    assert (ref - got).abs().max() <= MAX_ABS_DIFF
    assert divergence.mean() <= MEAN_KL and divergence.max() <= MAX_KL
    with torch.no_grad():
        int8 = quantize(copy.deepcopy(fp32), "int8")(ids)
    assert (got - int8).abs().max() > 1e-3, "w8a8 must differ from weight-only int8: are the activations rounded?"


def test_the_loader_and_the_cli_take_w8a8(tmp_path, capsys):
    plain = random_model(PRESETS["tiny"], "cpu", "fp32", seed=3)
    save_pretrained(plain, tmp_path / "tiny")
    model = load_model(tmp_path / "tiny", "cpu", "fp32", quantization="w8a8")
    assert quantization_of(model) == "w8a8" and "W8A8Int8Linear" in kernels(model)
    twin = quantize(context_model(seed=7), "w8a8")  # a state_dict of w8a8 loads into w8a8's modules
    twin.load_state_dict(quantize(context_model(), "w8a8").state_dict(), strict=True)
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hello", "--max-tokens", "4",
                 "--temperature", "0", "--quantization", "w8a8"]) == 0
    assert "w8a8" in capsys.readouterr().out


def test_w8a8_off_a_cpu_is_refused_naming_the_device_and_the_fix(fp32, monkeypatch, tmp_path):
    """CUDA's _int_mm takes more than 16 rows and widths in multiples of 8: w8a8 is a CPU method, said by
    quantize and by the loader before it builds or reads anything."""
    with pytest.raises(ValueError, match=r"w8a8 runs on a CPU, and this model is on meta.*int8 there, or --device cpu"):
        quantize(copy.deepcopy(fp32).to("meta"), "w8a8")
    save_pretrained(random_model(PRESETS["tiny"], "cpu", "fp32"), tmp_path / "tiny")
    monkeypatch.setattr(load_module, "resolve_device", lambda device: torch.device("cuda"))
    for folder in (tmp_path / "tiny", tmp_path / "absent"):  # a checkpoint, and a random init of tiny's shape
        with pytest.raises(ValueError, match=r"w8a8 runs on a CPU, and this model is on cuda"):
            load_model(folder if folder.exists() else "tiny", "cuda", quantization="w8a8", weights_dir=folder)


# ---- what an adversary found the tests above let through ------------------------------------------------------

def test_the_epilogue_adds_the_bias_once_after_both_scales():
    """context_model's biases are zero: only a product-level test sees the bias."""
    g = torch.Generator().manual_seed(4)
    q, scales = quantize_per_channel(torch.randn(48, 64, generator=g))
    x, bias = torch.randn(5, 64, generator=g), torch.randn(48, generator=g) * 10
    assert torch.allclose(w8a8_product(x, q, scales, bias) - w8a8_product(x, q, scales), bias.expand(5, -1),
                          atol=1e-4)


def test_the_sums_are_integer_past_16_rows_too():
    """The 65,536-input case at 40 rows: a path that sums in floats above some row count gives itself away."""
    k = 1 << 16
    x = torch.full((2, k), 127.0)
    x[:, 0], x[1, 1::2] = 1.0, -127.0
    x = x.repeat(20, 1)  # 40 rows
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[:, k // 2:] = -127
    q[1::2, 3::7] = 5
    assert torch.equal(w8a8_product(x, q, torch.ones(16)).long(), x.long() @ q.long().t())


def test_each_w8a8_module_runs_the_w8a8_product():
    """The head and every projection, each against w8a8_product on its own weights (and not int8_product's)."""
    model = quantize(context_model(), "w8a8")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, model.config.n_embd, generator=g)
    head = model.lm_head
    assert torch.equal(head(x, model.wte.weight), w8a8_product(x, head.weight, head.scales))
    assert not torch.equal(head(x, model.wte.weight), int8_product(x, head.weight, head.scales))
    for m in (m for m in model.modules() if isinstance(m, W8A8Int8Linear)):
        xi = torch.randn(3, m.weight.shape[1], generator=g)
        assert torch.equal(m(xi), w8a8_product(xi, m.weight, m.scales, m.bias))
        assert not torch.equal(m(xi), int8_product(xi, m.weight, m.scales, m.bias))


def test_the_w8a8_ceilings_run_w8a8_s_module(monkeypatch):
    calls = []
    real = qz.w8a8_product
    monkeypatch.setattr(qz, "w8a8_product", lambda *a: calls.append(a[0].shape) or real(*a))
    kernels = roofline.ceiling_kernels("cpu", torch.float32, True, "w8a8")
    kernels["int8 one-row product"].fn()
    kernels["int8 product"].fn()
    assert calls and all(shape[0] == 1 for shape in calls[:-1]) and calls[-1][0] > 16


def test_each_minillm_row_of_peers_loads_the_method_it_is_named_for():
    for name, (dtype, quantization) in peers.MINILLM.items():
        assert name == f"minillm {quantization or dtype}"
    for label, (engine, _), *_ in peers.RATIOS:
        assert engine == f"minillm {label.split()[0]}", label


def test_the_cli_generates_with_the_w8a8_model(monkeypatch, capsys):
    seen = []
    real = cli.load_model
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    assert cli.main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hello", "--max-tokens", "2",
                     "--temperature", "0", "--quantization", "w8a8"]) == 0
    assert [qz.quantization_of(m) for m in seen] == ["w8a8"]


def test_a_w8a8_model_moved_off_the_cpu_is_refused_at_its_first_product():
    model = quantize(context_model(), "w8a8").to("meta")
    with pytest.raises(ValueError, match=r"w8a8 runs on a CPU, and this model is on meta.*--device cpu"):
        model(torch.tensor([[1, 2, 3]], device="meta"))


@pytest.mark.parametrize("first, then", [("int8", "w8a8"), ("w8a8", "int8")])
def test_quantizing_a_quantized_model_another_way_is_refused(first, then):
    with pytest.raises(ValueError, match=rf"--quantization {then}: this model's projections are already {first}"):
        quantize(quantize(context_model(), first), then)
    model = quantize(context_model(), first)
    assert quantize(model, first) is model  # the same method again: nothing to do


def test_the_probe_runs_on_the_cpu_whatever_the_default_device():
    """A first product under another default device (here meta; a GPU's alike) must still probe the CPU's kernel."""
    qz.int_mm_is_exact.cache_clear()
    try:
        with torch.device("meta"):
            under = qz.int_mm_is_exact()
    finally:
        qz.int_mm_is_exact.cache_clear()
    assert under == qz.int_mm_is_exact()
