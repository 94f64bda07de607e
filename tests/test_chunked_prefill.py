"""The scheduling policy: decode-first under a token budget, driven by a fake model that records each call."""
import random

import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm import kv_cache
from minillm.chunked_prefill import ChunkedPrefillScheduler
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import Scheduler, SchedulerConfig
from models import context_model

CFG = PRESETS["tiny"]


class RecordingModel:
    """Stands in for GPT2: records the positions of every forward call; 'predicts' last token + 1."""

    def __init__(self, config=CFG):
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32
        self.calls: list[list[int]] = []
        self.logit_rows: list[list[int] | None] = []  # the rows of each call that got logits

    def eval(self):
        return self

    def __call__(self, input_ids, positions, cache=None, logits_indices=None):
        self.calls.append(positions[0].tolist())
        self.logit_rows.append(None if logits_indices is None else logits_indices.tolist())  # None: every row
        nxt = (input_ids[0, logits_indices] + 1) % self.config.vocab_size
        return torch.nn.functional.one_hot(nxt, self.config.vocab_size).float()


def params(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain(engine) -> dict:
    """Step until every request is done; the finished outputs by request id (the engine forgets them)."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_invariants()
    return finished


def test_a_seven_token_prompt_with_budget_three_runs_as_chunks_of_3_3_1():
    fake = RecordingModel()
    engine = LLMEngine(fake, SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=1),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=8))
    engine.add_request(list(range(7)), params(2))
    drain(engine)
    assert fake.calls == [[0, 1, 2], [3, 4, 5], [6], [7]], "3 + 3 + 1 prompt tokens, then one decode"
    assert fake.logit_rows == [[], [], [0], None], "logits only where a row samples: none for a chunk mid-prompt"


def test_logits_only_for_the_rows_that_sample_in_a_mixed_step():
    """Decodes first, then a chunk that ends its prompt and one that does not: one logits row per decode and
    for the finished prompt's last token, none for the chunk that stops mid-prompt."""
    fake = RecordingModel()
    engine = LLMEngine(fake, SchedulerConfig(max_num_batched_tokens=9, max_num_seqs=4, enable_chunked_prefill=True),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    engine.add_request([1, 2], params(5))
    engine.step()                                # the 2-token prompt, whole: its last row samples
    engine.add_request([3] * 4, params(2))
    engine.add_request([4] * 20, params(2))
    engine.step()                                # 1 decode + 4 (a whole prompt) + 4 of 20 (mid-prompt)
    assert fake.calls[-1] == [2, 0, 1, 2, 3, 0, 1, 2, 3]
    assert fake.logit_rows == [[1], [0, 4]]


def test_budget_and_max_num_seqs_are_never_exceeded():
    fake = RecordingModel()
    config = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3)
    engine = LLMEngine(fake, config, cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64))
    rng = random.Random(0)
    for step in range(60):
        if step % 3 == 0:
            engine.add_request([1] * rng.randint(1, 25), params(rng.randint(1, 8)))
        engine.step()
    drain(engine)
    assert max(len(c) for c in fake.calls) == 10, "the budget should be filled, and never exceeded"
    assert max(s.num_seqs for s in engine.timeline) == 3


def long_prompt_arrives(chunked: bool, budget=8):
    """Three streams decoding; then a 60-token prompt arrives."""
    engine = LLMEngine(RecordingModel(),
                       SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64))
    for _ in range(3):
        engine.add_request([5, 6], params(30))
    for _ in range(3):
        engine.step()
    engine.add_request([1] * 60, params(2))
    steps_before = len(engine.timeline)
    drain(engine)
    return engine.timeline[steps_before:]


def test_running_decodes_are_never_starved_when_a_long_prompt_arrives():
    steps = long_prompt_arrives(chunked=True)
    while_prefilling = [s for s in steps if s.num_prefill_tokens]
    assert len(while_prefilling) >= 60 // 8, "the long prompt should be cut into chunks"
    assert all(s.num_decode_tokens == 3 for s in while_prefilling), "every step kept all three streams decoding"
    assert all(s.num_prefill_tokens == 8 - 3 for s in while_prefilling[:-1]), "chunks fill what decodes leave"


