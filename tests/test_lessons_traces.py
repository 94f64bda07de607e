"""The lessons' traces and their replay through an `LLMEngine` (minillm/bench/workloads.py, replay.py)."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench import replay as workloads
from minillm.checkpoints.load import random_model
from minillm.engine import LLMEngine
from minillm.scheduler import SchedulerConfig



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
