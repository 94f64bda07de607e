"""What the live page is fed: the engine's step record, the recorder's ring, the roofline prediction, the SSE feed.

The records are checked against workloads whose every step is known in advance: a 100-token prompt beside three
decodes under a budget of 67 tokens, a prompt that shares 48 tokens with a running one, a pool too small for
two requests (a preemption).
"""
from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from models import context_model

from minillm import PRESETS
from minillm.bench.cost import step_cost
from minillm.bench.roofline import Ceilings
from minillm.checkpoints.tokenizer import load_tokenizer
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.sampling_params import SamplingParams
from minillm.scheduler import SchedulerConfig
from minillm.sequence import EngineStats, StepStats
from minillm.serving.api_server import make_serving
from minillm.serving.launch import BackgroundServer
from minillm.serving.live import LiveFeed, StepRecorder

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return context_model()


def recording(engine: LLMEngine, watchers: int = 1) -> StepRecorder:
    engine.record_steps = True
    recorder = StepRecorder()
    recorder.watchers = watchers
    return recorder


def step(engine: LLMEngine, recorder: StepRecorder):
    """One engine step, recorded as the server's engine thread records it; returns the record."""
    engine.step()
    recorder.record(engine)
    engine.check_invariants()
    (record,), _ = recorder.since(recorder.count - 1)
    return record


def test_a_long_prompt_is_cut_into_chunks_beside_the_running_decodes(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=67, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=64))
    recorder = recording(engine)
    decoders = [engine.add_request([i + 1] * 8, GREEDY) for i in range(3)]
    first = step(engine, recorder)
    assert first.stats.rows == tuple((d, False, 8, 0) for d in decoders) and first.stats.num_sampled == 3
    long = engine.add_request(list(range(10, 110)), GREEDY)
    chunk1, chunk2 = step(engine, recorder), step(engine, recorder)
    assert chunk1.stats.rows == (*((d, True, 1, 8) for d in decoders), (long, False, 64, 0))
    assert chunk2.stats.rows == (*((d, True, 1, 9) for d in decoders), (long, False, 36, 64))
    assert (chunk1.stats.num_sampled, chunk2.stats.num_sampled) == (3, 4)  # the last chunk yields a token
    assert chunk2.running == (*decoders, long) and chunk2.prefix_hits == ()
    assert [r.step for r in recorder.since(0)[0]] == [0, 1, 2]


def test_a_shared_prefix_is_a_hit_and_the_two_tables_hold_the_same_blocks(model):
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=64, enable_prefix_caching=True))
    recorder = recording(engine)
    shared = list(range(100, 148))  # 48 tokens: 3 blocks of 16
    a = engine.add_request(shared + [1] * 8, GREEDY)
    step(engine, recorder)
    b = engine.add_request(shared + [2] * 8, GREEDY)
    record = step(engine, recorder)
    assert record.prefix_hits == ((b, 48),)
    assert record.stats.rows[-1] == (b, False, 8, 48)
    assert record.tables[a][:3] == record.tables[b][:3] and set(record.tables[a][3:]).isdisjoint(record.tables[b])
    assert step(engine, recorder).prefix_hits == ()  # a hit is counted at the step that admits, once


def test_the_samples_of_a_request_show_as_one_table_their_shared_blocks_once(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8),
                       cache_config=CacheConfig(num_gpu_blocks_override=64, block_size=4))
    recorder = recording(engine)
    rid = engine.add_request(list(range(100, 110)), SamplingParams(temperature=1.0, seed=0, max_tokens=9, n=3,
                                                                   ignore_eos=True))
    forked = step(engine, recorder)  # the prompt: 2 full blocks and a partial one, all three samples on them
    assert len(forked.tables[rid]) == 3
    written = step(engine, recorder)  # each sample wrote its token: two copies of the partial block, in place once
    assert len(written.tables[rid]) == 3 + 2 and written.tables[rid][:2] == forked.tables[rid][:2]


