"""Static-shape decode and CUDA graphs: buckets, padding, equivalence, and the static-shape proof on the CPU.

The graph itself needs CUDA (the `gpu` tests at the end); everything it
replays, the padded step on buffers allocated once, runs here on the CPU, on a
model whose tokens depend on their context (tests/models.py).
"""
import random

import pytest
import torch

from minillm import PRESETS, SamplingParams, cuda_graphs, kv_cache
from minillm.cuda_graphs import DecodeRunner, batch_buckets, bucket, width_buckets
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.kv_cache import KVCache, Segment
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts
from test_engine import run_fuzz

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model():
    return context_model()


def static_engine(model, config=None, mode="static", **cache):
    engine = LLMEngine(model, config, CacheConfig(**cache))
    engine.decoder = DecodeRunner(model, engine.cache, engine.scheduler_config.max_num_seqs, mode)
    return engine


# ---- buckets ----------------------------------------------------------------------------------


def test_batch_buckets_are_vllms_and_every_batch_has_one():
    assert batch_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert batch_buckets(10) == [1, 2, 4, 8, 10] and batch_buckets(1) == [1] and batch_buckets(3) == [1, 2, 3]
    sizes = batch_buckets(37)
    assert all(n <= bucket(n, sizes) <= max(2 * n, 8) for n in range(1, 38))  # padding < 2× (or to 8)


def test_width_buckets_double_up_to_a_whole_context():
    assert width_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and width_buckets(7) == [1, 2, 4, 7]
    sizes = width_buckets(50)
    assert all(w <= bucket(w, sizes) < 2 * w for w in range(2, 51))


# ---- the padded step gives the eager step's logits ----------------------------------------------


@pytest.mark.parametrize("bounds", [{}, {"static": 1}, {"eager": 1}], ids=["one-gather", "static-rows", "eager-rows"])
def test_static_decode_logits_equal_eager_while_the_batch_changes(model, bounds):
    """Prompts of different lengths finish at different steps: the batch shrinks through the buckets 8 → 4 →
    2 → 1 with padding rows in between, and block tables cross width buckets; every row's logits equal those of
    the exact-shaped step (fp32: 1e-5). Gathered one row at a time (`gather_bytes` 1) on one side, in one copy
    on the other, too."""
    prompts = random_prompts(7, [2, 5, 13, 30], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 16, 9, 12, 5, 18, 7)]
    got = {}
    for mode in ("eager", "static"):
        engine = static_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), block_size=4,
                               num_gpu_blocks_override=200, mode=mode)
        engine.cache.gather_bytes = bounds.get(mode)
        seen, run = [], engine.decoder.run

        def recording(segments, tokens, run=run, seen=seen):
            logits = run(segments, tokens)
            seen.append(({(s.seq_id, s.start) for s in segments}, logits.clone()))
            return logits
        engine.decoder.run = recording
        outs = engine.generate(prompts, params)
        got[mode] = ([o.output_token_ids for o in outs], seen)
    assert got["eager"][0] == got["static"][0] == [kv_cache.generate(model, [p], sp)[0] for p, sp in zip(prompts,
                                                                                                         params)]
    sizes = {len(keys) for keys, _ in got["static"][1]}
    assert sizes - set(batch_buckets(8)), f"the batch was meant to pass through padded sizes, got {sizes}"
    for (_, eager), (_, static) in zip(got["eager"][1], got["static"][1]):
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_static_engine_fuzz(model, seed):
    """The engine's random traces (arrivals, aborts, preemption, block sizes 1–16) with every decode step
    padded to its buckets: no wrong token, no leaked block."""
    run_fuzz(model, seed, decode_mode="static")


