"""Disaggregated prefill (kv_producer.py, kv_consumer.py): a request prefilled on one worker and decoded on another gets
exactly the tokens one engine gives it, every byte counted, and no block is left behind on either side, whether
the request finishes, is aborted while its KV is on the way, can never fit, or its prefill step fails.

The workers are real processes joined by torch.distributed over gloo, as the lesson and the server run them:
if this machine cannot start two processes or a gloo group, these tests fail and say so.
"""
import functools

import pytest
import torch

from minillm import PRESETS
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.sampling_params import SamplingParams
from minillm.sequence import CompletionOutput, RequestMetrics, RequestOutput
from minillm.scheduler import SchedulerConfig
from minillm.serving.disaggregated import WorkerConfig, Workers

from disagg_models import POISON_TOKENS, failing_model
from models import context_model, random_prompts

CFG = PRESETS["tiny"]
BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0)
FACTORY = functools.partial(context_model, CFG)


def run_all(workers: Workers, prompts, params=GREEDY, timeout=120) -> dict[str, object]:
    ids = [workers.add_request(p, params) for p in prompts]
    done = {}
    while workers.has_unfinished_requests():
        for out in workers.step(timeout):
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def colocated(prompts, params=GREEDY, budget=256):
    engine = LLMEngine(context_model(CFG), SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                       CacheConfig(block_size=BS, num_gpu_blocks_override=64))
    return engine.generate(prompts, params)


def worker(budget: int, blocks: int, core: int, block_size: int = BS) -> WorkerConfig:
    """An engine of `blocks` blocks of `block_size` tokens and a step budget of `budget` tokens, on one core."""
    return WorkerConfig(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                        CacheConfig(block_size=block_size, num_gpu_blocks_override=blocks), cores=[core])


def assert_no_block_held(workers: Workers) -> None:
    for role, s in workers.worker_stats().items():
        assert s["free_blocks"] == s["num_blocks"], f"{role} worker leaked blocks: {s}"
        assert s["running"] == s["waiting"] == s.get("in_flight", 0) == s.get("expected", 0) == 0, (role, s)


@pytest.fixture(scope="module")
def pair():
    """A prefill worker that chunks prompts at 32 tokens, and a decode worker, on cores 0 and 1."""
    prefill = worker(32, 64, core=0)
    decode = worker(256, 64, core=1)
    with Workers.disaggregated(FACTORY, CFG, prefill, decode) as workers:
        yield workers


def test_the_test_model_tells_contexts_apart():
    """Two prompts with the same last token must continue differently, or equal tokens would prove nothing."""
    a, b = [5, 9, 100, 7], [300, 2, 41, 7]
    out = colocated([a, b])
    assert out[0].output_token_ids != out[1].output_token_ids


def test_tokens_are_the_colocated_engines_at_and_off_block_boundaries(pair):
    lengths = [BS, 2 * BS, BS + 5, 7, 1, 3 * BS - 1, 50]  # on a boundary, inside a block, chunked at 32
    prompts = [random_prompts(1, [n], CFG.vocab_size, seed=n)[0] for n in lengths]
    before = pair.worker_stats()
    got = run_all(pair, prompts)
    want = colocated(prompts)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)
    after = pair.worker_stats()
    moved = sum(lengths) * CFG.kv_bytes_per_token(torch.float32)  # 2 · n_layer · n_embd · 4 bytes per token
    assert after["prefill"]["bytes_sent"] - before["prefill"]["bytes_sent"] == moved
    assert after["decode"]["bytes_received"] - before["decode"]["bytes_received"] == moved
    assert_no_block_held(pair)


def test_requests_arriving_while_others_decode_get_the_same_tokens(pair):
    prompts = random_prompts(6, [5, 16, 33, 40], CFG.vocab_size, seed=3)
    ids, done = [], {}
    for p in prompts:  # one at a time: each joins a decode batch already running
        ids.append(pair.add_request(p, GREEDY))
        for out in pair.step(60):
            done[out.request_id] = out
    while pair.has_unfinished_requests():
        for out in pair.step(60):
            done[out.request_id] = out
    assert [done[i].output_token_ids for i in ids] == [o.output_token_ids for o in colocated(prompts)]
    assert_no_block_held(pair)


