"""Weight-only int8 (minillm/quantize.py): the rounding, the scales, the error it costs, and the engine on it.

Every comparison runs on a model whose next token depends on its context (tests/models.py). The bounds below are
this file's statement of what int8 costs on that model (std 0.3 weights, logits of about ±11):

    logits against fp32:   max |diff| ≤ 2.0, mean KL(fp32 ‖ int8) ≤ 0.01 nats, max KL ≤ 0.25
    greedy agreement:      int8's greedy choice equals fp32's at ≥ 90% of the positions of a long fp32 generation
"""
import copy

import pytest
import torch

from minillm import PRESETS, SamplingParams, kv_cache
from minillm.bench.cost import decode_cost, weight_bytes_read
from minillm.checkpoints import load as load_module
from minillm.checkpoints.load import load_model, random_model, save_pretrained
from minillm.cli import main
from minillm.cpu_layout import choose_layout, kernels, lay_out
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.model import Conv1D, LMHead
from minillm.quantize import (FUSED_MAX_ROWS, WeightOnlyInt8Linear, WeightOnlyInt8LMHead, dequantize, int8_product,
                              quantization_of, quantize, quantize_per_channel, unit_scales)
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts

MAX_ABS_DIFF, MEAN_KL, MAX_KL, GREEDY_AGREEMENT = 2.0, 0.01, 0.25, 0.90


@pytest.fixture(scope="module")
def fp32():
    return context_model()


@pytest.fixture(scope="module")
def int8(fp32):
    return choose_layout(quantize(copy.deepcopy(fp32)))


@pytest.fixture(scope="module", params=["int8", "w8a8"])
def quantized(fp32, request):
    """Either method: w8a8 keeps int8's weights and rounds the activations too (tests/test_quantize_w8a8.py)."""
    return choose_layout(quantize(copy.deepcopy(fp32), request.param))


def kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) per position, in nats."""
    p, q = reference.log_softmax(-1), other.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


# ---- the quantizer ------------------------------------------------------------------------------------------------

def test_the_round_trip_errs_by_at_most_half_a_scale_per_element(fp32):
    for name, w in [("h.0.attn.c_attn", fp32.h[0].attn.c_attn.weight.t()), ("wte", fp32.wte.weight),
                    ("random", torch.randn(300, 77, generator=torch.Generator().manual_seed(1)))]:
        q, scales = quantize_per_channel(w)
        assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (w.shape[0],), name
        err = (dequantize(q, scales) - w.float()).abs()
        assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all(), f"{name}: an element off by more than scale/2"
        assert (q.abs().amax(dim=1) == 127).all(), f"{name}: each row's largest weight must use the full range"
        assert (q >= -127).all(), f"{name}: -128 is outside the symmetric range"


def test_rounding_is_half_to_even_and_the_clamp_keeps_zero():
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.0, -127.0]])  # scale 1: the values are their own q
    q, scales = quantize_per_channel(w)
    assert scales.tolist() == [1.0]
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 0, -127]]
    q, scales = quantize_per_channel(torch.zeros(2, 4))  # an all-zero row stays zero, with no 0/0
    assert (q == 0).all() and torch.isfinite(scales).all()


def test_scales_are_per_output_channel_not_per_tensor():
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1e-1, 1.0, 1e2, 1e4])
    w = torch.randn(5, 64, generator=g) * magnitudes[:, None]
    q, scales = quantize_per_channel(w)
    assert torch.allclose(scales, torch.stack([row.abs().max() for row in w]) / 127)
    relative = (dequantize(q, scales) - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert (relative <= 1 / 254 * (1 + 1e-5)).all(), f"each row errs within half a step of its own range: {relative}"
    assert (q[0] != 0).sum() > 32, "the smallest row must keep its values; one scale for the tensor rounds it to zero"


def test_the_fused_and_the_widened_product_agree_on_the_cpu():
    """Few rows go through the fused kernel, many through a bf16 matmul: the same numbers up to the sums' order."""
    g = torch.Generator().manual_seed(0)
    q, scales = quantize_per_channel(torch.randn(96, 48, generator=g))
    x = torch.randn(40, 48, generator=g)
    many = int8_product(x, q, scales)           # 40 rows
    few = torch.cat([int8_product(x[i:i + 8], q, scales) for i in range(0, 40, 8)])  # 8 rows at a time
    exact = x.double() @ dequantize(q, scales).double().t()
    assert torch.allclose(many, few, rtol=1e-2, atol=1e-2)
    w = dequantize(q, scales).double()
    bound = 2 ** -9 * (x.double().abs() @ w.abs().t() + exact.abs()) * 1.01  # bf16 rounds x and y: 2⁻⁹ each
    assert ((few - exact).abs() <= bound).all() and ((many - exact).abs() <= bound).all()
    odd_q, odd_scales = quantize_per_channel(torch.randn(96, 40, generator=g))  # in = 40: the fused kernel cannot
    odd_x = torch.randn(3, 40, generator=g)
    assert torch.allclose(int8_product(odd_x, odd_q, odd_scales), odd_x @ dequantize(odd_q, odd_scales).t(), rtol=2e-2,
                          atol=2e-2)


