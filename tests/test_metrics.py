"""The measurement toolkit: the cost model against hand-computed numbers, the timers, the ceilings, bench."""
import sys

import pytest
import torch

from minillm.bench import offline as bench
from minillm.bench import cost
from minillm.bench import memory
from minillm.bench import roofline
from minillm.bench import steps
from minillm.bench import timing
from minillm.config import PRESETS
from minillm.cpu_layout import lay_out, layout_of
from minillm.kv_cache import KVCache
from minillm.bench.cost import StepCost, decode_cost, prefill_cost, step_cost
from minillm.bench.roofline import Ceilings
from minillm.checkpoints.load import random_model

TINY = PRESETS["tiny"]  # L=2, C=64, V=512, n_ctx=128
# Hand count for tiny: per block 12·C² + 13·C = 49,984 params; two blocks + ln_f (2·C) = 100,096.
TINY_BLOCK_PARAMS = 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
TINY_HEAD_PARAMS = 512 * 64


# ---- the analytic cost of a step ------------------------------------------------


def test_decode_cost_matches_hand_count():
    c = decode_cost(TINY, cached_len=10, batch=1, dtype=torch.float32)
    # matmuls 2·L·12·C², attention 4·L·C·(10+1), LM head 2·V·C
    assert c.flops == 2 * 2 * 12 * 64 * 64 + 4 * 2 * 64 * 11 + 2 * 512 * 64 == 267_776
    assert c.weight_bytes == (TINY_BLOCK_PARAMS + TINY_HEAD_PARAMS) * 4 == 531_456
    assert c.kv_read_bytes == 2 * 2 * 64 * 4 * 10
    assert c.kv_write_bytes == 2 * 2 * 64 * 4
    assert c.other_bytes == 2 * 64 * 4 + 512 * 4  # wte+wpe row in, one logits row out
    assert c.bytes == 531_456 + 10_240 + 1_024 + 2_560
    assert c.intensity == pytest.approx(267_776 / 545_280)


def test_decode_flops_agree_with_config_flops_per_token():
    for name in ("tiny", "gpt2", "gpt2-xl"):
        cfg = PRESETS[name]
        assert decode_cost(cfg, 99).flops == cfg.flops_per_token(context_len=100)


def test_prefill_attention_is_causal_and_head_runs_once():
    c = prefill_cost(TINY, prompt_len=3)
    attended = 1 + 2 + 3  # token j sees j+1 keys
    assert c.flops == 2 * 2 * 12 * 64 * 64 * 3 + 4 * 2 * 64 * attended + 2 * 512 * 64
    assert c.kv_read_bytes == 0 and c.kv_write_bytes == 3 * TINY.kv_bytes_per_token()


def test_ragged_batch_and_no_head():
    c = step_cost(TINY, new_tokens=[2, 1], cached_lens=[5, 7], lm_head_rows=0)
    attended = (6 + 7) + 8
    assert c.flops == 2 * 2 * 12 * 64 * 64 * 3 + 4 * 2 * 64 * attended
    assert c.weight_bytes == TINY_BLOCK_PARAMS * 4  # no LM head: wte's full matrix is not read
    assert c.kv_read_bytes == 12 * TINY.kv_bytes_per_token()


def test_half_precision_halves_bytes_not_flops():
    a, b = decode_cost(TINY, 10, 1, torch.float32), decode_cost(TINY, 10, 1, torch.bfloat16)
    assert a.flops == b.flops and a.bytes == 2 * b.bytes


def test_decode_intensity_grows_with_batch_but_kv_caps_it():
    gpt2 = PRESETS["gpt2"]
    assert decode_cost(gpt2, 0, 8).intensity == pytest.approx(8 * decode_cost(gpt2, 0, 1).intensity, rel=0.01)
    assert decode_cost(gpt2, 1000, 64).intensity < decode_cost(gpt2, 0, 64).intensity / 5


@pytest.mark.parametrize("new,cached", [([], []), ([1, 1], [0]), ([0], [3]), ([1], [-1])])
def test_step_cost_rejects_bad_input(new, cached):
    with pytest.raises(ValueError):
        step_cost(TINY, new, cached)


# ---- ceilings and the roofline --------------------------------------------------


def test_ceilings_ridge_and_roofline():
    c = Ceilings("x", "float32", matmul_flops=100e9, bandwidth=20e9, matmul_size=1, copy_bytes=1)
    assert c.ridge == 5.0
    assert c.attainable(1.0) == 20e9 and c.attainable(50.0) == 100e9


def test_achieved_fractions():
    c = Ceilings("x", "float32", matmul_flops=100e9, bandwidth=20e9, matmul_size=1, copy_bytes=1)
    cost = StepCost(flops=10e9, weight_bytes=4e9, kv_read_bytes=0, kv_write_bytes=0, other_bytes=0,
                    tokens=1, lm_head_rows=1)
    a = roofline.achieved(cost, 0.5, c)
    assert a["flops_per_s"] == 20e9 and a["bytes_per_s"] == 8e9
    assert a["frac_matmul_flops"] == pytest.approx(0.2) and a["frac_bandwidth"] == pytest.approx(0.4)
    assert a["bound"] == "memory"  # intensity 2.5 < ridge 5
    assert a["frac_roofline"] == pytest.approx(20e9 / 50e9)