def test_a_header_that_overtakes_its_registration_waits_for_it(pair):
    """The router registers a request with the decode worker before the prefill worker sees it, but the decode
    worker reads its inbox only between steps: the KV's header may come first. Here it always does (the
    registration is held back until the prompt was prefilled and sent), and the request still gets the colocated
    tokens, not a drain as if it had been aborted."""
    import time
    prompt = random_prompts(1, [BS + 5], CFG.vocab_size, seed=11)[0]
    request_id = pair.add_request(prompt, GREEDY)  # registers it with both workers, the decode worker first...
    assert pair.abort_request(request_id)          # ...so drop that one, and replay the registration late:
    pair.step(60)
    late = "late"
    command = ("add", 10_000, list(prompt), GREEDY, late, time.perf_counter())
    pair._inboxes["prefill"].put(command)
    pair.requests[late] = RequestOutput(late, tuple(prompt), [CompletionOutput(0, [], None)], False,
                                        RequestMetrics(command[-1]))
    deadline = time.monotonic() + 60
    while late not in pair.prefilled_at and time.monotonic() < deadline:
        pair.step(0.05)
    time.sleep(0.2)  # the header is on the decode worker's side by now, with no request registered for it
    pair._inboxes["decode"].put(command)
    done, deadline = {}, time.monotonic() + 60
    while pair.has_unfinished_requests() and time.monotonic() < deadline:
        done |= {out.request_id: out for out in pair.step(1) if out.finished}
    assert late in done, f"the request never finished: its KV was drained as if aborted ({pair.worker_stats()['decode']})"
    assert done[late].finish_reason == "length", pair.failures
    assert done[late].output_token_ids == colocated([prompt])[0].output_token_ids
    assert_no_block_held(pair)


@pytest.fixture(scope="module")
def small_decode_pool():
    """A decode pool of 5 blocks (80 tokens): one long request fills it, and the next one's KV must wait."""
    prefill = worker(256, 64, core=0)
    decode = worker(256, 5, core=1)
    with Workers.disaggregated(functools.partial(failing_model), CFG, prefill, decode) as workers:
        yield workers


def test_a_request_aborted_while_its_kv_waits_for_room_frees_both_sides(small_decode_pool):
    """The long request holds 3 of the 5 blocks and grows to 5; the second needs 3, so once prefilled its KV
    waits on the wire for room, and is aborted there."""
    w = small_decode_pool
    long = w.add_request(random_prompts(1, [40], CFG.vocab_size, seed=1)[0], SamplingParams(max_tokens=38,
                                                                                          temperature=0))
    waiting = w.add_request(random_prompts(1, [40], CFG.vocab_size, seed=2)[0], GREEDY)
    done = {}
    while waiting not in w.prefilled_at:
        done |= {out.request_id: out for out in w.step(60)}
    assert w.abort_request(waiting)
    while w.has_unfinished_requests():
        done |= {out.request_id: out for out in w.step(60)}
    assert done[long].finish_reason == "length" and len(done[long].output_token_ids) == 38
    assert done[waiting].finish_reason == "abort" and done[waiting].output_token_ids == []
    assert_no_block_held(w)


def test_a_prompt_the_decode_pool_can_never_hold_fails_and_frees_both_sides(small_decode_pool):
    w = small_decode_pool
    [out] = run_all(w, [random_prompts(1, [70], CFG.vocab_size, seed=4)[0]], SamplingParams(max_tokens=20))
    assert out.finish_reason == "abort"
    assert "can never hold" in w.failures[out.request_id]
    assert_no_block_held(w)


def test_a_prefill_step_that_fails_mid_forward_fails_its_request_on_both_sides_only(small_decode_pool):
    w = small_decode_pool
    prompts = [random_prompts(1, [POISON_TOKENS], CFG.vocab_size, seed=5)[0],
               random_prompts(1, [21], CFG.vocab_size, seed=6)[0]]
    poisoned = w.add_request(prompts[0], GREEDY)
    done = {}
    while w.has_unfinished_requests():
        for out in w.step(60):
            done[out.request_id] = out
    assert done[poisoned].finish_reason == "abort"
    assert "prefill step failed" in w.failures[poisoned] and "poisoned" in w.failures["prefill worker"]
    [after] = run_all(w, prompts[1:])  # the stream stays in step: the next transfer lands where it should
    assert after.output_token_ids == colocated(prompts[1:])[0].output_token_ids
    assert_no_block_held(w)


def test_workers_with_different_block_sizes_refuse_to_pair():
    prefill = worker(2048, 8, core=0, block_size=16)
    decode = worker(2048, 16, core=1, block_size=8)
    # either worker may be the first to notice; each names both block sizes
    with pytest.raises(RuntimeError, match=r"KV pools differ: \(block_size.*\((16, .*\(8|8, .*\(16), "):
        Workers.disaggregated(FACTORY, CFG, prefill, decode)