def test_padding_rows_write_only_the_pad_block(model):
    """Three decoding requests run as 4 rows: the padding row writes the pad block, and no other block that
    a request does not hold is touched."""
    engine = static_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), block_size=4,
                           num_gpu_blocks_override=40)
    engine.cache.pool.fill_(0)
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [4, 4, 4]
    pool = engine.cache.pool
    assert pool[:, engine.cache.pad_block].abs().sum() > 0, "the 3-row steps were meant to pad to 4 rows"
    held = -(-8 // 4) * 3  # at most 8 tokens of KV each, in blocks of 4, taken from the front of the free list
    assert pool[:, held:engine.cache.pad_block].abs().sum() == 0, "a padding row wrote outside the pad block"


# ---- the contiguous cache -----------------------------------------------------------------------


@torch.inference_mode()
def test_static_decode_on_the_contiguous_cache(model):
    """Three live rows of a 4-row cache at different lengths, padded to 4 rows and 2 width units: the logits of the
    exact eager step, and the padding row writes only the row outside the step."""
    prompts = random_prompts(3, [5, 17, 23], seed=9)
    cache = KVCache(CFG, 4, 64)
    for row, p in enumerate(prompts):
        meta = cache.prepare([Segment(row, 0, len(p))])
        model(torch.tensor([p]), meta.positions, cache=cache)
    before = cache.k[:, :3].clone()
    segments = [Segment(row, len(p), 1, True) for row, p in enumerate(prompts)]
    tokens = [p[0] for p in prompts]
    meta = cache.prepare(segments)
    eager = model(torch.tensor(tokens)[:, None], meta.positions, cache=cache)[:, -1]
    cache.k[:, :3] = before  # undo the eager step's writes
    runner = DecodeRunner(model, cache, 4, "static")
    assert runner.shape(segments) == (4, 2)
    torch.testing.assert_close(runner.run(segments, tokens), eager, atol=1e-5, rtol=1e-5)
    for row, p in enumerate(prompts):  # the live rows hold exactly their own tokens' keys
        torch.testing.assert_close(cache.k[:, row, :, :len(p)], before[:, row, :, :len(p)])


# ---- static shapes, proved by a compiler ----------------------------------------------------------


def compiled_decode_steps(model, mode, steps, batch_range, prompt_range, max_tokens_range):
    """Run an engine whose decode forward is torch.compile'd (backend eager, static shapes) for `steps` decode
    steps, while requests join and leave; return (compiles, steps run, batch sizes seen, contexts seen)."""
    torch._dynamo.reset()
    compiles, calls, batches, contexts = [], [0], set(), set()

    def backend(graph_module, example_inputs):
        compiles.append(len(graph_module.graph.nodes))
        return graph_module.forward
    engine = static_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), block_size=16,
                           num_gpu_blocks_override=200, mode=mode)
    compiled = torch.compile(engine.decoder.forward, backend=backend, dynamic=False)
    run = engine.decoder.run

    def counted(input_ids):
        calls[0] += 1
        return compiled(input_ids)

    def recording(segments, tokens):
        batches.add(len(segments))
        contexts.update(s.start + 1 for s in segments)
        return run(segments, tokens)
    engine.decoder.forward, engine.decoder.run = counted, recording
    rng = random.Random(0)
    while calls[0] < steps:
        target = rng.randint(*batch_range)  # requests in flight: the batch grows and shrinks as they come and go
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < target:
            prompt = [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(*prompt_range))]
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(*max_tokens_range),
                                                      ignore_eos=True))
        engine.step()
    return compiles, calls[0], batches, contexts


