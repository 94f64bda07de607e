"""Faults: a step that raises leaves no trace, one engine per thread, and the API refuses what it cannot serve.

Every equivalence runs on a model whose next token depends on its context
(tests/models.py), so a request served keys and values that were never written
gets other tokens.
"""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm import sampling as sampling_module  # the engine samples through sampling.sample
from minillm import kv_cache
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.parallel_sampling import group_blocks
from minillm.sampling import NonFiniteLogitsError
from minillm.scheduler import SchedulerConfig
from models import context_model, random_prompts

CFG = PRESETS["tiny"]
TESTS = Path(__file__).parent


class Fault(Exception):
    """The exception these tests inject."""


@pytest.fixture(scope="module")
def model():
    return context_model()


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def reference(model, prompt, params):
    return kv_cache.generate(model, [prompt], params)[0]


def fail_on_call(obj, name: str, on_call: int = 1, exc: BaseException | type = Fault):
    """Make `obj.name` raise `exc` on its `on_call`-th call (before doing anything), then behave again."""
    real, calls = getattr(obj, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise exc
        return real(*args, **kwargs)
    setattr(obj, name, failing)
    return calls


def drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, f"request {out.request_id} was reported after it finished"
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    assert engine.requests == {}
    return finals


# ---- finding 1: an interrupted step and the prefix cache ---------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("then", ["abort", "continue"])
def test_an_interrupted_step_leaves_no_unwritten_block_in_the_prefix_cache(model, chunked, then):
    """The issue's reproduction: a 64-token prompt, raise in the first `cache.attend` of its step, abort (or
    carry on), then the same prompt plus three tokens: the logits it samples from are a full recompute's."""
    prompt = random_prompts(1, [64], seed=31)[0]
    engine = LLMEngine(model,
                       SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, enable_chunked_prefill=chunked),
                       cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=32, enable_prefix_caching=True))
    rid = engine.add_request(prompt, greedy(4))
    fail_on_call(engine.cache, "attend")
    with pytest.raises(Fault):
        engine.step()
    if then == "abort":
        assert engine.abort_request(rid)
    first = drain(engine)[rid]
    if then == "continue":
        assert first.output_token_ids == reference(model, prompt, greedy(4)), "the retried step lost nothing"
    else:
        assert first.finish_reason == "abort" and first.output_token_ids == []
    seen, real_sample = [], sampling_module.sample

    def recording_sample(logits, params, generators):
        seen.append(logits.clone())
        return real_sample(logits, params, generators)
    sampling_module.sample = recording_sample
    try:
        longer = prompt + [5, 6, 7]
        (out,) = engine.generate([longer], greedy(3))
    finally:
        sampling_module.sample = real_sample
    assert out.output_token_ids == reference(model, longer, greedy(3))
    with torch.inference_mode():
        for j, logits in enumerate(seen):
            full = model(torch.tensor([longer + out.output_token_ids[:j]]))[0, -1]
            torch.testing.assert_close(logits[0], full, atol=1e-4, rtol=1e-4)
    assert out.num_cached_tokens == (64 if then == "continue" else 0), "only blocks a step wrote are shared"


def test_a_request_that_shared_a_block_of_the_failed_step_is_recomputed(model):
    """Two requests admitted in one step share a block the first one is to write; the step fails. The sharer
    must not keep a block that holds nothing: it goes back to the queue, and both finish with their own tokens."""
    system = random_prompts(1, [40], seed=5)[0]
    prompts = [system + tail for tail in random_prompts(2, [5], seed=6)]
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=8, num_gpu_blocks_override=32, enable_prefix_caching=True))
    ids = [engine.add_request(p, greedy()) for p in prompts]
    fail_on_call(engine.cache, "attend", on_call=2)  # layer 0 wrote the step's keys, then layer 1 fails
    with pytest.raises(Fault):
        engine.step()
    engine.check_invariants()
    assert [s.request_id for s in engine.scheduler.running] == ids[:1]
    assert [s.request_id for s in engine.scheduler.waiting] == ids[1:], "the sharer waits, holding no block"
    assert engine.block_manager.num_prompt_tokens == 45, "the sharer's admission in the failed step is not counted"
    finals = drain(engine)
    assert [finals[i].output_token_ids for i in ids] == [reference(model, p, greedy()) for p in prompts]
    assert [finals[i].num_cached_tokens for i in ids] == [0, 40]