@pytest.mark.parametrize("rows", [3, 40])  # the fused kernel, then the bf16 matmul
def test_the_epilogue_applies_scales_and_bias_in_fp32_and_rounds_once(rows):
    """Scales bf16 cannot represent and a non-zero bias: the product, then scales and bias in fp32, one cast to
    bf16 (exactly); for fp32 activations, within fp32's rounding of that sum (addcmul may fuse it: one rounding)."""
    g = torch.Generator().manual_seed(3)
    q, scales = quantize_per_channel(torch.randn(64, 48, generator=g))
    scales = scales * (1 + 2 ** -12)  # between two bf16 values: rounding them first would show
    assert not torch.equal(scales.bfloat16().float(), scales)
    x, bias = torch.randn(rows, 48, generator=g), torch.randn(64, generator=g) * 3
    xb, ones = x.to(torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(xb, q, ones) if rows <= FUSED_MAX_ROWS else xb @ q.to(torch.bfloat16).t()
    bf16 = (y.float() * scales + bias.bfloat16().float()).to(torch.bfloat16)
    assert torch.equal(int8_product(xb, q, scales, bias.bfloat16()), bf16)
    assert torch.equal(int8_product(xb, q, scales), (y.float() * scales).to(torch.bfloat16))
    exact = y.double() * scales.double() + bias.double()
    bound = 2 ** -23 * (y.double() * scales.double()).abs() + 2 ** -24 * exact.abs()  # the product, then the sum
    assert ((int8_product(x, q, scales, bias).double() - exact).abs() <= bound).all()


def test_the_fused_kernels_unit_scales_stay_on_the_cpu_whatever_the_default_device():
    """A first call under another default device (here meta; a GPU's alike) must not cache scales off the CPU."""
    g = torch.Generator().manual_seed(4)
    q, scales = quantize_per_channel(torch.randn(80, 32, generator=g))
    x = torch.randn(2, 32, generator=g)
    unit_scales.cache_clear()
    with torch.device("meta"):
        assert unit_scales(80).device.type == "cpu"
        under = int8_product(x, q, scales)
    assert torch.equal(under, int8_product(x, q, scales))


# ---- the model ----------------------------------------------------------------------------------------------------

def test_quantize_swaps_every_projection_and_the_head_and_keeps_the_embeddings(fp32, int8):
    linears = [m for m in int8.modules() if isinstance(m, WeightOnlyInt8Linear)]
    assert len(linears) == 4 * fp32.config.n_layer and not any(isinstance(m, Conv1D) for m in int8.modules())
    assert isinstance(int8.lm_head, WeightOnlyInt8LMHead) and quantization_of(int8) == "int8"
    assert quantization_of(fp32) is None
    assert torch.equal(int8.wte.weight, fp32.wte.weight), "wte stays as it was, for the lookup"
    assert torch.equal(dequantize(int8.h[0].mlp.c_fc.weight, int8.h[0].mlp.c_fc.scales),
                       dequantize(*quantize_per_channel(fp32.h[0].mlp.c_fc.weight.t())))


@pytest.mark.parametrize("shape", [(1, 12), (4, 32)], ids=["fused-12-rows", "widened-128-rows"])
def test_int8_logits_stay_within_the_stated_bounds_of_fp32(fp32, int8, shape):
    ids = torch.tensor(random_prompts(shape[0], [shape[1]], seed=3))
    with torch.no_grad():
        ref, got = fp32(ids), int8(ids)
    divergence = kl(ref, got)
    assert (ref - got).abs().max() <= MAX_ABS_DIFF
    assert divergence.mean() <= MEAN_KL and divergence.max() <= MAX_KL
    assert (ref - got).abs().max() > 1e-3, "int8 must differ from fp32: is the model quantized at all?"


def test_a_row_gets_the_same_logits_alone_and_in_a_batch(int8):
    ids = torch.tensor(random_prompts(4, [32], seed=4))
    with torch.no_grad():
        assert torch.allclose(int8(ids)[1], int8(ids[1:2])[0], atol=1e-2)


def test_greedy_agreement_over_a_long_generation_through_the_engine(fp32, quantized):
    """fp32's engine generates 96 tokens for each of 6 prompts; the quantized model's greedy choice at each of those
    positions agrees with fp32's at the stated rate (free-running, the first disagreement sends the two apart)."""
    prompts = random_prompts(6, [6, 20], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    outs = LLMEngine(fp32, cache_config=CacheConfig(block_size=8)).generate(prompts, params)
    agree = total = 0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            choices = quantized(ids)[0, len(prompt) - 1:-1].argmax(-1)
        agree += (choices == torch.tensor(tokens)).sum().item()
        total += len(tokens)
    assert agree / total >= GREEDY_AGREEMENT, f"{quantization_of(quantized)} agreed with fp32 at {agree / total:.1%} " \
                                              f"of {total} positions"


@pytest.mark.parametrize("block_size,chunked", [(5, True), (16, False)])
def test_the_engine_paged_and_batched_gives_the_quantized_model_its_own_tokens(quantized, block_size, chunked):
    prompts = random_prompts(6, [5, 20, 40], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = [kv_cache.generate(quantized, [p], params)[0] for p in prompts]
    scheduler = SchedulerConfig(max_num_batched_tokens=24 if chunked else 128, max_num_seqs=8,
                                enable_chunked_prefill=chunked)
    engine = LLMEngine(quantized, scheduler, cache_config=CacheConfig(block_size=block_size))
    outs = engine.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- state_dict, the loader and the layout ------------------------------------------------------------------------

def test_state_dict_holds_int8_weights_and_scales_and_loads_into_a_quantized_model(fp32, int8, tmp_path):
    state = int8.state_dict()
    assert state["h.0.attn.c_attn.weight"].dtype == torch.int8
    assert state["h.0.attn.c_attn.weight"].shape == (3 * fp32.config.n_embd, fp32.config.n_embd)  # [out, in]
    assert state["h.0.attn.c_attn.scales"].dtype == torch.float32
    assert state["lm_head.weight"].shape == fp32.wte.weight.shape and state["lm_head.weight"].dtype == torch.int8
    assert state["wte.weight"].dtype == torch.float32
    torch.save(state, tmp_path / "int8.pt")
    twin = quantize(context_model(seed=7))  # other weights, the same modules
    twin.load_state_dict(torch.load(tmp_path / "int8.pt"), strict=True)
    ids = torch.tensor(random_prompts(2, [10], seed=2))
    with torch.no_grad():
        assert torch.equal(twin(ids), int8(ids))
    with pytest.raises(RuntimeError, match="scales"):
        twin.load_state_dict(fp32.state_dict(), strict=True)  # a plain state_dict lacks the scales
    with pytest.raises(ValueError, match="save the model before quantizing"):
        save_pretrained(int8, tmp_path / "ckpt")


def test_the_loader_quantizes_before_the_layout_and_the_layout_leaves_int8_alone(tmp_path):
    plain = random_model(PRESETS["tiny"], "cpu", "fp32", seed=3)
    save_pretrained(plain, tmp_path / "tiny")
    for model in (load_model(tmp_path / "tiny", "cpu", "fp32", quantization="int8"),
                  load_model("tiny", "cpu", "fp32", weights_dir=tmp_path / "none", seed=3, quantization="int8")):
        assert quantization_of(model) == "int8" and isinstance(model.lm_head, WeightOnlyInt8LMHead)
        heads = model.lm_head
        lay_out(model, head_copy=True, packed=True, numpy_one_row=True)
        choose_layout(model, numpy_one_row=True, packed=True)
        assert model.lm_head is heads, "lay_out must leave the int8 head alone"
        assert quantization_of(model) == "int8" and not any(isinstance(m, (Conv1D, LMHead)) for m in model.modules())
        assert "WeightOnlyInt8Linear" in kernels(model) and "WeightOnlyInt8LMHead" in kernels(model)
    ids = torch.tensor(random_prompts(2, [10], seed=2))
    with torch.no_grad():
        assert torch.equal(model(ids), quantize(copy.deepcopy(plain))(ids))


def test_a_laid_out_model_quantizes_from_its_own_weights():
    """quantize after choose_layout (packed copies, a head copy) gives what it gives before."""
    plain = random_model(PRESETS["tiny"], "cpu", "fp32", seed=3)
    first = quantize(copy.deepcopy(plain))
    laid = quantize(lay_out(copy.deepcopy(plain), head_copy=True, packed=True))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), laid.state_dict().values()))


