"""Lessons 05–08 and their shared workloads: traces, replay, and what each lesson judges.

The --quick runs use the `tiny` model, so their timings are noise; what they
must get right regardless is the memory accounting (a property of token counts,
not of speed), the shape of their results and their one verdict. The pieces each
verdict stands on are fed numbers on both sides of their lines.
"""
import json

import pytest
import torch

from minillm import PRESETS
from minillm.engine import LLMEngine
from minillm.scheduler import SchedulerConfig
from minillm.sequence import RequestMetrics
from minillm.checkpoints.load import random_model

from lesson_checks import assert_lesson_results
from lessons_support import load_lesson  # also puts lessons/ on sys.path

from minillm.bench import replay as workloads  # noqa: E402



frag, paging, stutter, sweep = (load_lesson(n) for n in ("05_fragmentation", "06_paging_cost", "07_stutter",
                                                  "08_budget_sweep"))



def run_quick(module, tmp_path) -> dict:
    module.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{module.NAME}.json").read_text())
    assert doc["lesson"] == module.NAME and doc["quick"] is True
    assert (tmp_path / f"{module.NAME}.png").stat().st_size > 1000
    assert doc["verdict"]["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE")
    assert_lesson_results(doc)
    assert doc["predictions"]
    return doc


# ---- the shared workloads --------------------------------------------------------------------


def test_trace_is_seeded_and_within_the_context():
    a = workloads.lognormal_trace(50, 128, 512, prompt_median=20, output_median=8, seed=3)
    assert a == workloads.lognormal_trace(50, 128, 512, prompt_median=20, output_median=8, seed=3)
    assert a != workloads.lognormal_trace(50, 128, 512, prompt_median=20, output_median=8, seed=4)
    for r in a:
        assert 1 <= len(r.prompt) <= 64 and 1 <= r.max_tokens and len(r.prompt) + r.max_tokens <= 128
        assert r.arrival_s == 0
    t = workloads.lognormal_trace(40, 128, 512, 32, 8, sigma=0.6, seed=1, rate=5.0)
    assert t[0].arrival_s == 0 and all(x.arrival_s <= y.arrival_s for x, y in zip(t, t[1:])) and t[-1].arrival_s > 0


def test_replay_keeps_what_it_needs_from_the_outputs_step_returns(one_thread):
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    trace = workloads.lognormal_trace(6, 128, 512, 12, 5, seed=0, rate=200.0)
    engine = LLMEngine(model, SchedulerConfig(64, 4, True), num_blocks=workloads.pool_blocks(trace))
    seen = []
    run = workloads.replay(engine, trace, on_step=lambda e, outs: seen.append(len(outs)))
    assert not engine.requests  # the engine forgets finished requests: the replay kept what it needs
    assert sorted(run.outputs, key=int) == [str(i) for i in range(6)]
    assert [len(run.outputs[str(i)].output_token_ids) for i in range(6)] == [r.max_tokens for r in trace]
    assert run.generated == sum(r.max_tokens for r in trace) and run.steps == len(seen) == len(run.step_tokens)
    for i, r in enumerate(trace):  # nobody is admitted before it arrives, and TTFT counts from the arrival
        m = run.outputs[str(i)].metrics
        assert m.arrival_time == pytest.approx(run.start + r.arrival_s) and m.first_scheduled_time >= m.arrival_time
    s = run.summary()
    assert s["ttft_p99_s"] >= s["ttft_p50_s"] > 0 and s["throughput"] > 0 and s["preemptions"] == 0


# ---- lesson 05 ---------------------------------------------------------------------------------


def test_lesson_05_quick_judges_the_same_trace_as_the_full_run(tmp_path, one_thread):
    doc = run_quick(frag, tmp_path)
    f, v = doc["figures"], doc["verdict"]
    cont, paged = f["contiguous"], f["paged"]
    assert f["trace"]["requests"] == frag.REQUESTS and f["reservation_tokens"] == PRESETS["tiny"].n_ctx
    # Memory is decided by token counts alone, so even a noisy quick run must show it:
    assert cont["peak_running"] <= frag.RESERVATIONS < paged["peak_running"]
    assert cont["waste"] > paged["waste"] and cont["generated_tokens"] == paged["generated_tokens"]
    by_block = {row["block_size"]: row for row in f["block_sweep"]}
    assert by_block[1]["waste"] == 0 and by_block[64]["waste"] > by_block[16]["waste"] == paged["waste"]
    assert [c["timed"] for c in v["checks"]] == [False, False]  # counts: never inconclusive
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED")


def test_kv_use_counts_only_allocated_memory_and_waiting_steps():
    snaps = [{"real_tokens": 30, "allocated_tokens": 40, "running": 3, "waiting": 2},
             {"real_tokens": 10, "allocated_tokens": 10, "running": 1, "waiting": 0},
             {"real_tokens": 0, "allocated_tokens": 0, "running": 0, "waiting": 0}]  # the pool after the end
    use = frag.kv_use(snaps, budget_tokens=100)
    assert use["waste"] == pytest.approx(1 - 40 / 50)
    assert use["real_share_of_budget"] == pytest.approx(40 / 200)
    assert use["peak_running"] == 3 and use["sustained_running"] == 3