@pytest.mark.slow
def test_the_lesson_runs_quick_and_every_figure_it_prints_is_in_its_json(tmp_path):
    import json

    from lesson_checks import assert_lesson_results
    from lessons_support import load_lesson
    lesson = load_lesson("15_disaggregation")
    lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "15_disaggregation.json").read_text())
    assert_lesson_results(doc)
    assert (tmp_path / "15_disaggregation.png").stat().st_size > 0
    fig = doc["figures"]
    assert fig["kv_bytes_per_token"] == 2 * CFG.n_layer * CFG.n_embd * 4
    assert all(r["bytes_sent"] == fig["bytes_moved_per_round"] for r in fig["runs"]["disaggregated"])
    for workers in fig["workers_after"].values():
        for role, s in workers.items():
            assert s["free_blocks"] == s["num_blocks"], (role, s)
    (moved,) = doc["verdict"]["facts"]  # counted by the formula it would be checked against: a fact
    assert moved["value"] == moved["predicted"] == fig["bytes_moved_per_round"]
    assert [c["key"] for c in doc["verdict"]["checks"]] == ["stall_low", "stall_high", "flat", "burst",
                                                            "goodput_heavy", "goodput_light"]


def lesson_round(window=0.020, before=0.005, throughput=100.0, light=(4, 1.0), heavy=(6, 1.0)):
    """One server's round: the stall trace, the burst, and the two mixes, with (requests that met both targets,
    span) for each; requests that miss carry one 50 ms gap."""
    def mix(met, span, total):
        return {"requests": [(0.01, [0.004] * 3)] * met + [(0.01, [0.05])] * (total - met), "span_s": span,
                "gaps_s": [0.004] * 10}
    return {"window_p99_itl_s": window, "itl_before_median_s": before, "long_ttft_s": 0.02, "long_transfer_s": 0.001,
            "throughput": throughput, "bytes_sent": 1000, "mix_0": mix(*light, 4), "mix_2": mix(*heavy, 6)}


def figures(coloc=None, two=None, disagg=None):
    """Colocated: a 4× stall, its streams missing at the heavy mix (2 of 6 met); disaggregated: flat, all met."""
    from lessons_support import load_lesson
    lesson = load_lesson("15_disaggregation")
    runs = {"colocated, 1 thread": [lesson_round(**(coloc or {"heavy": (2, 1.0)}))] * 5,
            "colocated, 2 threads": [lesson_round(**(two or {"heavy": (2, 1.0), "throughput": 150.0}))] * 5,
            "disaggregated": [lesson_round(**(disagg or {"window": 0.006, "throughput": 120.0}))] * 5}
    p = {"fixed_s": 0.001, "stall": 4.0, "stall_band": [2.5, 6.0], "flat": 1.0, "burst": 1.0, "light": 1.0,
         "heavy": 2.0, "heavy_undecided": "", "per_token": 1024, "moved": 1000}
    s = {"streams": 4, "long_prompt": 128, "mixes": [0, 2]}
    return lesson, {"setup": s, "predicted": p, "runs": runs, "bytes_moved_per_round": 1000}


def test_each_check_can_fail():
    """A stall under or over the model's band, a decode worker that stalls too, disaggregated faster than the best
    colocated burst, a heavy mix where it does not win, a light mix where it wins by far: each NOT SUPPORTED, and
    only that check; the goodput ratios count requests meeting both targets (bench/goodput.py)."""
    from minillm.bench.verdict import HOLDS, INCONCLUSIVE, NOT_SUPPORTED
    lesson, f = figures()
    assert [c.outcome() for c in lesson.checks(f)] == [HOLDS] * 6
    heavy = lesson.checks(f)[4]
    assert heavy.median == pytest.approx((6 + 1) / (2 + 1))  # met + 1 over met + 1, the same span
    cases = [dict(coloc={"window": 0.010, "heavy": (2, 1.0)}), dict(coloc={"window": 0.040, "heavy": (2, 1.0)}),
             dict(disagg={"window": 0.010, "throughput": 120.0}), dict(disagg={"window": 0.006, "throughput": 200.0}),
             dict(disagg={"window": 0.006, "throughput": 120.0, "heavy": (1, 1.0)}),
             dict(disagg={"window": 0.006, "throughput": 120.0, "light": (4, 0.5)})]
    for i, case in enumerate(cases):
        outcomes = [c.outcome() for c in lesson.checks(figures(**case)[1])]
        assert {j for j, o in enumerate(outcomes) if o == NOT_SUPPORTED} == {i}, (case, outcomes)
    f["predicted"]["heavy_undecided"] = "the model predicts no stall past the target"
    assert lesson.checks(f)[4].outcome() == INCONCLUSIVE
    (fact,) = lesson.facts(f)
    assert fact.value == fact.predicted == 1000