def test_a_compiled_static_step_never_recompiles_within_its_buckets(model):
    """torch.compile specialises a graph on every shape and every Python value it reads; a step whose shapes
    or metadata changed would recompile. Over 100 decode steps whose batch changes (requests join and leave,
    5 to 8 rows: bucket 8) and whose contexts grow (65 to 128 tokens: block tables of 5 to 8 blocks, bucket 8),
    the static step compiles once. Any recompile raises (error_on_recompile)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiles, steps, batches, contexts = compiled_decode_steps(model, "static", 100, (5, 8), (64, 70), (10, 50))
    assert len(compiles) == 1 and steps >= 100
    assert len(batches) >= 3 and max(batches) <= 8 and min(batches) >= 5, batches
    assert min(contexts) <= 70 and max(contexts) >= 110, "the contexts were meant to grow across the bucket"


def test_the_exact_shaped_step_does_recompile(model):
    """The control: without padding, the same steps change shape and the compiler must recompile."""
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(Exception, match="[Rr]ecompil"):
        compiled_decode_steps(model, "eager", 100, (5, 8), (64, 70), (10, 50))


@pytest.mark.slow
def test_compiles_are_bounded_by_the_buckets_visited(model):
    """Across buckets: one compile per (batch, width) bucket the steps visit, however many steps."""
    compiles, steps, batches, contexts = compiled_decode_steps(model, "static", 60, (1, 3), (2, 40), (5, 60))
    runner_batches, runner_widths = batch_buckets(8), width_buckets(8)
    visited = {(bucket(b, runner_batches), w) for b in batches for w in runner_widths}  # an upper bound
    assert 1 < len(compiles) <= len(visited), (len(compiles), batches)


# ---- memory: profile, sizing, close ------------------------------------------------------------------


def test_profile_steps_run_on_the_cpu(model):
    """The profile run's largest prefill (a budget above n_ctx: several prompts) and largest decode step
    (every row, whole-context tables) have valid shapes; on CUDA the engine measures their peak."""
    from minillm.kv_pool import profile_steps
    prefill, decoder = profile_steps(model, max_num_batched_tokens=300, max_num_seqs=6, block_size=16)
    assert len(prefill()) == 6
    logits = decoder.run_largest()
    assert logits.shape == (1, 6, CFG.vocab_size) and torch.isfinite(logits).all()


class FakeCachingAllocator:
    """torch.cuda's memory figures for a GPU of `total` bytes with a CUDA context, and PyTorch's caching
    allocator: freed tensors stay reserved until empty_cache."""

    def __init__(self, total=80 << 30, context=500 << 20):
        self.total, self.context, self.allocated, self.reserved = total, context, 0, 0

    def alloc(self, n):
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)

    def free(self, n):
        self.allocated -= n

    def empty_cache(self):
        self.reserved = self.allocated

    def mem_get_info(self, device=None):
        return self.total - self.context - self.reserved, self.total

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)


def test_a_second_engine_gets_the_memory_the_first_one_freed(monkeypatch):
    """The GPU check's failure, replayed: weights loaded, a first engine sized from gpu_memory_utilization takes
    its pool and is deleted, and the caching allocator keeps that pool reserved. Sized as total·u − (total −
    free), the second engine found no room ("holds no block"); sized as vLLM does, it gets what the first got."""
    from minillm.kv_pool import gpu_kv_budget
    gpu = FakeCachingAllocator()
    gpu.install(monkeypatch)
    device = torch.device("cuda")
    weights, activations, graphs = 3 << 30, 2 << 30, 1 << 30
    gpu.alloc(weights)
    first = gpu_kv_budget(device, 0.9, activations, graphs)
    gpu.alloc(first)       # the first engine's pool
    gpu.free(first)        # the engine is deleted; the allocator keeps the memory reserved
    free, total = gpu.mem_get_info()
    old_formula = int(total * 0.9) - (total - free) - activations - graphs
    assert old_formula < 1 << 20, "the replay should reproduce the failure of the old sizing"
    assert gpu_kv_budget(device, 0.9, activations, graphs) == first
    expected = int(gpu.total * 0.9) - gpu.context - weights - activations - graphs
    assert first == expected
    gpu.alloc(first)       # a live engine still holds its pool: a second one must not count on it
    assert gpu_kv_budget(device, 0.9, activations, graphs) == expected - first


def test_close_frees_the_pool_and_the_engine_says_so(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    pool = engine.cache.pool
    import weakref
    alive = weakref.ref(pool)
    del pool
    engine.close()
    assert alive() is None, "close() must drop every reference to the pool"
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
    engine.close()  # twice is harmless


class FakeGraph:
    """What `DecodeRunner._record` returns, without CUDA: its replay runs the static step it would have captured."""

    def __init__(self, runner, batch, replayed):
        self.runner, self.batch, self.replayed = runner, batch, replayed

    def replay(self):
        r = self.runner
        self.replayed.append(self.key)
        r.logits[:self.batch] = r.forward(r._input_ids(self.batch)).view(self.batch, -1)


def test_an_engine_captures_no_graph_until_a_bucket_is_first_used(model, monkeypatch):
    """Lazy capture, the one CUDA call (`_record`) replaced by the static step it would capture: building captures
    nothing; the first graph step captures the largest bucket (so the shared pool is sized by it), then its own;
    a bucket is never captured twice; and the tokens are still those of kv_cache.generate."""
    recorded, replayed = [], []

    def record(self, batch, width):
        recorded.append((batch, width))
        graph = FakeGraph(self, batch, replayed)
        graph.key = (batch, width)
        return graph
    monkeypatch.setattr(DecodeRunner, "_record", record)
    monkeypatch.setattr(cuda_graphs, "can_capture", lambda device: True)  # graph mode's bookkeeping, on the CPU
    engine = static_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), block_size=4,
                           num_gpu_blocks_override=200, mode="graph")
    assert engine.decoder.mode == "graph" and engine.decoder.graphs == {} and recorded == [] and engine.decoder.logits is None
    prompts = random_prompts(3, [3, 9], seed=4)
    got = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == [kv_cache.generate(model, [p], GREEDY)[0] for p in prompts]
    largest = (engine.decoder.batch_sizes[-1], engine.decoder.widths[-1])
    assert recorded[0] == largest and len(recorded) == len(set(recorded)) == len(engine.decoder.graphs)
    assert set(recorded) == {largest} | set(replayed) and len(set(replayed)) >= 2, (recorded, replayed)
    assert len(recorded) < len(engine.decoder.batch_sizes) * len(engine.decoder.widths)


# ---- on a GPU: the graphs themselves ------------------------------------------------------------------


class Replays(dict):
    """An engine's graphs, noting which (batch, width) buckets were replayed."""
    seen: set

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)