def test_measure_ceilings_on_cpu_is_positive_and_cached():
    c = roofline.measure_ceilings("cpu", torch.float32, quick=True)
    assert c.matmul_flops > 1e8 and c.bandwidth > 1e8 and c.ridge > 0
    assert c.copy_bytes >= 64 << 20  # far beyond any L2, so it measures memory
    assert roofline.measure_ceilings("cpu", torch.float32, quick=True) is c
    assert c.datasheet == {}  # no vendor figures for a CPU


# ---- timing ---------------------------------------------------------------------------


class FakeClock:
    """A perf_counter that moves only when the timed work moves it: no busy machine can sway these tests."""
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_time_fn_runs_warmup_and_repeats_and_reports_median(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    durations = iter([4.0, 4.0, 0.5, 0.125, 0.25])  # two warm-up calls, then three timed ones (exact in binary)

    def work():
        clock.now += next(durations)

    t = timing.time_fn(work, "cpu", warmup=2, repeats=3)
    assert t.times_s == [0.5, 0.125, 0.25] and t.median_s == 0.25 and t.method == "perf_counter"
    with pytest.raises(ValueError):
        timing.time_fn(work, "cpu", repeats=0)


def test_stopwatch_laps(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    w = timing.Stopwatch("cpu")
    with pytest.raises(RuntimeError):
        w.lap()
    w.start()
    for d in (0.25, 1.0):
        clock.now += d
        w.lap()
    assert w.laps_s() == [0.25, 1.0], "each lap runs from the one before, not from the start"


def test_timed_steps_on_tiny_model():
    model = random_model(TINY, "cpu", torch.float32)
    assert steps.time_prefill(model, 16, batch=2, repeats=2).median_s > 0
    assert steps.time_decode(model, 100, batch=3, repeats=3).median_s > 0  # rewinds each repeat
    with pytest.raises(ValueError):
        steps.time_decode(model, TINY.n_ctx, 1)


# ---- memory ------------------------------------------------------------------------------


def test_accounted_memory_counts_weights_and_caches():
    model = random_model(TINY, "cpu", torch.float32)
    cache = KVCache(TINY, 2, 32, "cpu", torch.float32)
    m = memory.accounted_memory(model, [cache])
    assert m["kind"] == "accounted"
    assert m["weights"] == TINY.num_params() * 4
    assert m["kv_cache"] == 2 * 32 * TINY.kv_bytes_per_token()
    head = TINY.vocab_size * TINY.n_embd * 4  # the [C, V] copy the CPU layout keeps, and more if it packs
    assert m["layout_copies"] >= head * layout_of(model)["head_copy"]
    assert m["total"] == m["weights"] + m["layout_copies"] + m["kv_cache"]
    for head_copy, packed in ((True, True), (True, False), (False, False)):  # the shape's formula, as built
        lay_out(model, head_copy=head_copy, packed=packed)
        assert memory.layout_copy_bytes(model) == memory.layout_copy_bytes_of(TINY, torch.float32, head_copy, packed)
    assert memory.accounted_memory(model, [cache])["layout_copies"] == 0


def test_cpu_memory_budget_is_labelled():
    b = memory.memory_budget("cpu")
    assert b["bytes"] > 1 << 28 and "stated budget" in b["source"]


def test_environment_names_device_and_torch():
    env = timing.environment("cpu", torch.float32)
    assert env["torch"] == torch.__version__ and env["dtype"] == "float32" and env["device_name"]


@pytest.mark.gpu
def test_cuda_events_and_memory_stats():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(1024, 1024, device="cuda")
    assert timing.time_fn(lambda: a @ a, "cuda").method == "cuda-events"
    before = torch.cuda.memory_allocated()
    cache = KVCache(TINY, 1, 64, "cuda", torch.bfloat16)
    assert torch.cuda.memory_allocated() - before == cache.nbytes


# ---- bench ----------------------------------------------------------------------------------


def test_bench_reports_both_phases_against_ceilings(monkeypatch):
    monkeypatch.setattr(roofline, "_CEILINGS", {})  # measured afresh, so its progress is said
    model = random_model(TINY, "cpu", torch.float32)
    said = []
    r = bench.bench(model, prompt_len=16, context_len=16, batch=1, warmup=1, repeats=2, progress=said.append)
    measured = 6 + (torch.get_num_threads() > 1)  # the projection on one thread too, where torch has more
    assert [m.split()[0] for m in said] == ["measuring"] * measured + ["timing"] * 3
    assert "matmul" in said[0] and "projection" in said[1] and "copy" in said[2] and "sum" in said[3]
    assert "matrix-vector" in said[4] and "one row" in said[5] and "prefill" in said[-3] and "decode" in said[-2] and "engine" in said[-1]
    for phase in ("prefill", "decode"):
        assert r[phase]["tokens_per_s"] > 0 and 0 < r[phase]["frac_bandwidth"]
    d = r["decode"]
    assert d["mode"] == "eager"  # the engine's decode step on a CPU
    assert d["times_floor"] == pytest.approx(d["seconds"] / d["weight_read_floor_s"])
    assert d["weight_read_floor_s"] == pytest.approx(
        decode_cost(TINY, 16).weight_bytes / r["ceilings"]["bandwidth"])
    k = r["ceilings"]["kernels"]
    assert k["sum"]["rate"] > 0 and k["one-row product"]["rate"] > 0
    lines = bench.report(r, on_gpu=False)
    assert any(line.startswith("decode") and "eager forward step" in line for line in lines)
    assert any(line.startswith("aims") and "≥ 80% of the bandwidth measured here" in line for line in lines)
    assert not any("MISSED" in line or "target" in line for line in lines)  # bench speaks to students
    assert any("the engine's one-row product alone streams" in line for line in lines)


def test_bench_command_rejects_too_long_prompt(capsys):
    from minillm.cli import main
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--prompt-len", "500"]) == 2
    assert "n_ctx=128" in capsys.readouterr().err


def test_a_dtype_the_device_emulates_is_warned_about_before_anything_slow(capsys, monkeypatch):
    from minillm.cli import main

    class Stop(Exception):
        pass

    def ceilings(*args, **kwargs):
        print("ceilings start", file=sys.stderr)  # the first thing that takes minutes when emulated
        raise Stop
    monkeypatch.setattr(bench, "emulation_slowdown", lambda device, dtype: (38.0, 4.8e8))
    monkeypatch.setattr(bench, "measure_ceilings", ceilings)
    with pytest.raises(Stop):
        main(["bench", "--model", "tiny", "--device", "cpu", "--dtype", "fp16", "--prompt-len", "16"])
    err = capsys.readouterr().err
    assert err.index("warning: float16 matmuls run 38× slower than fp32") < err.index("ceilings start")
    assert "use --dtype fp32" in err


def test_emulation_slowdown_is_measured():
    same, rate = bench.emulation_slowdown(torch.device("cpu"), torch.float32)
    assert same == 1.0 and rate > 0
    slowdown, _ = bench.emulation_slowdown(torch.device("cpu"), torch.bfloat16)
    assert slowdown > 0


# ---- launch overhead: what lesson 03 measures ------------------------------------------


def test_count_ops_counts_each_dispatched_op_once_and_tells_views_apart():
    x = torch.ones(4, 4)
    count = steps.count_ops(lambda: (x + 1).t().relu().reshape(16))
    assert (count.total, count.views, count.kernels) == (4, 2, 2)
    assert count.by_op == {"add.Tensor": 1, "t.default": 1, "relu.default": 1, "reshape.default": 1}
    assert steps.count_ops(lambda: torch.nn.functional.linear(x, x)).total == 1  # as Python called it


def test_a_static_decode_step_dispatches_fewer_ops_than_a_fresh_one():
    """The same paged decode step, described anew (cache.prepare: new tensors) and on the static buffers: the
    static one dispatches fewer ops (no metadata tensors are made, no slicing per layer)."""
    from minillm.block_manager import BlockManager
    from minillm.cuda_graphs import DecodeRunner
    from minillm.kv_cache import Segment
    from minillm.paged_attention import PagedKVCache
    from types import SimpleNamespace
    model = random_model(TINY, "cpu", "fp32")
    blocks = BlockManager(16, 4)
    cache = PagedKVCache(TINY, blocks)
    for sid, n in ((0, 9), (1, 14)):
        blocks.append_slots(SimpleNamespace(seq_id=sid, num_computed_tokens=0), n)
    step = [Segment(0, 8, 1, True), Segment(1, 13, 1, True)]
    runner = DecodeRunner(model, cache, 2, "static")
    ids = torch.tensor([[5, 7]])
    with torch.inference_mode():
        fresh = steps.count_ops(lambda: model(ids, cache.prepare(step).positions, cache=cache))
        static = steps.count_ops(lambda: runner.run(step, [5, 7]))
    assert static.total < fresh.total and static.by_op.get("lift_fresh.default", 0) == 0, (static, fresh)


def test_weight_read_floor_is_weight_bytes_over_bandwidth():
    cfg = PRESETS["gpt2"]
    floor = cost.weight_read_floor(cfg, torch.bfloat16, 1e12)
    assert floor == pytest.approx((cfg.num_params() - cfg.n_ctx * cfg.n_embd) * 2 / 1e12)  # wpe is gathered, not read


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_time_decode_in_each_mode(mode):
    model = random_model(TINY, "cpu", "fp32")
    t = steps.time_decode(model, cached_len=20, batch=3, warmup=1, repeats=2, mode=mode)
    assert t.median_s > 0 and len(t.times_s) == 2


def test_time_decode_refuses_graphs_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same path on a machine with CUDA
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        steps.time_decode(random_model(TINY, "cpu", "fp32"), cached_len=5, mode="graph")