def round_work(s: dict) -> tuple[int, int]:
    """(prompt tokens prefilled, decode steps) of one traced server's round: the stall trace, the burst, the mixes."""
    streams = s["streams"] * s["stream_prompt"]
    tokens = streams + s["long_prompt"] + s["burst"] * s["burst_prompt"] + sum(streams + n * s["long_prompt"]
                                                                               for n in s["mixes"])
    return tokens, s["stream_tokens"] * (1 + len(s["mixes"])) + s["burst_tokens"]


def test_the_full_run_is_a_bounded_multiple_of_the_quick_one():
    """The quick run on gpt2 takes about a minute and a half on 2 cores, a third of it starting the workers; a full
    round may cost at most 7× a quick one in prefilled tokens and 4× in decode steps, over at most 7 rounds, so the
    full run stays under ten minutes there. Its heaviest mix still spaces its long prompts over the streams' life."""
    from lessons_support import load_lesson
    lesson = load_lesson("15_disaggregation")
    quick, full = lesson.sizes(1024, True), lesson.sizes(1024, False)
    (qt, qs), (ft, fs) = round_work(quick), round_work(full)
    assert ft <= 7 * qt and fs <= 4 * qs, (ft / qt, fs / qs)
    assert full["repeats"] <= full["max_repeats"] <= 7
    assert full["mixes"][0] == 0 and (full["stream_tokens"] - full["warm"]) // full["mixes"][-1] >= 1
    assert full["long_prompt"] > quick["long_prompt"] and full["mixes"][-1] > quick["mixes"][-1]


def test_serve_disaggregated_streams_the_colocated_tokens_through_the_openai_client():
    """The front end of `serve --disaggregate`: prompts go to the prefill worker, tokens stream from the decode
    worker, over the same OpenAI API as one engine."""
    import openai

    from minillm.checkpoints.tokenizer import load_tokenizer
    from minillm.serving.api_server import make_serving
    from minillm.serving.launch import BackgroundServer
    tokenizer = load_tokenizer("tiny")
    prompt = random_prompts(1, [BS + 3], CFG.vocab_size, seed=9)[0]
    [want] = colocated([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    prefill = worker(256, 64, core=0)
    decode = worker(256, 64, core=1)
    with Workers.disaggregated(FACTORY, CFG, prefill, decode) as workers:
        workers.step_timeout = 0.005
        with BackgroundServer(make_serving(workers, tokenizer, "tiny")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == tokenizer.decode(want.output_token_ids)
        assert_no_block_held(workers)


def test_serve_disaggregate_refuses_prefix_caching_in_one_line(capsys):
    """A decode worker cannot hash blocks whose KV arrives from elsewhere: the pair of flags is a usage error."""
    from minillm import cli
    assert cli.main(["serve", "--model", "tiny", "--disaggregate", "--enable-prefix-caching"]) == 2
    assert "--disaggregate with --enable-prefix-caching" in capsys.readouterr().err


def test_serve_disaggregate_refuses_a_thread_count_its_workers_would_not_take(capsys):
    from minillm import cli
    assert cli.main(["serve", "--model", "tiny", "--disaggregate", "--threads", "2"]) == 2
    assert "--disaggregate with --threads 2: each worker takes its own half of the cores" in capsys.readouterr().err


def test_what_the_connector_cannot_carry_is_refused_and_min_tokens_reaches_the_decode_worker(pair):
    """n > 1 and log-probabilities do not cross the connector: refused at once, naming the field. min_tokens does:
    the prefill worker masks the end of text for its one token, the decode worker for the rest."""
    prompt = random_prompts(1, [BS + 2], CFG.vocab_size, seed=12)[0]
    for params, field_name in ((SamplingParams(n=2, temperature=0), "n=2"),
                               (SamplingParams(logprobs=1, temperature=0), "logprobs=1"),
                               (SamplingParams(prompt_logprobs=0, temperature=0), "prompt_logprobs=0")):
        with pytest.raises(ValueError, match=field_name):
            pair.add_request(prompt, params)
    eos = CFG.eos_token_id
    params = SamplingParams(max_tokens=6, min_tokens=4, temperature=0, stop_token_ids=[eos])
    [got] = run_all(pair, [prompt], params)
    [want] = colocated([prompt], params)
    assert got.output_token_ids == want.output_token_ids and len(got.output_token_ids) >= 4
    assert_no_block_held(pair)