def test_a_preempted_request_is_named_and_comes_back_as_a_prefill_of_its_prompt_and_output(model):
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=8))
    recorder = recording(engine)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    old, new = engine.add_request([5] * 8, params), engine.add_request([6] * 8, params)
    records = [step(engine, recorder)]
    while not records[-1].stats.preempted:
        assert engine.has_unfinished_requests(), "the pool was meant to be too small for both requests"
        records.append(step(engine, recorder))
    preempting = records[-1]
    assert preempting.stats.preempted == (new,) and new not in preempting.running
    assert preempting.waiting == (new,) and preempting.num_waiting == 1
    while engine.has_unfinished_requests():
        records.append(step(engine, recorder))
    back = next(r for r in records if any(row[0] == new and not row[1] for row in r.stats.rows) and
                r.step > preempting.step)
    row = next(row for row in back.stats.rows if row[0] == new)
    generated = sum(1 for r in records[:preempting.step] for x in r.stats.rows if x[0] == new)  # a token per row
    assert generated > 0 and row[3] == 0 and row[2] == 8 + generated, \
        "recomputed from its first token: its prompt and all it had generated"


def fake_engine(n_running: int = 0):
    """Just what StepRecorder reads, with a fresh `last_step` per call of `advance`."""
    seqs = [SimpleNamespace(request_id=f"r{i}", seq_id=i) for i in range(n_running)]
    scheduler = SimpleNamespace(running=seqs, waiting=deque())
    blocks = SimpleNamespace(block_tables={i: [i] for i in range(n_running)}, allocator=SimpleNamespace(),
                             num_blocks=16, num_free_blocks=16 - n_running)
    engine = SimpleNamespace(stats=lambda *a, **k: EngineStats.of(scheduler, blocks, *a, **k))

    def advance():
        engine.last_step = StepStats(time.perf_counter(), 0.001, 0, n_running, n_running, 0, 10,
                                     tuple((s.request_id, True, 1, 5) for s in seqs), (), n_running)
        return engine
    return advance


def test_the_ring_keeps_the_last_capacity_steps_and_a_reader_a_lap_behind_gets_none_wrong():
    advance, recorder = fake_engine(2), StepRecorder(capacity=4)
    for _ in range(10):
        engine = advance()
        recorder.record(engine)
    recorder.record(engine)  # no new step (one that only reported aborts): nothing is recorded
    records, next_step = recorder.since(0)
    assert [r.step for r in records] == [6, 7, 8, 9] and next_step == 10
    assert [r.step for r in recorder.since(8)[0]] == [8, 9] and recorder.since(10) == ([], 10)
    recorder._slots[7 % 4] = recorder._slots[6 % 4]  # step 7's slot holds another step (the writer lapped)
    assert [r.step for r in recorder.since(6)[0]] == [6, 8, 9]


def test_nobody_watching_means_no_block_map_is_copied():
    advance, recorder = fake_engine(3), StepRecorder()
    recorder.record(advance())
    recorder.watchers = 1
    recorder.record(advance())
    (unwatched, watched), _ = recorder.since(0)
    assert unwatched.tables is None and watched.tables == {"r0": (0,), "r1": (1,), "r2": (2,)}
    assert unwatched.running == watched.running == ("r0", "r1", "r2")


def test_the_prediction_is_the_slower_of_the_step_s_flops_and_its_bytes_at_the_measured_ceilings(model):
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=16))
    config = PRESETS["tiny"]
    compute_bound = Ceilings("test", "float32", matmul_flops=1e9, bandwidth=1e18, matmul_size=0, copy_bytes=0)
    memory_bound = Ceilings("test", "float32", matmul_flops=1e18, bandwidth=1e9, matmul_size=0, copy_bytes=0)
    feed = LiveFeed(engine, SimpleNamespace(alive=True), "tiny", ceilings=compute_bound)
    rows = (("a", True, 1, 30), ("b", False, 64, 0))
    done = StepStats(0.0, 0.01, 64, 1, 2, 0, 10, rows, (), 2)  # b's chunk ends its prompt: two LM-head rows
    cut = StepStats(0.0, 0.01, 64, 1, 2, 0, 10, rows, (), 1)   # b's prompt goes on: one
    cost = step_cost(config, [1, 64], [30, 0], lm_head_rows=2)
    assert feed.predicted_s(done, compute_bound) == pytest.approx(cost.flops / 1e9)
    assert feed.predicted_s(done, memory_bound) == pytest.approx(cost.bytes / 1e9)
    lm_head = 2 * config.vocab_size * config.n_embd
    assert feed.predicted_s(done, compute_bound) - feed.predicted_s(cut, compute_bound) == pytest.approx(lm_head / 1e9)