def test_05_waste_of_a_replay_follows_the_formula(one_thread):
    """Paged waste ≈ running · block/2 ÷ (tokens + running · block/2): larger blocks, more waste; contiguous most."""
    model = frag.narrow_model(random_model(PRESETS["tiny"], "cpu", torch.float32))
    trace = workloads.lognormal_trace(12, 128, 512, 20, 8, seed=0)
    wastes = [frag.serve(model, trace, 4 * 128, bs, contiguous=False)["waste"] for bs in (1, 8, 32)]
    contiguous = frag.serve(model, trace, 4 * 128, 8, contiguous=True)
    assert wastes[0] == 0 < wastes[1] < wastes[2] < contiguous["waste"]
    assert contiguous["peak_running"] == frag.RESERVATIONS


# ---- lesson 06 ---------------------------------------------------------------------------------


def test_lesson_06_quick_judges_the_step_at_the_stated_point(tmp_path, one_thread):
    doc = run_quick(paging, tmp_path)
    f, v = doc["figures"], doc["verdict"]
    assert f["judged_context"] == PRESETS["tiny"].n_ctx // 4
    assert {r["block_size"] for r in f["by_block_size"]} == {4, 16, 64}
    for r in f["by_context"] + f["by_block_size"]:
        assert len(r["step_ratio"]) >= 3 and r["gather_s"] > 0 and all(x > 0 for x in r["attention_ratio"])
    assert v["checks"][0]["line"] == paging.STEP_COST_LIMIT and v["checks"][0]["timed"]


def test_06_paged_and_contiguous_steps_compute_the_same_logits():
    """The two caches hold the same (zero) context, so one decode step must give the same logits."""
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    contiguous, paged = paging.Decode(model, 3, 20), paging.Decode(model, 3, 20, block_size=4)
    paged.ids = contiguous.ids.view(1, 3)
    torch.testing.assert_close(paged.step(), contiguous.step().view(3, -1), atol=1e-5, rtol=1e-5)
    assert len(paged.blocks.block_tables[0]) == 6 and paged.blocks.block_tables[0][1] == 3  # interleaved blocks


# ---- lesson 07 ---------------------------------------------------------------------------------


def test_lesson_07_quick_writes_each_request_timeline(tmp_path, one_thread):
    doc = run_quick(stutter, tmp_path)
    f, v = doc["figures"], doc["verdict"]
    assert set(f["runs"]) == {"unchunked", f"chunked {f['setup']['chunk_budget']}"}
    for runs in f["runs"].values():
        assert len(runs) >= f["setup"]["repeats"]
        for r in runs:
            assert r["window_max_itl_s"] >= r["window_p99_itl_s"] > 0 and r["long_ttft_s"] > 0
            long = r["requests"][-1]
            assert long["arrival"] == 0 and len(long["tokens"]) == f["setup"]["long_tokens"]
    assert [c["line"] for c in v["checks"]] == [stutter.STUTTER_FACTOR, 1 - stutter.THROUGHPUT_LOSS_LIMIT]


def metrics(arrival, times):
    return RequestMetrics(arrival_time=arrival, token_times=list(times))


def test_analyse_stutter_takes_the_gaps_that_overlap_the_long_prefill():
    # streams emit at 1, 2, 3, then stall until 7, then 8; the long prompt arrives at 3.5, first token at 6.9
    streams = [metrics(0.0, [1, 2, 3, 7, 8]), metrics(0.0, [1, 2, 3, 7, 8])]
    long = metrics(3.5, [6.9, 7.5])
    a = stutter.analyse_stutter(streams, long, generated=12)
    assert a["window_max_itl_s"] == 4 and a["window_itls"] == 2  # only the 3 → 7 gap of each stream
    assert a["itl_before_median_s"] == 1 and a["long_ttft_s"] == pytest.approx(3.4)
    assert a["makespan_s"] == 8 and a["throughput"] == 12 / 8
    assert a["requests"][0] == {"arrival": -3.5, "tokens": [-2.5, -1.5, -0.5, 3.5, 4.5]}
    assert a["requests"][-1]["arrival"] == 0


@pytest.mark.parametrize("prompt,budget", [(900, 128), (768, 128), (767, 64), (512, 64), (100, 16), (10, 8)])
def test_sized_budget_is_the_power_of_two_under_prompt_over_2k(prompt, budget):
    assert stutter.sized_budget(prompt, factor=3.0) == budget


# ---- lesson 08 ---------------------------------------------------------------------------------


def test_lesson_08_quick_judges_a_fixed_large_budget_against_the_old_default(tmp_path, one_thread):
    doc = run_quick(sweep, tmp_path)
    f, v = doc["figures"], doc["verdict"]
    assert set(f["configs"]) == {"chunked 512", "chunked 4096", "unchunked 2048"}
    for c in f["configs"].values():
        assert len(c["runs"]) >= 2 and all(r["preemptions"] == 0 and r["generated_tokens"] > 0 for r in c["runs"])
    gains = [a["throughput"] / b["throughput"] for a, b in zip(f["configs"]["chunked 4096"]["runs"],
                                                               f["configs"]["chunked 512"]["runs"])]
    assert f["gain_per_round"] == pytest.approx(gains) and v["checks"][0]["values"] == pytest.approx(gains)
    assert v["checks"][0]["line"] == pytest.approx(1.4)