SIGINT_CHILD = textwrap.dedent("""
    import json, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a parent run in the background left it ignored
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    from minillm import SamplingParams, kv_cache
    from minillm.engine import LLMEngine
    from minillm.kv_pool import CacheConfig
    from models import context_model, random_prompts

    model = context_model()
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = random_prompts(1, [64], seed=31)[0]
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=32,
                                                       enable_prefix_caching=True))
    rid = engine.add_request(prompt, greedy)
    attend = engine.cache.attend
    def slow_attend(*args):  # the first layer of the step: say so, and wait for Ctrl-C
        engine.cache.attend = attend
        print("in step", flush=True)
        time.sleep(60)
    engine.cache.attend = slow_attend
    try:
        engine.step()
        sys.exit("the step was not interrupted")
    except KeyboardInterrupt:
        pass
    engine.abort_request(rid)
    longer = prompt + [5, 6, 7]
    (out,) = engine.generate([longer], greedy)
    try:
        engine.check_invariants()
        broken = None
    except AssertionError as e:
        broken = str(e)
    print(json.dumps(dict(tokens=out.output_token_ids, want=kv_cache.generate(model, [longer], greedy)[0],
                          cached=out.num_cached_tokens, broken=broken)))
""")


def test_a_real_sigint_mid_step_in_a_child_process(tmp_path):
    """Ctrl-C delivered as a real SIGINT while a child's step is inside the forward pass; the child then aborts
    the request and generates the same prompt plus three tokens, as the issue's probe did."""
    script = tmp_path / "child.py"
    script.write_text(SIGINT_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(script), str(TESTS)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line == "in step\n", f"the child never reached its step: {line!r} {child.stderr.read()}"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] == result["want"] and result["cached"] == 0 and result["broken"] is None, result


# ---- the fuzz: faults at random points of random steps -----------------------------------------------------


def fault_trace(seed: int) -> dict:
    """A random engine and arrival trace with shared prefixes, and faults at random points of random steps."""
    rng = random.Random(seed)
    bs = rng.choice([1, 3, 5, 16])
    chunked = rng.random() < 0.6
    max_seqs = rng.randint(1, 5)
    budget = max(max_seqs, rng.choice([max_seqs, 3, 7, 16, 64, 2048]) if chunked else 2048)
    system = [rng.randrange(CFG.vocab_size) for _ in range(40)]
    prompts = []
    for _ in range(rng.randint(2, 7)):
        head = rng.choice([system[:rng.randint(1, 40)], list(rng.choice(prompts)) if prompts else [], []])
        prompts.append((head + [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(0, 8))])[:60] or [1])
    params = [replace(greedy(rng.randint(1, 10)), n=rng.choice([1, 1, rng.randint(1, max_seqs)]))
              for _ in prompts]  # some of n greedy samples: each the reference, their blocks shared
    need = max(group_blocks(len(p), len(p) + sp.max_tokens - 1, sp.n, bs) for p, sp in zip(prompts, params))
    num_blocks = need + rng.randint(0, 100 // bs)
    arrivals = sorted(rng.randint(0, 8) for _ in prompts)
    faults = {step: (rng.choice(FAULT_POINTS), rng.randint(1, 3), rng.random() < 0.5, rng.random())
              for step in rng.sample(range(25), rng.randint(1, 6))}
    return dict(config=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                       enable_chunked_prefill=chunked), bs=bs, prompts=prompts, params=params,
                num_blocks=num_blocks, arrivals=arrivals, faults=faults)


# Where a step can fail: (object, method) pairs, and whether the fault comes before or after the real call.
FAULT_POINTS = ["attend", "attend+", "prepare", "forward+", "sample", "sample+", "append_slots", "append_slots+",
                "free+", "commit", "copy_blocks", "copy_blocks+"]