def graph_engine(model, config, enforce_eager=False, **cache):
    engine = LLMEngine(model, config, CacheConfig(**cache), enforce_eager=enforce_eager)
    engine.decoder.graphs = Replays(engine.decoder.graphs)
    engine.decoder.graphs.seen = set()
    return engine


def recorded_decode_logits(engine):
    seen, run = [], engine.decoder.run

    def recording(segments, tokens):
        logits = run(segments, tokens)
        seen.append(logits.float().clone())
        return logits
    engine.decoder.run = recording
    return seen


@pytest.mark.gpu
@cuda
def test_graph_replay_gives_the_eager_tokens_and_logits():
    """The same requests, joining and leaving, through CUDA graphs and through enforce_eager: identical greedy
    tokens, equal to kv_cache.generate, and every decode step's logits equal (fp32: 1e-4)."""
    model = context_model().cuda()
    prompts = random_prompts(7, [2, 5, 13, 30], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 20, 9, 14, 5, 30, 11)]
    want = [kv_cache.generate(model, [p], sp)[0] for p, sp in zip(prompts, params)]
    results = {}
    for eager in (False, True):
        engine = graph_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), block_size=4,
                              num_gpu_blocks_override=200, enforce_eager=eager)
        logits = recorded_decode_logits(engine)
        results[eager] = ([o.output_token_ids for o in engine.generate(prompts, params)], logits, engine)
    assert results[False][2].decoder.mode == "graph" and results[True][2].decoder.mode == "eager"
    assert results[False][0] == results[True][0] == want
    for graph_logits, eager_logits in zip(results[False][1], results[True][1]):
        torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert len(results[False][2].decoder.graphs.seen) >= 4