def test_an_unknown_method_is_refused_naming_the_value_and_the_choices(fp32):
    for call in (lambda: quantize(copy.deepcopy(fp32), "int4"), lambda: load_model("tiny", quantization="int4")):
        with pytest.raises(ValueError, match=r"'int4'.*int8"):
            call()


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_the_cli_refuses_an_unknown_method_naming_the_value_and_the_choices(capsys, monkeypatch, command):
    def loaded(*args, **kwargs):
        raise AssertionError(f"{command} loaded a model for --quantization q4 instead of refusing it")
    monkeypatch.setattr(load_module, "random_model", loaded)
    monkeypatch.setattr(load_module, "load_checkpoint", loaded)
    extra = {"generate": ["--prompt", "hi"], "bench": [], "serve": []}[command]
    assert main([command, "--model", "tiny", "--device", "cpu", "--quantization", "q4", *extra]) == 2
    err = capsys.readouterr().err
    assert "'q4'" in err and "int8" in err, err


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_serve_refuses_int8_weights_with_disaggregated_workers(capsys, monkeypatch, method):
    """The prefill and decode workers load their own weights in --dtype: int8 there would be a flag ignored."""
    def loaded(*args, **kwargs):
        raise AssertionError("serve loaded a model for --quantization int8 --disaggregate instead of refusing it")
    monkeypatch.setattr(load_module, "random_model", loaded)
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--quantization", method, "--disaggregate"]) == 2
    err = capsys.readouterr().err
    assert f"--quantization {method} with --disaggregate" in err and f"serve {method} weights without" in err, err


