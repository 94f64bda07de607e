"""bench's report: the load and the thread choice first, and its aims against ceilings it measured."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench import offline as bench
from minillm.checkpoints.load import random_model
from minillm.cpu_layout import lay_out, layout_of, lm_head_layout


def test_bench_reports_its_threads_load_and_aims_against_named_measured_ceilings(monkeypatch):
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    r = bench.bench(model, prompt_len=16, context_len=16, batch=1, warmup=1, repeats=2)
    r["threads"] = {"reason": "1 thread: 2 CPUs in this process's affinity, other processes kept 1.0 of them busy"}
    r["load"] = {"text": "load average 1.10 → 1.20 on 2 CPUs", "busy_cores": 1.0}
    lines = bench.report(r, on_gpu=False)
    assert lines[0].startswith("threads  1 thread") and lines[1].startswith("load     load average 1.10")
    aims = "\n".join(line for line in lines if line.startswith(("aims", "         prefill")))
    bw = bench.si(r["ceilings"]["bandwidth"], "B/s")
    assert f"weight reads at ≥ 80% of the bandwidth measured here ({bw})" in aims
    assert f"the peak measured here ({bench.si(r['ceilings']['matmul_flops'], 'FLOP/s')})" in aims
    assert "other processes kept 1.0 cores busy" in "\n".join(lines)
    e = r["engine"]  # the engine's own step, LLMEngine.step() at batch 1, beside the forward step it is not
    assert len(e["round_ratios"]) == 2 and e["steps"] >= 1 and e["engine_s"] > 0 and e["forward_s"] > 0
    text = "\n".join(lines)
    assert "forward step" in text and "(the engine's)" not in text
    assert "batch 1 through LLMEngine.step()" in text and f"paired, {e['ratio']:.2f}× the forward step" in text
    assert f"aim ≤ {bench.ENGINE_STEP_GOAL:g}×" in text
    gpu = "\n".join(bench.report(r, on_gpu=True))
    assert "within 2× the weight-read floor" in gpu and bench.si(r["ceilings"]["bandwidth"], "B/s") in gpu
    for line in lines:  # every kernel beside its ceiling, the fastest at 100%, none above
        if line.startswith(("  peak of:", "  bandwidth of:")):
            shares = [int(part.split("%")[0]) for part in line.split("(")[1:]]
            assert max(shares) == 100 and len(shares) >= 2


def test_the_sweep_times_each_batch_in_turns_against_its_own_roofline_and_batch_1():
    from minillm.bench import sweep
    from minillm.bench.cost import decode_cost
    from minillm.bench.roofline import measure_ceilings
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    ceilings = measure_ceilings("cpu", torch.float32, quick=True)
    r = sweep.sweep(model, (1, 4, 16), context_len=8, ceilings=ceilings, rounds=3)
    assert [row["batch"] for row in r["rows"]] == [1, 4, 16] and r["lm_head_layout"] == lm_head_layout(model)
    for row in r["rows"]:
        cost = decode_cost(model.config, 8, row["batch"], torch.float32)
        assert len(row["times_s"]) == 3
        assert row["weight_read_floor_s"] == cost.weight_bytes / ceilings.bandwidth
        assert row["roofline_s"] == max(cost.bytes / ceilings.bandwidth, cost.flops / ceilings.matmul_flops)
        ratios = [t / t1 for t, t1 in zip(row["times_s"], r["rows"][0]["times_s"])]
        assert row["times_batch1_range"] == [min(ratios), max(ratios)]
        assert min(ratios) <= row["times_batch1"] <= max(ratios)
        assert row["roofline_times_batch1"] == row["roofline_s"] / r["rows"][0]["roofline_s"]
    assert r["rows"][0]["times_batch1"] == 1.0
    lines = sweep.report(r)
    assert "LM head: " + lm_head_layout(model) in lines[0] and len(lines) == 5
    assert lines[3].startswith("  batch  16:") and f"{r['rows'][2]['times_batch1']:.2f}× batch 1" in lines[3]
    assert "batch 16 within 1.5× batch 1: this run" in lines[-1]


def test_sweep_batch_lists_always_hold_batch_1_and_refuse_nonsense():
    from minillm.bench.sweep import parse_batches
    assert parse_batches("16,4,4") == (1, 4, 16) and parse_batches("") == ()
    for bad in ("0,4", "a,b"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_batches(bad)


def test_the_busy_check_times_quiet_busy_and_one_thread_in_turns_and_restores_the_threads():
    from minillm.bench import sweep
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    before = torch.get_num_threads()
    r = sweep.beside_busy_core(model, 4, context_len=8, rounds=2)
    assert torch.get_num_threads() == before == r["threads"]
    t = r["times_s"]
    assert all(len(v) == 2 for v in t.values())
    assert r["busy_over_quiet"] == [b / q for b, q in zip(t["busy"], t["quiet"])]
    assert r["busy_over_one_thread"] == [b / o for b, o in zip(t["busy"], t["busy, 1 thread"])]
    line = sweep.busy_report(r)
    assert line.startswith("busy     batch-4 step beside a busy core (2 rounds")
    assert f"{min(r['busy_over_quiet']):.2f}–{max(r['busy_over_quiet']):.2f}" in line


@pytest.mark.parametrize("chosen", [True, False])
def test_the_blas_check_times_both_libraries_in_turns_quiet_and_busy_and_restores_the_choice(chosen, monkeypatch):
    """Each library's batch-1 step, quiet and beside a busy core, every round; the ratios are this run's own
    per-round figures; each timing ran on the library it names; the loader's choice is left as it was."""
    from minillm.bench import sweep
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    lay_out(model, numpy_one_row=chosen)
    from minillm import cpu_layout
    libraries, products = [], []
    real_time_fn, real_product = sweep.time_fn, cpu_layout.numpy_product
    monkeypatch.setattr(cpu_layout, "numpy_product", lambda *a: products.append(1) or real_product(*a))

    def timed(*args, **kwargs):   # which library each timing's products ran on
        before = len(products)
        result = real_time_fn(*args, **kwargs)
        libraries.append(len(products) > before)
        return result
    monkeypatch.setattr(sweep, "time_fn", timed)
    r = sweep.blas_check(model, context_len=8, rounds=2)
    assert layout_of(model)["numpy_one_row"] == chosen and getattr(model.lm_head, "numpy_one_row", False) == chosen
    t = r["times_s"]
    assert set(t) == {"numpy, quiet", "torch, quiet", "numpy, busy", "torch, busy"}
    assert all(len(v) == 2 for v in t.values())
    assert libraries == [True, False] + [True, False] * 4, "a warm-up each, then numpy and torch in turns"
    assert r["torch_over_numpy_quiet"] == [a / b for a, b in zip(t["torch, quiet"], t["numpy, quiet"])]
    assert r["torch_over_numpy_busy"] == [a / b for a, b in zip(t["torch, busy"], t["numpy, busy"])]
    line = sweep.blas_report(r)
    assert line.startswith("blas     batch-1 step, one-row products by numpy's BLAS and by torch's in turns (2 rounds")
    assert f"{min(r['torch_over_numpy_busy']):.2f}–{max(r['torch_over_numpy_busy']):.2f}" in line


def test_bench_refuses_a_blas_check_that_numpy_cannot_run():
    import argparse
    from minillm.bench import offline
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--dtype", "bf16", "--blas-check",
                              "--prompt-len", "8"])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(ValueError, match="--blas-check .* this run is bfloat16 on cpu: add --device cpu --dtype fp32"):
            offline.run(args)
        assert torch.get_num_threads() == 1, "refused before it chose threads for this process"
    finally:
        torch.set_num_threads(before)
