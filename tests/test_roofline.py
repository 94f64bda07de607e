"""Ceilings that are ceilings: on the tiny shapes, in fp32, bf16, int8 and w8a8, no share of a ceiling that `bench` (its sweep
included) or lesson 02 computes exceeds 100%, and none had to be raised to a step's own rate; a ceiling measured with
a deliberately slow kernel makes that check fail."""
import time

import pytest
import torch

from minillm import PRESETS
from minillm.bench import offline as bench
from minillm.bench import roofline
from minillm.bench.roofline import Kernel, ceilings_from
from minillm.bench.verdict import interleave
from minillm.checkpoints.load import random_model

from lessons_support import load_lesson  # also puts lessons/ on sys.path

TINY = PRESETS["tiny"]

# Timer resolution only: perf_counter resolves well under a microsecond, and the shortest call timed here (a tiny
# decode step, about half a millisecond; the ceiling kernels take milliseconds) is hundreds of times longer, so a
# share read from two such times errs by well under 1% from the clock. Load is no excuse: each ceiling is the best
# repeat of its fastest kernel, so a busy machine lowers the shares, it does not raise them.
TIMER_TOLERANCE = 0.01

# The figures that are shares of a ceiling, wherever they sit in a result (a share ≤ 1 is ≤ 100%).
SHARES = {"frac_matmul_flops", "frac_bandwidth", "frac_roofline", "weight_frac_bandwidth", "matmul_share",
          "bandwidth_share"}
# The figures that are a step's time over the least time the ceilings allow it (≥ 1: no step beats its floor).
FLOORS = {"times_floor", "times_weight_floor", "times_roofline"}


def over_ceiling(result, path: str = "") -> list[str]:
    """Every share of a ceiling in `result` (nested dicts and lists) above 100% + the timer's tolerance, every step
    faster than its floor, every kernel whose rate beats the ceiling it defines, and every ceiling raised to a step's
    own rate (a step the measured kernels did not bound), as 'where: value'."""
    found = []
    if isinstance(result, dict):
        for key, value in result.items():
            where = f"{path}.{key}" if path else str(key)
            if key in SHARES:
                values = value if isinstance(value, list) else [value]
                found += [f"{where}: {v:.3f}" for v in values if v > 1 + TIMER_TOLERANCE]
            elif key in FLOORS:
                found += [f"{where}: {value:.3f}"] if value < 1 - TIMER_TOLERANCE else []
            elif key in ("raised", "ceilings_raised"):
                found += [f"{where}: {name}" for name in value]
            elif key == "kernels" and "matmul_flops" in result:  # a Ceilings' own kernels
                top = {"compute": result["matmul_flops"], "memory": result["bandwidth"]}
                found += [f"{where}.{k}: {v['rate'] / top[v['roof']]:.3f}" for k, v in value.items()
                          if v["rate"] > top[v["roof"]] * (1 + TIMER_TOLERANCE)]
            else:
                found += over_ceiling(value, where)
    elif isinstance(result, list):
        for i, value in enumerate(result):
            found += over_ceiling(value, f"{path}[{i}]")
    return found


def assert_under_ceilings(result) -> None:
    found = over_ceiling(result)
    assert not found, f"shares above their ceiling (a bug in the ceiling, roofline.py): {found}"


def slow_kernels(device, dtype, quick=False, quantization=None) -> dict[str, Kernel]:
    """Deliberately slow ceiling kernels: an 8 × 8 product one row at a time and a copy 16 elements at a time, each
    from Python, whose rates a tiny model's prefill and decode outrun."""
    a, w = torch.randn(256, 8), torch.randn(8, 8)
    src = torch.ones(16 * 256)
    dst = torch.empty_like(src)
    return {"slow product": Kernel(lambda: [a[i:i + 1] @ w for i in range(256)], 2 * 256 * 8 * 8, 0, "compute",
                                   "an 8 × 8 product, one row at a time"),
            "slow copy": Kernel(lambda: [dst[i:i + 16].copy_(src[i:i + 16]) for i in range(0, src.numel(), 16)],
                                0, 2 * src.nbytes, "memory", "a copy, 16 elements at a time")}


def test_a_ceiling_is_the_best_repeat_of_the_fastest_kernel():
    kernels = {"a": Kernel(lambda: None, 100, 0, "compute"), "b": Kernel(lambda: None, 300, 0, "compute"),
               "c": Kernel(lambda: None, 0, 50, "memory")}
    c = ceilings_from(kernels, {"a": [1.0, 0.5, 2.0], "b": [3.0, 4.0], "c": [0.5, 0.25], "step": [9.0]}, "cpu",
                      torch.float32)
    assert c.matmul_flops == 200 and c.bandwidth == 200 and c.ridge == 1  # a: 100 / 0.5; c: 50 / 0.25
    assert {k: v["rate"] for k, v in c.kernels.items()} == {"a": 200, "b": 100, "c": 200}