def test_generate_runs_on_int8_weights(capsys):
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hello", "--max-tokens", "4",
                 "--temperature", "0", "--quantization", "int8"]) == 0
    assert "int8" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m gpu on a GPU machine)")
def test_int8_on_cuda_gives_the_cpu_int8_logits_within_bf16(fp32):
    cpu = quantize(copy.deepcopy(fp32))
    gpu = quantize(copy.deepcopy(fp32).to("cuda"))
    ids = torch.tensor(random_prompts(2, [12], seed=6))
    with torch.no_grad():
        ref, got = fp32(ids), gpu(ids.cuda()).cpu()
    assert (ref - got).abs().max() <= MAX_ABS_DIFF and kl(ref, got).mean() <= MEAN_KL
    assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu.state_dict().values(), cpu.state_dict().values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m gpu on a GPU machine)")
def test_on_cuda_the_epilogue_is_fp32_too():
    """Elsewhere than a CPU: q widened to x's dtype, then scales bf16 cannot represent and the bias in fp32, rounded
    once to bf16: within half a bf16 step of the exact sum (however the device fuses it), which a bf16 epilogue
    (scales rounded, then the product, then the sum) exceeds."""
    g = torch.Generator().manual_seed(5)
    q, scales = quantize_per_channel(torch.randn(64, 48, generator=g))
    scales = scales * (1 + 2 ** -12)
    x, bias = torch.randn(5, 48, generator=g).bfloat16().cuda(), torch.randn(64, generator=g).bfloat16().cuda()
    q, scales = q.cuda(), scales.cuda()
    y = torch.nn.functional.linear(x, q.to(x.dtype)).double()
    got, exact = int8_product(x, q, scales, bias), y * scales.double() + bias.double()
    half_step = 2.0 ** (torch.frexp(got.float())[1] - 9).double()  # bf16: 8 significant bits
    assert ((got.double() - exact).abs() <= half_step + 2 ** -22 * exact.abs()).all()


def test_bench_counts_the_weight_bytes_a_step_reads_as_stored(fp32, int8):
    """fp32: every weight in 4 bytes, the tied head once more (cost.py's count); int8: quantize.py's formula."""
    cfg = fp32.config
    L, C, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    assert weight_bytes_read(fp32) == decode_cost(cfg, 0, 1).weight_bytes
    small = 9 * L * C + 4 * L * C + 2 * C  # biases, then the LayerNorms' weights and biases, in fp32
    assert weight_bytes_read(int8) == (12 * L * C ** 2 + V * C) * 1 + (9 * L * C + V) * 4 + small * 4
