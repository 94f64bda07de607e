"""Static batching (minillm/static_batching.py): a batch is formed only when the last one has entirely finished,
with the engine's kernels; the same greedy tokens as continuous batching; nothing lost, no block leaked."""
import pytest

from minillm import SamplingParams
from minillm.bench.batching import finish_steps
from minillm.chunked_prefill import ChunkedPrefillScheduler
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import Scheduler, SchedulerConfig
from minillm.static_batching import StaticBatchingScheduler, policy_for
from models import context_model, random_prompts

OUTPUTS = [3, 9, 2, 5, 7, 1, 4, 8, 6, 2]


def static_engine(model, seats: int, blocks: int = 64, batching_type: str = "static") -> LLMEngine:
    return LLMEngine(model, SchedulerConfig(max_num_seqs=seats, enable_chunked_prefill=False,
                                            batching_type=batching_type),
                     CacheConfig(block_size=4, num_gpu_blocks_override=blocks))


def serve(engine, prompts, outputs, watch=None) -> dict:
    """Every request to the end, checking the pool after every step; `watch(running before, admitted in the step)`."""
    for p, n in zip(prompts, outputs):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        before = set(engine.stats().running)
        outs = engine.step()
        engine.check_invariants()
        if watch is not None:
            watch(before, {rid for rid, is_decode, _, _ in engine.timeline[-1].rows if not is_decode})
        finished.update((o.request_id, o.output_token_ids) for o in outs if o.finished)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and not stats.running and not stats.num_waiting  # no leak
    return finished


def test_a_request_joins_only_an_empty_batch_and_the_tokens_are_continuous_batchings(one_thread):
    model = context_model()
    prompts = random_prompts(len(OUTPUTS), range(3, 9), seed=2)
    joined = []

    def watch(before, admitted):
        if admitted:
            joined.append((before, admitted))
    static = serve(static_engine(model, 3), prompts, OUTPUTS, watch)
    continuous = serve(static_engine(model, 3, batching_type="continuous"), prompts, OUTPUTS)
    assert [b for b, _ in joined] == [set()] * 4, f"admitted into a batch still running: {joined}"
    assert [sorted(new, key=int) for _, new in joined] == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"], ["9"]]
    assert static == continuous and len(static) == len(OUTPUTS)  # nothing lost, the same greedy tokens
    assert [len(static[str(i)]) for i in range(len(OUTPUTS))] == OUTPUTS


def test_the_engine_takes_the_steps_the_cost_model_counts(one_thread):
    model = context_model()
    prompts = random_prompts(len(OUTPUTS), range(3, 9), seed=2)
    for batching_type, static in (("static", True), ("continuous", False)):
        engine = static_engine(model, 3, batching_type=batching_type)
        serve(engine, prompts, OUTPUTS)
        assert len(engine.timeline) == max(finish_steps(OUTPUTS, 3, static)), batching_type


def test_a_member_preempted_for_memory_rejoins_its_batch_before_any_newcomer(one_thread):
    """A pool too small for the batch at its longest: the newest member is preempted, waits until the other has
    finished (the batch is empty, but not over), is recomputed alone, and only then does the next batch form;
    nothing is lost and no block leaks."""
    model = context_model()
    prompts = random_prompts(4, [4], seed=5)
    outputs = [20] * 4
    engine = static_engine(model, 2, blocks=8)  # 2 sequences of 24 tokens need 12 blocks of 4: preemption
    joined = []
    static = serve(engine, prompts, outputs, lambda before, admitted: joined.append(admitted) if admitted else None)
    assert sum(step.num_preempted for step in engine.timeline) > 0
    assert joined == [{"0", "1"}, {"1"}, {"2", "3"}, {"3"}], joined  # a recomputed member alone, then a new batch
    continuous = serve(static_engine(model, 2, blocks=8, batching_type="continuous"), prompts, outputs)
    assert static == continuous and all(len(t) == 20 for t in static.values())
    order = [rid for step in engine.timeline for rid, is_decode, _, _ in step.rows if not is_decode]  # admissions
    cut = next(i for i, rid in enumerate(order) if rid not in {"0", "1"})
    assert set(order[:cut]) == {"0", "1"} and not {"0", "1"} & set(order[cut:]), order  # batch 1, recomputes included


def test_the_knob_picks_the_policy_and_a_contradiction_is_refused():
    assert policy_for(SchedulerConfig(batching_type="static", enable_chunked_prefill=False)) is StaticBatchingScheduler
    assert policy_for(SchedulerConfig(enable_chunked_prefill=False)) is Scheduler
    assert policy_for(SchedulerConfig()) is ChunkedPrefillScheduler
    with pytest.raises(ValueError, match="needs enable_chunked_prefill=False"):
        SchedulerConfig(batching_type="static")
    with pytest.raises(ValueError, match="batching_type='inflight' must be 'continuous' or 'static'"):
        SchedulerConfig(batching_type="inflight", enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="use static_batching.policy_for"):
        Scheduler(SchedulerConfig(batching_type="static", enable_chunked_prefill=False), blocks=None)