def test_the_ceilings_bound_the_engine_s_own_kernels_at_the_tiny_shapes():
    """The tiny model's own products (several rows: the packed copy; one row), timed in turns with the ceiling
    kernels so that a moment's load meets both, run no faster than the ceilings of the same rounds."""
    kernels = roofline.ceiling_kernels("cpu", torch.float32, quick=True)
    assert {"matmul", "product"} <= {k for k, v in kernels.items() if v.roof == "compute"}
    assert {"copy", "sum", "matrix-vector", "one-row product"} <= {k for k, v in kernels.items() if v.roof == "memory"}
    fc, x = random_model(TINY, "cpu", torch.float32).h[0].mlp.c_fc, torch.randn(TINY.n_ctx, TINY.n_embd)
    steps = {f"{n} rows": torch.inference_mode()(lambda rows=x[:n]: fc(rows)) for n in (TINY.n_ctx, 1)}
    rounds = interleave({**{k: v.fn for k, v in kernels.items()}, **steps}, repeats=9)  # more chances at a quiet round
    ceilings = ceilings_from(kernels, rounds.seconds, "cpu", torch.float32)
    for n in (TINY.n_ctx, 1):
        t = min(rounds.times(f"{n} rows"))
        assert 2 * n * fc.weight.numel() / t <= ceilings.matmul_flops * (1 + TIMER_TOLERANCE)
        assert fc.weight.nbytes / t <= ceilings.bandwidth * (1 + TIMER_TOLERANCE)
    assert_under_ceilings(ceilings.as_dict())


DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"), (torch.float32, "w8a8")]


def bench_tiny(dtype, quantization) -> dict:
    """bench's figures on the tiny shape (a prefill, a decode step, a sweep of batches 1 and 4) in this dtype and
    weight format, against ceilings of the same, as `python -m minillm bench` computes them."""
    model = random_model(TINY, "cpu", dtype, quantization=quantization)
    r = bench.bench(model, prompt_len=64, context_len=64, warmup=1, repeats=3, quick_ceilings=True)
    r["sweep"] = bench.sweep(model, (1, 4), 64, roofline.measure_ceilings("cpu", dtype, True, quantization=quantization),
                             rounds=3)
    return r


@pytest.mark.parametrize("dtype, quantization", DTYPES, ids=["fp32", "bf16", "int8", "w8a8"])
def test_no_share_that_bench_prints_exceeds_its_ceiling(dtype, quantization):
    r = bench_tiny(dtype, quantization)
    assert r["ceilings"]["dtype"] == str(dtype).removeprefix("torch.") and r["ceilings"]["quantization"] == quantization
    if quantization:  # the int8 kernels the engine runs are among those that measure the ceilings
        assert {"int8 product", "int8 one-row product"} <= r["ceilings"]["kernels"].keys()
        assert ("_int_mm" in r["ceilings"]["kernels"]["int8 one-row product"]["what"]) == (quantization == "w8a8")
    assert_under_ceilings(r)
    printed = "\n".join(bench.report(r, on_gpu=False) + bench.sweep_report(r["sweep"]))
    assert "of peak" in printed and "of bw" in printed and "*" not in printed and "raised" not in printed


def test_a_step_faster_than_every_kernel_raises_its_ceiling_and_says_so():
    c = ceilings_from({"mm": Kernel(lambda: None, 100, 0, "compute"), "read": Kernel(lambda: None, 0, 100, "memory")},
                      {"mm": [1.0], "read": [1.0]}, "cpu", torch.float32)  # peak 100 FLOP/s, bandwidth 100 B/s
    assert c.raised_to("a step", 50.0, 50.0) is c  # bound by the kernels: nothing raised
    up = c.raised_to("a step", 400.0, 20.0)
    assert (up.matmul_flops, up.bandwidth, up.raised) == (400.0, 100, ["a step (compute)"])
    assert up.fastest("compute").startswith("a step") and up.ridge == 4.0
    assert over_ceiling(up.as_dict()) == ["raised: a step (compute)"]


def test_no_share_that_lesson_02_prints_or_plots_exceeds_its_ceiling(tmp_path):
    lesson = load_lesson("02_phase_split")
    figures = lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])["figures"]
    assert_under_ceilings(figures)
    ceil = figures["ceilings_in_rounds"]
    for point in figures["prefill"] + figures["decode"]:  # every plotted point under the roof it is drawn against
        roof = min(ceil["matmul_flops"], point["intensity"] * ceil["bandwidth"])
        assert point["flops_per_s"] <= roof * (1 + TIMER_TOLERANCE)


def test_a_ceiling_measured_with_a_slow_kernel_fails_the_check(monkeypatch):
    """The counterfactual: ceilings from kernels slower than the engine's are raised to bench's own steps (so no share
    prints above 100%), and the check names each raise: a slow kernel set is caught, not hidden."""
    monkeypatch.setattr(roofline, "_CEILINGS", {})
    monkeypatch.setattr(roofline, "ceiling_kernels", slow_kernels)
    r = bench_tiny(torch.float32, None)
    found = over_ceiling(r)
    assert "ceilings.raised: the prefill (compute)" in found and "ceilings.raised: the decode step (memory)" in found
    assert any(f.startswith("sweep.ceilings_raised: the batch-") for f in found), found
    assert all(f.split(":")[0].endswith("raised") for f in found), found  # raised, so no share above 100%
    assert "raised to a step's own rate" in "\n".join(bench.report(r, on_gpu=False))
    with pytest.raises(AssertionError, match="a bug in the ceiling"):
        assert_under_ceilings(r)


def test_a_kernel_faster_than_the_ceiling_it_defines_is_caught():
    c = ceilings_from({"fast": Kernel(time.perf_counter, 10, 0, "compute"),
                       "read": Kernel(time.perf_counter, 0, 10, "memory")}, {"fast": [1.0], "read": [1.0]}, "cpu",
                      torch.float32).as_dict()
    assert not over_ceiling(c)
    c["matmul_flops"] = 5.0  # a ceiling set below its own fastest kernel
    assert over_ceiling(c) == ["kernels.fast: 2.000"]