def events(response, n: int) -> list[tuple[str, str, dict]]:
    """The first n server-sent events of a stream: (event, id, data)."""
    out, fields = [], {}
    for line in response.iter_lines():
        if not line:
            out.append((fields.get("event", "message"), fields.get("id"), json.loads(fields["data"])))
            fields = {}
            if len(out) == n:
                return out
        else:
            key, _, value = line.partition(": ")
            fields[key] = value
    raise AssertionError(f"the feed ended after {len(out)} events")


def test_the_feed_sends_the_engine_the_ceilings_then_each_step_and_resumes_after_last_event_id(model):
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=67, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=64, enable_prefix_caching=True))
    with BackgroundServer(make_serving(engine, load_tokenizer("tiny"), "tiny")) as server:
        body = {"prompt": list(range(10, 110)), "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        recorder = server.serving.live.recorder
        with httpx.stream("GET", server.url + "/v1/engine/events", timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            (e0, _, info), (e1, _, ceilings), *steps = events(r, 2 + 4)
            assert recorder.watchers == 1
        assert (e0, e1) == ("engine", "ceilings") and info["max_num_batched_tokens"] == 67
        assert info["num_blocks"] == 64 and info["prefix_caching"] and ceilings["matmul_flops"] > 0
        assert [(e, i) for e, i, _ in steps] == [("step", "0"), ("step", "1"), ("step", "2"), ("step", "3")]
        assert [(s["prefill_tokens"], s["decode_tokens"]) for _, _, s in steps] == [(67, 0), (33, 0), (0, 1), (0, 1)]
        assert steps[0][2]["tables"] is None, "recorded before anyone watched: no block map"
        assert all(s["predicted_s"] > 0 and s["duration_s"] > 0 for _, _, s in steps)
        with httpx.stream("GET", server.url + "/v1/engine/events", headers={"Last-Event-ID": "1"}, timeout=60) as r:
            assert [i for _, i, _ in events(r, 2 + 2)[2:]] == ["2", "3"]
        deadline = time.monotonic() + 10
        while recorder.watchers and time.monotonic() < deadline:  # the feed notices its client left
            time.sleep(0.05)
        assert recorder.watchers == 0


def test_the_page_is_served_from_the_package_and_reads_the_feed():
    engine = LLMEngine(context_model(),
                       SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=8))
    with BackgroundServer(make_serving(engine, load_tokenizer("tiny"), "tiny")) as server:
        page = httpx.get(server.url + "/live", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'new EventSource("/v1/engine/events")' in page.text
    assert '"minillm.serving" = ["live.html"]' in (ROOT / "pyproject.toml").read_text(), \
        "an installed package must carry the page: pyproject's package-data"


def test_a_watcher_who_leaves_mid_history_is_sent_nothing_more(model, caplog):
    """A new watcher is sent the last steps at once; one who leaves in the middle of them must not be written to
    again (uvicorn drops what is sent to a closed connection silently, and asyncio then logs each write)."""
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=64))
    with BackgroundServer(make_serving(engine, load_tokenizer("tiny"), "tiny")) as server:
        body = {"prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True}
        for _ in range(3):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        recorder = server.serving.live.recorder
        assert recorder.count >= 300
        with caplog.at_level("WARNING", logger="asyncio"):
            with httpx.stream("GET", server.url + "/v1/engine/events", timeout=60) as r:
                events(r, 3)
            deadline = time.monotonic() + 10
            while recorder.watchers and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
        assert recorder.watchers == 0
        assert not [r for r in caplog.records if "socket.send" in r.getMessage()], "the feed wrote to a closed socket"