def arm(engine, point: str, on_call: int) -> callable:
    """Make the `on_call`-th call at `point` raise Fault, before the real call or (with +) after it; returns
    the function that disarms it."""
    name, after = point.rstrip("+"), point.endswith("+")
    owner = {"attend": engine.cache, "prepare": engine.cache, "copy_blocks": engine.cache, "forward": engine.model,
             "sample": sampling_module,
             "append_slots": engine.block_manager, "free": engine.block_manager,
             "commit": engine.block_manager}[name]
    real, calls = getattr(owner, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call and not after:
            raise Fault(point)
        result = real(*args, **kwargs)
        if calls[0] == on_call:
            raise Fault(point)
        return result
    setattr(owner, name, failing)
    return lambda: setattr(owner, name, real) if owner is sampling_module else delattr(owner, name)


def run_fault_trace(model, seed: int) -> int:
    """Replay a trace, injecting its faults; after each fault abort a random request or carry on. Every
    request is reported exactly once; a finished one has kv_cache.generate's tokens, an aborted one a prefix of
    them; the blocks are checked after every step, failed ones included, and none leaks."""
    t = fault_trace(seed)
    engine = LLMEngine(model, t["config"],
                       cache_config=CacheConfig(block_size=t["bs"], num_gpu_blocks_override=t["num_blocks"],
                                                enable_prefix_caching=True))
    ids, finals, step, faults = {}, {}, 0, 0
    while len(ids) < len(t["prompts"]) or engine.has_unfinished_requests():
        for i, at in enumerate(t["arrivals"]):
            if at == step:
                ids[i] = engine.add_request(t["prompts"][i], t["params"][i])
        fault = t["faults"].get(step)
        disarm = arm(engine, fault[0], fault[1]) if fault else None
        try:
            outs, failed = engine.step(), False
        except Fault:
            outs, failed, faults = [], True, faults + 1
        finally:
            if disarm:
                disarm()
        if failed and fault[2] and engine.requests:
            engine.abort_request(sorted(engine.requests)[int(fault[3] * len(engine.requests))])
        for out in outs:
            assert out.request_id not in finals, f"trace {seed}: {out.request_id} reported twice: {t}"
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < 500, f"trace {seed} did not finish: {t}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, f"trace {seed} leaked: {t}"
    assert engine.requests == {} and set(finals) == set(ids.values()), f"trace {seed}: a request vanished: {t}"
    admitted = [o for o in finals.values() if o.num_cached_tokens is not None]
    bm = engine.block_manager
    assert (bm.num_prompt_tokens, bm.num_cached_prompt_tokens) == \
        (sum(len(o.prompt_token_ids) for o in admitted), sum(o.num_cached_tokens for o in admitted)), \
        f"trace {seed}: the hit rate counts an admission twice, or one that no request reports: {t}"
    for i, rid in ids.items():
        want = reference(model, t["prompts"][i], replace(t["params"][i], n=1))
        for sample in finals[rid].outputs:
            n = len(sample.token_ids) if sample.finish_reason == "abort" else len(want)
            assert sample.token_ids == want[:n], f"trace {seed}, request {i}, sample {sample.index} diverged: {t}"
    return faults


def test_fuzz_faults_at_random_points_of_random_steps(model, one_thread):
    assert sum(run_fault_trace(model, seed) for seed in range(30)) > 0, "the fuzz was meant to inject faults"


@pytest.mark.slow
def test_fuzz_faults_many_traces(model, one_thread):
    assert sum(run_fault_trace(model, seed) for seed in range(30, 270)) > 0  # 240 traces, about 200 faults


# ---- finding 4: an abort is reported even when the next step raises ----------------------------------------


@pytest.mark.parametrize("failure", ["non-finite logits", "Ctrl-C"])
def test_an_abort_is_reported_even_when_the_next_step_raises(model, monkeypatch, failure):
    prompts = random_prompts(2, [5], seed=21)
    engine = LLMEngine(model, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                       cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    aborted, other = (engine.add_request(p, greedy()) for p in prompts)
    engine.step()
    assert engine.abort_request(aborted)
    if failure == "Ctrl-C":
        fail_on_call(engine.cache, "attend", exc=KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    else:
        forward = model.forward

        def nan_forward(*args, **kwargs):
            return forward(*args, **kwargs) * float("nan")
        monkeypatch.setattr(model, "forward", nan_forward)
        with pytest.raises(NonFiniteLogitsError):
            engine.step()
        monkeypatch.undo()
    finals = drain(engine)
    assert finals[aborted].finish_reason == "abort" and len(finals[aborted].output_token_ids) == 1
    want = "abort" if failure == "non-finite logits" else "length"
    assert finals[other].finish_reason == want


# ---- finding 3: one engine, one thread ---------------------------------------------------------------------


@pytest.mark.parametrize("call", ["step", "add_request", "abort_request", "generate"])
def test_a_second_thread_is_refused_while_a_call_runs(model, call):
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=32))
    rid = engine.add_request([1, 2, 3], greedy(3))
    inside, release = threading.Event(), threading.Event()
    attend = engine.cache.attend

    def held_attend(*args):
        engine.cache.attend = attend
        inside.set()
        assert release.wait(60)
        return attend(*args)
    engine.cache.attend = held_attend
    owner = threading.Thread(target=engine.step, name="owner")
    owner.start()
    try:
        assert inside.wait(60)
        args = {"step": (), "add_request": ([4, 5],), "abort_request": (rid,), "generate": ([[4, 5]],)}[call]
        with pytest.raises(RuntimeError, match=r"step\(\) in thread 'owner' is running: one engine, one thread"):
            getattr(engine, call)(*args)
    finally:
        release.set()
        owner.join(60)
    assert list(engine.requests) == [rid], "the refused call changed nothing"
    finals = drain(engine)
    assert finals[rid].output_token_ids == reference(model, [1, 2, 3], greedy(3))


def test_the_queue_pattern_of_the_docstring_serves_other_threads(model):
    """One thread owns the engine; two others hand it requests through a queue and get their outputs back."""
    import queue
    engine = LLMEngine(model, cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=64))
    inbox, outbox = queue.Queue(), queue.Queue()
    prompts = random_prompts(6, [3, 7], seed=41)

    def owner():
        served = 0
        while served < len(prompts):
            while not inbox.empty() or not engine.has_unfinished_requests():
                engine.add_request(*inbox.get())
            for out in engine.step():
                outbox.put(out)
                served += out.finished

    def client(part):
        for i in part:
            inbox.put((prompts[i], greedy(4), f"r{i}"))
    threads = [threading.Thread(target=owner)] + [threading.Thread(target=client, args=(part,))
                                                  for part in (range(0, 3), range(3, 6))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    finals = {}
    while not outbox.empty():
        out = outbox.get()
        if out.finished:
            finals[out.request_id] = out.output_token_ids
    assert finals == {f"r{i}": reference(model, p, greedy(4)) for i, p in enumerate(prompts)}


# ---- finding 13: the API refuses what it cannot serve -----------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(request_id=7), r"request_id=7 is a int; it must be a str"),
    (dict(request_id=b"x"), r"request_id=b'x' is a bytes"),
    (dict(arrival_time="now"), r"arrival_time='now' must be a time.perf_counter\(\) reading"),
    (dict(arrival_time=float("nan")), r"arrival_time=nan"),
    (dict(arrival_time=time.time() + 1e9), r"no later than now.*time.time\(\) is another clock"),
    (dict(params=SamplingParams(stop_token_ids=[CFG.vocab_size])),
     rf"stop token id {CFG.vocab_size} is outside the vocabulary of {CFG.vocab_size} tokens"),
])
def test_add_request_checks_every_argument(model, kwargs, match):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2], **kwargs)
    assert engine.requests == {} and not engine.has_unfinished_requests()


