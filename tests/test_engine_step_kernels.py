"""The engine's batch-1 decode step runs the modules and kernels the loader laid out, however it is built.

Structural, not timed: `python -m minillm bench` prints the engine's step against the model's forward step, and
these tests hold what that ratio rests on. For an engine built by `load_model` then `LLMEngine` (fp32, and int8),
by `serve`, and for the CLI's `generate`, a decode step at batch 1 calls once each projection and the head that
`cpu_layout.choose_layout` (or `quantize`) swapped into the model, through the kernel the loader chose: numpy's
BLAS for every one-row product where it chose that, and the same torch product ops as the forward step that
`bench` times (`bench.steps.decode_step`), op for op.
"""
from __future__ import annotations

import signal

import pytest
import torch

from minillm import cli, cpu_layout
from minillm.bench.steps import count_ops, decode_step
from minillm.checkpoints.load import load_model
from minillm.cpu_layout import CPULMHead, layout_of, packing_pays
from minillm.device import set_num_threads
from minillm.engine import LLMEngine
from minillm.model import GPT2, Conv1D, LMHead
from minillm.quantize import WeightOnlyInt8Linear, WeightOnlyInt8LMHead, quantize
from minillm.sampling_params import SamplingParams
from minillm.serving import launch

PRODUCTS = (Conv1D, LMHead, WeightOnlyInt8Linear, WeightOnlyInt8LMHead)  # every module that multiplies by weights
PRODUCT_OPS = ("linear", "addmm", "mm", "matmul", "mkldnn._linear_pointwise", "_weight_int8pack_mm")


@pytest.fixture
def numpy_pays(monkeypatch):
    """This machine answers as an AMD CPU whose numpy links OpenBLAS with sleeping threads: the loader chooses
    numpy's BLAS for one row (conftest pins every machine to torch's otherwise)."""
    monkeypatch.setattr(cpu_layout, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_layout, "numpy_blas", lambda: "openblas")
    monkeypatch.setattr(cpu_layout, "openblas_threads_sleep", lambda: True)


