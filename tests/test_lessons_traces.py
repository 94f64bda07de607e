"""The traces (minillm/bench/workloads.py: the lessons' and bench-serve's) and their replay through an `LLMEngine`
(replay.py)."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench import workloads
from minillm.bench.replay import replay
from minillm.checkpoints.load import random_model
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
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
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=workloads.pool_blocks(trace)))
    seen = []
    run = replay(engine, trace, on_step=lambda e, outs: seen.append(len(outs)))
    assert not engine.requests  # the engine forgets finished requests: the replay kept what it needs
    assert sorted(run.outputs, key=int) == [str(i) for i in range(6)]
    assert [len(run.outputs[str(i)].output_token_ids) for i in range(6)] == [r.max_tokens for r in trace]
    assert run.generated == sum(r.max_tokens for r in trace) and run.steps == len(seen) == len(run.step_tokens)
    for i, r in enumerate(trace):  # nobody is admitted before it arrives, and TTFT counts from the arrival
        m = run.outputs[str(i)].metrics
        assert m.arrival_time == pytest.approx(run.start + r.arrival_s) and m.first_scheduled_time >= m.arrival_time
    s = run.summary()
    assert s["ttft_p99_s"] >= s["ttft_p50_s"] > 0 and s["throughput"] > 0 and s["preemptions"] == 0


@pytest.mark.parametrize("name", workloads.SHAPES)
def test_a_bench_serve_workload_is_seeded_fits_and_has_its_shape(name):
    spec = workloads.Workload(name, 40, 512, 96, seed=2, input_len=10, output_len=20, long_prompt_len=80,
                              long_fraction=0.5, prefix_len=30, prompt_median=20, output_median=8)
    pairs = list(spec)
    assert pairs == list(spec) != list(workloads.Workload(name, 40, 512, 96, seed=3, input_len=10, output_len=20,
                                                          long_prompt_len=80, long_fraction=0.5, prefix_len=30))
    assert len(pairs) == 40 and all(1 <= len(p) and 1 <= o and len(p) + o <= 96 for p, o in pairs)
    lengths = {len(p) for p, _ in pairs}
    if name == "random":
        assert lengths == {10} and {o for _, o in pairs} == {20}
    elif name == "stutter":
        assert lengths == {10, 80}
    elif name == "shared-prefix":
        assert lengths == {40} and all(p[:30] == pairs[0][0][:30] for p, _ in pairs)
    requests = spec.requests(5.0)
    assert [(r.prompt, r.max_tokens) for r in requests] == pairs and requests[-1].arrival_s > requests[0].arrival_s == 0
    assert {r.arrival_s for r in spec.requests(float("inf"))} == {0.0}


def test_an_unknown_workload_names_the_shapes():
    with pytest.raises(ValueError, match="random, lognormal, stutter, shared-prefix"):
        workloads.Workload("bursty", 4, 512, 96)