def test_without_chunking_the_long_prompt_stalls_every_stream():
    steps = long_prompt_arrives(chunked=False, budget=64)
    stall = [s for s in steps if s.num_prefill_tokens]
    assert len(stall) == 1 and stall[0].num_prefill_tokens == 60 and stall[0].num_decode_tokens == 0


def test_every_prefill_keeps_making_progress():
    """Streams keep arriving, yet the oldest pending prompt advances every step until it is done."""
    fake = RecordingModel()
    engine = LLMEngine(fake, SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=5),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=128))
    long = engine.requests[engine.add_request([1] * 40, params(1))]  # our own handle: the engine forgets it
    for i in range(30):
        engine.add_request([2] * 3, params(20))
        before = long.num_computed_tokens
        engine.step()
        if long.is_finished:
            break
        assert long.num_computed_tokens > before, f"the 40-token prompt stalled at step {i}"
    assert long.is_finished
    drain(engine)


def test_scheduler_needs_no_model():
    """The policy alone, over a stand-in for the block space: a plan per step from queue state."""
    class Unlimited:
        def match_prefix(self, seq): return 0
        def can_append(self, seq, n): return True
        def append_slots(self, seq, n): pass
        def free(self, seq): pass
    from minillm.sequence import RequestMetrics, Sequence
    sched = ChunkedPrefillScheduler(SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=2), Unlimited())
    seq = Sequence("a", [1] * 10, params(1), RequestMetrics(0.0))
    sched.add(seq)
    plan = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.is_decode) for c in plan.chunks] == [("a", 4, False)]


@pytest.mark.parametrize("cls, chunked", [(Scheduler, True), (ChunkedPrefillScheduler, False)])
def test_a_policy_refuses_a_config_that_asks_for_the_other(cls, chunked):
    with pytest.raises(ValueError, match="implements enable_chunked_prefill"):
        cls(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=chunked), blocks=None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_batched_tokens=4, max_num_seqs=8, enable_chunked_prefill=False), "smaller than max_num_seqs=8"),
    (dict(max_num_batched_tokens=0, max_num_seqs=1), "max_num_batched_tokens=0"),
    (dict(max_num_batched_tokens=8, max_num_seqs=0), "max_num_seqs=0"),
])
def test_bad_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_a_prompt_over_the_budget_without_chunking_is_rejected():
    engine = LLMEngine(RecordingModel(),
                       SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=False),
                       cache_config=CacheConfig(num_gpu_blocks_override=8))
    with pytest.raises(ValueError, match="max_num_batched_tokens=16; raise the budget"):
        engine.add_request([1] * 17, params(1))


# ---- equivalence with the real (tiny) model ------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return context_model()


def test_chunk_boundaries_at_every_position(model):
    """A 21-token prompt joins a decoding stream; budgets 2..22 end chunks at every position, mid-block too."""
    rng = random.Random(5)
    stream, prompt = [rng.randrange(500) for _ in range(5)], [rng.randrange(500) for _ in range(21)]
    want = [kv_cache.generate(model, [p], params(6))[0] for p in (stream, prompt)]
    for budget in range(2, 23):
        engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=2),
                           cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
        a = engine.add_request(stream, params(6))
        engine.step()
        b = engine.add_request(prompt, params(6))
        finished = drain(engine)
        got = [finished[r].output_token_ids for r in (a, b)]
        assert got == want, f"budget {budget}: outputs diverged from kv_cache.generate"


def test_budget_of_one_token(model):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1),
                       cache_config=CacheConfig(block_size=2, num_gpu_blocks_override=32))
    outs = engine.generate(prompts, params(4))
    assert [o.output_token_ids for o in outs] == [kv_cache.generate(model, [p], params(4))[0] for p in prompts]


def test_preemption_while_a_request_is_partly_prefilled(model, monkeypatch):
    victims = []
    original = Scheduler._preempt

    def spy(self, seq, out):
        victims.append((seq.num_computed_tokens, len(seq.prompt_token_ids)))
        original(self, seq, out)
    monkeypatch.setattr(Scheduler, "_preempt", spy)
    rng = random.Random(6)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (30, 30, 40)]
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=20))
    outs = engine.generate(prompts, params(30))
    engine.check_invariants()
    assert any(0 < done < n for done, n in victims), f"no partly prefilled victim among {victims}"
    assert [o.output_token_ids for o in outs] == [kv_cache.generate(model, [p], params(30))[0] for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