@pytest.fixture
def numpy_products(monkeypatch) -> list:
    """The row count of every product numpy's BLAS computes."""
    calls, real = [], cpu_layout.numpy_product
    monkeypatch.setattr(cpu_layout, "numpy_product", lambda x, *a: calls.append(x.numel() // x.shape[-1]) or
                        real(x, *a))
    return calls


def modules_called(model: GPT2, fn) -> list:
    """The product modules of `model` that one call of `fn` runs, in order, each as often as it runs."""
    called = []
    handles = [m.register_forward_hook(lambda module, args, out: called.append(module))
               for m in model.modules() if isinstance(m, PRODUCTS)]
    try:
        fn()
    finally:
        for handle in handles:
            handle.remove()
    return called


def product_ops(fn) -> dict:
    """The product ops (matrix multiplications in any form) one call of `fn` dispatches, by name."""
    return {op: n for op, n in count_ops(fn).by_op.items() if op.rsplit(".", 1)[0] in PRODUCT_OPS}


def check_batch_1_step(engine: LLMEngine, calls: list, one_row_by_numpy: bool) -> None:
    """One request alone: after its prefill, one engine step calls each of the model's product modules once, the
    ones in the model now, through numpy's BLAS for all of them or none, with the forward step's product ops."""
    model, L = engine.model, engine.config.n_layer
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not engine.step():  # the prefill, up to the first token
        pass
    calls.clear()
    laid_out = [m for m in model.modules() if isinstance(m, PRODUCTS)]
    called = modules_called(model, engine.step)
    assert len(called) == len(laid_out) == 4 * L + 1 and {id(m) for m in called} == {id(m) for m in laid_out}
    assert calls == ([1] * (4 * L + 1) if one_row_by_numpy else []), "numpy's BLAS for every one-row product"
    engine_ops = product_ops(engine.step)
    calls.clear()
    forward_ops = product_ops(decode_step(model, 22, 1))
    assert engine_ops == forward_ops and (sum(engine_ops.values()) == 0) == one_row_by_numpy  # numpy: no torch one
    assert calls == ([1] * (4 * L + 1) if one_row_by_numpy else [])
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("layout", ["numpy's BLAS", "torch's BLAS", "int8"])
def test_an_engine_built_on_load_model_decodes_one_row_through_the_loaders_modules(layout, request,
                                                                                    numpy_products):
    if layout != "torch's BLAS":  # int8 too: the loader's choice must not matter to quantize.py's modules
        request.getfixturevalue("numpy_pays")
    model = load_model("tiny", "cpu", "fp32", weights_dir="/nonexistent",
                       quantization="int8" if layout == "int8" else None)
    if layout == "int8":  # quantize.py's modules, which no CPU layout replaces
        assert type(model.h[0].mlp.c_fc) is WeightOnlyInt8Linear and type(model.lm_head) is WeightOnlyInt8LMHead
    else:
        assert type(model.lm_head) is CPULMHead and layout_of(model)["numpy_one_row"] == (layout == "numpy's BLAS")
        assert layout_of(model)["packed"] == packing_pays(model.device, model.dtype, "")
    with LLMEngine(model) as engine:
        check_batch_1_step(engine, numpy_products, layout == "numpy's BLAS")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_serve_builds_its_engine_on_the_loaders_layout_and_decodes_one_row_through_it(quantization, numpy_pays,
                                                                                     numpy_products, monkeypatch):
    """`python -m minillm serve`'s own builder, up to the HTTP server, which checks the engine on its thread."""
    checked = []

    class CheckingServer:
        started = True

        def __init__(self, serving, config):
            self.serving = serving

        def run(self):
            future = self.serving.loop.call(
                lambda engine: check_batch_1_step(engine, numpy_products, quantization is None))
            checked.append(future.result(timeout=120) is None)

    monkeypatch.setattr(launch, "Server", CheckingServer)
    threads, handlers = torch.get_num_threads(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(["serve", "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--threads", "1",
                         "--weights-dir", "/nonexistent",
                         *(["--quantization", quantization] if quantization else [])]) == 0
    finally:
        set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert checked == [True]


def test_the_cli_generates_every_one_row_step_through_the_loaders_layout(numpy_pays, numpy_products, monkeypatch,
                                                                       capsys):
    """`python -m minillm generate` decodes on the contiguous cache, with no engine: each of its one-row forward
    passes goes through numpy's BLAS for every projection and the head, as the loader chose, and each prefill
    through it for the head over the prompt's last row."""
    one_row_passes, real_forward = [], GPT2.forward

    def counting_forward(self, ids, *args, **kwargs):
        one_row_passes.append(ids.numel() == 1)
        return real_forward(self, ids, *args, **kwargs)
    monkeypatch.setattr(GPT2, "forward", counting_forward)
    assert cli.main(["generate", "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--prompt", "hello",
                     "--max-tokens", "5", "--temperature", "0", "--weights-dir", "/nonexistent"]) == 0
    L = load_model("tiny", "cpu", "fp32", weights_dir="/nonexistent").config.n_layer
    decodes, prefills = sum(one_row_passes), len(one_row_passes) - sum(one_row_passes)  # the warm-up's, then the run's
    assert decodes >= 4 and prefills == 2
    assert numpy_products == [1] * ((4 * L + 1) * decodes + prefills), "and the head over each prompt's last row"
    capsys.readouterr()


def test_the_loader_warns_where_numpy_loaded_first_keeps_one_row_products_off_the_faster_blas(monkeypatch):
    """`import torch` before minillm loads numpy with OpenBLAS's threads spinning: the loader then keeps torch's
    BLAS where numpy's would pay, so a library user's engine runs another layout than `bench` times. It says so,
    naming the fix; where the threads sleep, or numpy's BLAS would not pay, it is silent."""
    import warnings

    from models import context_model
    monkeypatch.setattr(cpu_layout, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_layout, "numpy_blas", lambda: "openblas")
    monkeypatch.setattr(cpu_layout, "openblas_threads_sleep", lambda: False)
    with pytest.warns(RuntimeWarning, match="Import minillm before torch and numpy"):
        model = cpu_layout.choose_layout(context_model())
    assert not layout_of(model)["numpy_one_row"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_layout.choose_layout(context_model().to(torch.bfloat16))  # numpy has no bf16 BLAS: nothing to lose
        cpu_layout.choose_layout(context_model(), numpy_one_row=False)  # asked for by name
        cpu_layout.choose_layout(quantize(context_model(), "int8"))  # int8's products never take numpy's BLAS
        monkeypatch.setattr(cpu_layout, "openblas_threads_sleep", lambda: True)
        assert layout_of(cpu_layout.choose_layout(context_model()))["numpy_one_row"]