@pytest.mark.gpu
@cuda
def test_a_batch_crossing_bucket_boundaries_under_graphs():
    """12 requests that finish one after another: the batch runs through the buckets 16, 8, 4, 2, 1, and the
    tables through widths 1 to 8 blocks, each step the replay of its own graph; every token as generated alone."""
    model = context_model().cuda()
    prompts = random_prompts(12, [1, 3, 9, 20], seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=2 + 4 * i, ignore_eos=True) for i in range(12)]
    engine = graph_engine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16), block_size=4,
                          num_gpu_blocks_override=300)
    got = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert got == [kv_cache.generate(model, [p], sp)[0] for p, sp in zip(prompts, params)]
    batches = {b for b, _ in engine.decoder.graphs.seen}
    widths = {w for _, w in engine.decoder.graphs.seen}
    assert {16, 8, 4, 2, 1} <= batches and len(widths) >= 3, engine.decoder.graphs.seen


@pytest.mark.gpu
@cuda
def test_graph_memory_is_accounted_when_the_pool_is_sized():
    """With graphs the pool is smaller than with enforce_eager by about the graphs' memory, and the engine, its
    graphs captured, stays within its share of the GPU."""
    model = context_model(PRESETS["gpt2"]).cuda()
    torch.cuda.empty_cache()
    config = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=32)
    with LLMEngine(model, config, cache_config=CacheConfig(gpu_memory_utilization=0.3), enforce_eager=True) as eager:
        eager_blocks = eager.block_manager.num_blocks
    with LLMEngine(model, config, cache_config=CacheConfig(gpu_memory_utilization=0.3)) as graphs:
        free, total = torch.cuda.mem_get_info()
        memory = graphs.memory
        assert memory["graph_bytes"] > 0 and memory["activation_peak"] > 0
        assert graphs.decoder.graphs == {}  # captured on first use: none yet
        graphs.decoder.capture()  # every bucket, to hold the engine to its share with all of them
        assert len(graphs.decoder.graphs) == len(batch_buckets(32)) * len(width_buckets(64))
        free, total = torch.cuda.mem_get_info()
        fewer = (eager_blocks - graphs.block_manager.num_blocks) * memory["block_bytes"]
        assert 0.5 * memory["graph_bytes"] <= fewer <= 1.5 * memory["graph_bytes"] + (64 << 20)
        assert total - free <= 0.3 * total + (256 << 20), "the engine with its graphs outgrew its share"


@pytest.mark.gpu
@cuda
def test_memory_cached_by_the_allocator_is_no_obstacle_and_close_gives_memory_back():
    """What made the first GPU check fail: memory that PyTorch's caching allocator keeps reserved after its
    tensors are gone (an earlier engine's pool) counted as used. Now an engine gets the same pool with or without
    such a cache, and close() hands its own memory back to the driver."""
    model = context_model(PRESETS["gpt2"]).cuda()
    with LLMEngine(model, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
                   cache_config=CacheConfig(gpu_memory_utilization=0.3)) as engine:
        blocks = engine.block_manager.num_blocks
    free, total = torch.cuda.mem_get_info()
    cached = torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")
    del cached  # freed, but the caching allocator keeps it reserved
    assert torch.cuda.memory_reserved() >= 0.2 * total
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
                       cache_config=CacheConfig(gpu_memory_utilization=0.3))
    assert abs(engine.block_manager.num_blocks - blocks) <= 0.05 * blocks
    reserved = torch.cuda.memory_reserved()
    engine.close()
    assert torch.cuda.memory_reserved() < reserved - engine.memory["kv_budget"] // 2


@pytest.mark.gpu
@cuda
def test_a_decode_step_syncs_once():
    """The token ids come to the host once per step; metadata goes up from pinned memory without a sync."""
    import warnings
    model = context_model().cuda()
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=200))
    for p in random_prompts(5, [3, 40], seed=2):
        engine.add_request(p, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, ignore_eos=True, seed=1))
    counts = []
    while engine.has_unfinished_requests():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    assert max(counts) <= 1 and sum(counts) >= 1, counts
