"""Lessons 05 (fragmentation) and 06 (stutter): they run, write their figures, and judge from the numbers.

The --quick runs use the `tiny` model, so their timings are noise; what they
must get right regardless is the memory accounting (a property of token counts,
not of speed) and the shape of their results. Each verdict is a pure function,
fed here with numbers on both sides of every line it draws.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from minillm.sequence import RequestMetrics

LESSONS = Path(__file__).resolve().parent.parent / "lessons"


def load(name):
    if str(LESSONS) not in sys.path:
        sys.path.insert(0, str(LESSONS))  # lessons import their shared `common` module by name
    spec = importlib.util.spec_from_file_location(f"lesson_{name}", LESSONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


frag = load("05_fragmentation")
stutter = load("06_stutter")


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on shared cores extra threads only stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- lesson 05 ---------------------------------------------------------------------------------


def test_lesson_05_quick_writes_its_figures(tmp_path, one_thread):
    frag.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "05_fragmentation.json").read_text())
    assert doc["lesson"] == "05_fragmentation" and doc["quick"] is True
    assert (tmp_path / "05_fragmentation.png").stat().st_size > 0
    f, v = doc["figures"], doc["verdict"]
    cont, paged = f["contiguous"], f["paged"]
    for run in (cont, paged):
        for key in ("waste", "real_share_of_budget", "peak_running", "sustained_running", "throughput", "snapshots"):
            assert key in run
    # Memory is decided by token counts alone, so even a noisy quick run must show it:
    assert cont["peak_running"] <= f["budget_tokens"] // f["reservation_tokens"]
    assert paged["peak_running"] > cont["peak_running"]
    assert cont["waste"] > paged["waste"]
    assert cont["generated_tokens"] == paged["generated_tokens"]  # the same requests, run to the same lengths
    assert f["replay_check"]["paged_waste_replay"] == f["replay_check"]["paged_waste_real_run"]
    sweep = {row["block_size"]: row for row in f["block_sweep"]}
    assert sweep[1]["waste"] == 0  # one-token blocks never hold an empty slot
    assert sweep[64]["waste"] > sweep[16]["waste"]
    for row in sweep.values():
        assert row["step_ratio"] > 0 and row["attention_ratio"] > 0 and row["paged_gather_s"] > 0
    assert f["kernel"]["block_size"] == 16 and f["kernel"]["gather_bytes"] > 0
    assert set(v["checks"]) == {"paged_waste_under_4pct", "paged_concurrency_2x", "paged_step_within_1_5x"}
    assert v["holds"] == all(v["checks"].values())


def test_trace_is_seeded_and_within_the_context():
    a = frag.make_trace(50, 128, 512, seed=3)
    assert a == frag.make_trace(50, 128, 512, seed=3)
    assert a != frag.make_trace(50, 128, 512, seed=4)
    for r in a:
        assert 1 <= len(r.prompt) <= 64 and 1 <= r.output_len and len(r.prompt) + r.output_len <= 128


def test_kv_use_counts_only_allocated_memory_and_waiting_steps():
    snaps = [{"real_tokens": 30, "allocated_tokens": 40, "running": 3, "waiting": 2},
             {"real_tokens": 10, "allocated_tokens": 10, "running": 1, "waiting": 0},
             {"real_tokens": 0, "allocated_tokens": 0, "running": 0, "waiting": 0}]  # the pool after the end
    use = frag.kv_use(snaps, budget_tokens=100)
    assert use["waste"] == pytest.approx(1 - 40 / 50)
    assert use["real_share_of_budget"] == pytest.approx(40 / 200)
    assert use["peak_running"] == 3 and use["sustained_running"] == 3


GOOD_05 = dict(contiguous_waste=0.7, paged_waste=0.03, contiguous_running=4.0, paged_running=10.0,
               step_ratio=1.3, attention_ratio=1.9)


def test_fragmentation_verdict_holds_when_every_line_is_met():
    v = frag.fragmentation_verdict(**GOOD_05)
    assert v["holds"] and all(v["checks"].values()) and v["contiguous_waste_vs_vllm"] == "inside"


@pytest.mark.parametrize("field,good,bad,check", [
    ("paged_waste", 0.0399, 0.0401, "paged_waste_under_4pct"),
    ("paged_running", 8.0, 7.9, "paged_concurrency_2x"),
    ("step_ratio", 1.5, 1.51, "paged_step_within_1_5x"),
])
def test_fragmentation_verdict_each_line(field, good, bad, check):
    assert frag.fragmentation_verdict(**{**GOOD_05, field: good})["checks"][check]
    v = frag.fragmentation_verdict(**{**GOOD_05, field: bad})
    assert not v["checks"][check] and not v["holds"]
    assert any(check in r for r in v["reasons"])


@pytest.mark.parametrize("waste,where", [(0.59, "below"), (0.6, "inside"), (0.8, "inside"), (0.81, "above")])
def test_fragmentation_verdict_places_contiguous_waste_against_vllm(waste, where):
    assert frag.fragmentation_verdict(**{**GOOD_05, "contiguous_waste": waste})["contiguous_waste_vs_vllm"] == where


# ---- lesson 06 ---------------------------------------------------------------------------------


def test_lesson_06_quick_writes_its_figures(tmp_path, one_thread):
    stutter.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "06_stutter.json").read_text())
    assert doc["lesson"] == "06_stutter" and doc["quick"] is True
    assert (tmp_path / "06_stutter.png").stat().st_size > 0
    f, v = doc["figures"], doc["verdict"]
    chosen = f["stutter"]["chosen"]
    assert set(chosen) == {"unchunked"} | {f"chunked {b}" for b in f["stutter"]["setup"]["chunk_budgets"]}
    assert f"chunked {f['stutter']['setup']['chunk_budget']}" in chosen
    assert set(v["stutter"]["by_budget"]) == {str(b) for b in f["stutter"]["setup"]["chunk_budgets"]}
    for mode, m in chosen.items():
        for key in ("window_max_itl_s", "window_p99_itl_s", "long_ttft_s", "throughput", "makespan_s"):
            assert m[key] > 0
        assert m["window_max_itl_s"] >= m["window_p99_itl_s"]
        assert f["stutter"]["runs"][mode][0]["timeline"]
    longest = f["sweep"]["trace"]["longest_tokens"]
    seen = {(p["budget"], p["chunked"]) for p in f["sweep"]["points"]}
    budgets = {b for b, _ in seen}
    assert all((b, True) in seen for b in budgets)
    assert all(((b, False) in seen) == (b >= longest) for b in budgets)  # unchunked only where a request fits a step
    for p in f["sweep"]["points"]:
        assert p["preemptions"] == 0 and p["generated_tokens"] > 0
        assert p["ttft_p99_s"] >= p["ttft_p50_s"] > 0 and p["itl_p99_s"] >= p["itl_p50_s"] > 0
    assert v["holds"] == v["stutter"]["holds"]
    assert v["budget_claim"]["measured"] and set(v["budget_claim"]["baselines"]) == {"chunked at 512",
                                                                                    "unchunked at 2048"}


def metrics(arrival, times):
    return RequestMetrics(arrival_time=arrival, token_times=list(times))


def test_analyse_stutter_takes_the_gaps_that_overlap_the_long_prefill():
    # streams emit at 1, 2, 3, then stall until 7, then 8; the long prompt arrives at 3.5, first token at 6.9
    streams = [metrics(0.0, [1, 2, 3, 7, 8]), metrics(0.0, [1, 2, 3, 7, 8])]
    long = metrics(3.5, [6.9, 7.5])
    a = stutter.analyse_stutter(streams, long, generated=12)
    assert a["window_max_itl_s"] == 4 and a["window_itls"] == 2  # only the 3 → 7 gap of each stream
    assert a["itl_before_median_s"] == 1
    assert a["long_ttft_s"] == pytest.approx(3.4)
    assert a["makespan_s"] == 8 and a["throughput"] == 12 / 8
    assert [p["t"] for p in a["timeline"]][:2] == [-1.5, -1.5]


@pytest.mark.parametrize("prompt,budget", [(900, 128), (768, 128), (767, 64), (100, 16), (10, 8)])
def test_sized_budget_is_the_power_of_two_under_prompt_over_2k(prompt, budget):
    assert stutter.sized_budget(prompt, factor=3.0) == budget


def test_least_disturbed_run_is_the_shortest():
    runs = [{"makespan_s": 3.0, "id": 0}, {"makespan_s": 2.0, "id": 1}, {"makespan_s": 2.5, "id": 2}]
    assert stutter.least_disturbed(runs)["id"] == 1


def test_mixed_trace_is_poisson_seeded_and_fits_the_context():
    t = stutter.make_mixed_trace(40, 128, 512, rate=5.0, prompt_median=32, output_median=8, sigma=0.6, seed=1)
    assert t[0].arrival_s == 0 and all(a.arrival_s <= b.arrival_s for a, b in zip(t, t[1:]))
    assert all(len(r.prompt) + r.max_tokens <= 128 for r in t)
    assert [r.prompt for r in t] == [r.prompt for r in stutter.make_mixed_trace(40, 128, 512, 5.0, 32, 8, 0.6, seed=1)]


@pytest.mark.parametrize("chunked_itl,ok", [(1.0, True), (1.01, False)])
def test_stutter_verdict_itl_line(chunked_itl, ok):
    v = stutter.stutter_verdict(unchunked_max_itl=3.0, chunked_max_itl=chunked_itl,
                                unchunked_throughput=100, chunked_throughput=100)
    assert v["itl_ok"] is ok and v["holds"] is ok


@pytest.mark.parametrize("chunked_tput,ok", [(91, True), (89, False), (130, True)])
def test_stutter_verdict_throughput_line(chunked_tput, ok):
    v = stutter.stutter_verdict(3.0, 0.5, unchunked_throughput=100, chunked_throughput=chunked_tput)
    assert v["throughput_ok"] is ok and v["holds"] is ok


def sweep_points(large, chunked_512, unchunked_2048):
    return [{"budget": 256, "chunked": True, "throughput": 1.0},
            {"budget": 512, "chunked": True, "throughput": chunked_512},
            {"budget": 2048, "chunked": False, "throughput": unchunked_2048},
            {"budget": 2048, "chunked": True, "throughput": 999.0},  # not > 2048: must not count as "large"
            {"budget": 4096, "chunked": True, "throughput": large},
            {"budget": 4096, "chunked": False, "throughput": large - 1}]


@pytest.mark.parametrize("large,c512,u2048,against", [
    (141, 100, 200, ["chunked at 512"]),
    (139, 100, 200, []),
    (141, 200, 100, ["unchunked at 2048"]),
    (160, 100, 100, ["chunked at 512", "unchunked at 2048"]),
])
def test_budget_claim_verdict_each_baseline(large, c512, u2048, against):
    v = stutter.budget_claim_verdict(sweep_points(large, c512, u2048))
    assert v["holds_against"] == against and v["holds"] == bool(against)
    assert v["best"] == {"budget": 4096, "chunked": True, "throughput": large}


def test_budget_claim_verdict_without_large_budgets_or_baselines():
    v = stutter.budget_claim_verdict([{"budget": 512, "chunked": True, "throughput": 1.0}])
    assert not v["measured"] and not v["holds"]
    v = stutter.budget_claim_verdict([{"budget": 4096, "chunked": True, "throughput": 1.0}])
    assert v["measured"] and v["baselines"] == {} and not v["holds"]
    assert any("not measured" in r for r in v["reasons"])
