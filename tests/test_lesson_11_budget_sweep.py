"""Lesson 11 (the budget sweep): its quick run judges a fixed large budget against the old default, round by
round, against the roofline's gain over the scheduler's plan; the plan is the scheduler's; its check can fail."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench.replay import replay
from minillm.bench.verdict import HOLDS, NOT_SUPPORTED
from minillm.bench.workloads import lognormal_trace, pool_blocks
from minillm.checkpoints.load import random_model
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

sweep = load_lesson("11_budget_sweep")


def test_11_quick_judges_a_fixed_large_budget_against_the_old_default(tmp_path, one_thread, capsys):
    doc = run_quick(sweep, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert set(f["configs"]) == {"chunked 512", "chunked 4096", "unchunked 2048"}
    for name, c in f["configs"].items():
        assert len(c["runs"]) >= 5 and all(r["preemptions"] == 0 and r["generated_tokens"] > 0 for r in c["runs"])
        assert {r["steps"] for r in c["runs"]} == {f["planned_steps"][name]}  # the plan is what the engine ran
    assert f["steps_ratio"] >= 2, "the quick trace leaves the budgets room to differ"
    gains = [a["throughput"] / b["throughput"] for a, b in zip(f["configs"]["chunked 4096"]["runs"],
                                                               f["configs"]["chunked 512"]["runs"])]
    check = v["checks"][0]
    assert check["values"] == pytest.approx(gains) and check["predicted"] == f["predicted_gain"]
    assert check["line"] == pytest.approx(sweep.BAND * f["predicted_gain"])
    assert any(r.startswith("why ITL p99") for r in v["reasons"])


@pytest.mark.parametrize("chunked", [True, False])
def test_11_plan_steps_is_the_schedulers_plan(chunked):
    model = random_model(PRESETS["tiny"], "cpu", torch.float32)
    trace = lognormal_trace(12, 128, model.config.vocab_size, 40, 3, seed=1)
    budget = 64 if chunked else 128
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=budget,
                                              enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(num_gpu_blocks_override=pool_blocks(trace)))
    replay(engine, trace)
    plan = sweep.plan_steps([len(r.prompt) for r in trace], [r.max_tokens for r in trace], budget, chunked)
    ran = [(s.num_prefill_tokens + s.num_decode_tokens, s.num_decode_tokens) for s in engine.timeline]
    assert [(sum(new), sum(1 for k, c in zip(new, cached) if k == 1 and c > 0)) for new, cached, _ in plan] == ran


def figures(gains: list[float]) -> dict:
    run = lambda t: {"throughput": t, "steps": 7, "mean_tokens_per_step": 300, "seconds": 1.0}  # noqa: E731
    return {"predicted_gain": 1.1, "planned_steps": {"chunked 4096": 3, "chunked 512": 7},
            "configs": {"chunked 4096": {"runs": [run(100 * g) for g in gains]},
                        "chunked 512": {"runs": [run(100)] * len(gains)}}}


def test_each_check_can_fail():
    assert [c.outcome() for c in sweep.checks(figures([1.1, 1.2, 1.05, 1.15, 1.1]))] == [HOLDS]
    check, = sweep.checks(figures([0.6, 0.7, 0.65, 0.62, 0.68]))  # the larger budget slower than predicted
    assert check.outcome() == NOT_SUPPORTED and "planned" in check.why