def test_an_arrival_time_in_the_past_is_kept(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    arrived = time.perf_counter() - 5.0
    engine.add_request([1, 2], greedy(1), arrival_time=arrived)
    (out,) = engine.step()
    assert out.metrics.arrival_time == arrived and out.metrics.ttft >= 5.0


def test_a_closed_engine_takes_no_request(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=8))
    engine.close()
    with pytest.raises(RuntimeError, match="this engine was closed"):
        engine.add_request([1, 2])
    with pytest.raises(RuntimeError, match="this engine was closed"):
        engine.generate([[1, 2]])


def test_scheduler_config_must_be_a_scheduler_config(model):
    with pytest.raises(ValueError, match=r"scheduler_config is a dict; pass a SchedulerConfig, e\.g\. "
                                         r"SchedulerConfig\(\*\*\{'max_num_seqs': 4\}\)"):
        LLMEngine(model, {"max_num_seqs": 4}, cache_config=CacheConfig(num_gpu_blocks_override=8))


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_enable_chunked_prefill_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"enable_chunked_prefill={value!r} must be True or False"):
        SchedulerConfig(enable_chunked_prefill=value)


# ---- finding 14: generate() ---------------------------------------------------------------------------------


def test_generate_refuses_while_requests_added_earlier_are_pending(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    earlier = engine.add_request([1, 2, 3], greedy(3))
    with pytest.raises(RuntimeError, match=r"but 1 earlier request\(s\) still wait or run"):
        engine.generate([[4, 5]], greedy(3))
    assert list(engine.requests) == [earlier], "nothing was queued"
    assert drain(engine)[earlier].output_token_ids == reference(model, [1, 2, 3], greedy(3))
    engine.add_request([6, 7], greedy(1))
    engine.add_request([8], greedy(1))
    with pytest.raises(RuntimeError, match=r"but 2 earlier request\(s\) still wait or run"):
        engine.generate([[4, 5]], greedy(3))
    drain(engine)
    aborted = engine.add_request([9], greedy(1))
    engine.abort_request(aborted)
    (out,) = engine.generate([[4, 5]], greedy(3))  # an abort not yet reported does not stop it...
    assert out.output_token_ids == reference(model, [4, 5], greedy(3))
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(aborted, "abort")], "...nor is it lost"


def test_generate_checks_every_prompt_before_queueing_any(model):
    engine = LLMEngine(model, cache_config=CacheConfig(num_gpu_blocks_override=16))
    with pytest.raises(ValueError, match=r"prompt 2: .*no prompt was queued"):
        engine.generate([[1, 2], [3], "text"], greedy(3))
    assert engine.requests == {} and not engine.has_unfinished_requests()
    assert [o.output_token_ids for o in engine.generate([[1, 2]], greedy(3))] == [reference(model, [1, 2], greedy(3))]
