"""Lesson 13 (prompt caching): its workloads share what they claim to, its counts are exact, and its verdict and
its reading of the numbers follow the figures on both sides of each line.

Times are not asserted (they are the lesson's business); the counts that explain them are.
"""
import json

import pytest
import torch

from minillm import PRESETS
from minillm.checkpoints.load import random_model

from lesson_checks import assert_lesson_results
from lessons_support import load_lesson  # also puts lessons/ on sys.path

from minillm.bench.verdict import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, MachineLoad, judge  # noqa: E402
from minillm.bench.replay import serve  # noqa: E402
from minillm.bench.workloads import multi_turn_workload, no_sharing_workload, shared_prefix_workload, ttft_sweep  # noqa: E402
from minillm.bench.caching import make_engine, predictions, same_forward_gains, throughput_bound  # noqa: E402

lesson = load_lesson("13_prompt_caching")

CFG = PRESETS["tiny"]
QUIET = MachineLoad(2, 1.0, 0.0, 0.0, 0.0)
SWEEP = {"off": [0.5, 0.8, 1.4, 2.6], "on": [0.18, 0.19, 0.2, 0.22]}  # median TTFTs by shared length


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # tiny matrices: more threads only wait for each other on shared cores
    return random_model(CFG, "cpu", torch.float32)  # GPT-2's own init: what is counted here does not depend on values


def test_workloads_are_seeded_and_share_only_what_they_say():
    a = shared_prefix_workload(4, 40, 8, 5, CFG.vocab_size, seed=1)
    assert a == shared_prefix_workload(4, 40, 8, 5, CFG.vocab_size, seed=1)
    prompts = [c.turns[0] for c in a]
    assert all(len(p) == 48 and p[:40] == prompts[0][:40] for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == 4
    control = no_sharing_workload(4, 48, 5, CFG.vocab_size, seed=1)
    assert len({p.turns[0][0] for p in control}) == 4, "the control's prompts must differ from their first token"
    turns = multi_turn_workload(2, 3, 20, 6, 5, CFG.vocab_size)
    assert [[len(t) for t in c.turns] for c in turns] == [[20, 6, 6]] * 2


def test_shared_prompt_prefills_the_system_prompt_once(model):
    work = shared_prefix_workload(4, 40, 8, 3, CFG.vocab_size)
    off = serve(make_engine(model, work, caching=False), work)
    on = serve(make_engine(model, work, caching=True), work)
    assert off["prefill_tokens_computed"] == 4 * 48 and off["hit_rate"] == 0
    # All four arrive at once and share the step: the first computes 48, the others their last 48 − 32.
    assert on["prefill_tokens_computed"] == 48 + 3 * 16
    assert on["hit_rate"] == pytest.approx(3 * 32 / (4 * 48))
    assert [r["cached_tokens"] for r in on["records"]] == [0, 32, 32, 32]
    assert on["peak_blocks_in_use"] < off["peak_blocks_in_use"], "a shared prefix is held once"
    assert [r["generated_tokens"] for r in on["records"]] == [3] * 4
    assert on["prefill_steps_s"] > 0 and on["decode_steps_s"] > 0  # 3-token answers: decode-only steps follow


def test_each_turn_of_a_conversation_reuses_the_history(model):
    work = multi_turn_workload(2, 3, 20, 6, 5, CFG.vocab_size)
    records = serve(make_engine(model, work, caching=True), work)["records"]
    assert [(r["conversation"], r["turn"], r["prompt_tokens"]) for r in records] == \
        [(c, t, 20 + t * 11) for c in range(2) for t in range(3)]
    for r in records:  # what the previous turn computed: its prompt and answer but the last token, whole blocks
        assert r["cached_tokens"] == (0 if r["turn"] == 0 else (r["prompt_tokens"] - 6 - 1) // 16 * 16), r


def test_the_control_shares_nothing_and_one_client_sends_one_request_at_a_time(model):
    work = no_sharing_workload(3, 20, 4, CFG.vocab_size)
    engine = make_engine(model, work, caching=True)
    on = serve(engine, work, concurrency=1)
    assert on["hit_rate"] == 0 and on["prefill_tokens_computed"] == 60
    assert max(s.num_seqs for s in engine.timeline) == 1


def test_the_ttft_sweep_hits_exactly_the_shared_length(model):
    prefixes = [16, 32, 48]
    sweep = ttft_sweep(prefixes, 5, CFG.vocab_size)
    first = sweep[0].turns[0]
    assert len(first) == 53 and all(c.max_tokens == 1 for c in sweep)
    for s, c in zip(prefixes, sweep[1:]):
        p = c.turns[0]
        assert len(p) == s + 5 and p[:s] == first[:s] and p[s] != first[s]
    on = serve(make_engine(model, sweep, caching=True), sweep, concurrency=1)
    assert [r["cached_tokens"] for r in on["records"]] == [0] + prefixes
    off = serve(make_engine(model, sweep[1:], caching=False), sweep[1:], concurrency=1)
    assert off["prefill_tokens_computed"] == sum(prefixes) + 3 * 5


def test_the_throughput_bound_is_amdahls_law_on_prefill_saved():
    off = {"prefill_steps_s": 6.0, "decode_steps_s": 4.0, "prefill_tokens_computed": 1000}
    b = throughput_bound(off, {"prefill_tokens_computed": 250})
    assert b["prefill_share"] == pytest.approx(0.6) and b["tokens_saved"] == pytest.approx(0.75)
    assert b["bound"] == pytest.approx(1 / (1 - 0.45))
    note = lesson.explain(figures(bound=b))["shared"]
    assert "at most 1.82× faster" in note and "60% of the shared" in note and "SGLang" in note


def test_the_pass_model_puts_a_hits_gain_between_1_and_the_token_ratio():
    """(t₁ + FLOPs(S + U)/R) ÷ (t₁ + FLOPs(U after S)/R): (S + U) / U-ish when the pass is all compute, 1 when it is
    all fixed cost; the band holds the prediction at the peak and at half of it."""
    cfg, s = PRESETS["gpt2"], lesson.sizes(1024, quick=False)
    S, U = s["sweep"][-1], s["sweep_suffix"]
    free = predictions(cfg, s, 0.0, 1e12, torch.float32)["ttft_gain"]
    fixed = predictions(cfg, s, 1e6, 1e12, torch.float32)["ttft_gain"]
    assert fixed == pytest.approx(1.0, abs=1e-6) and 0.6 * (S + U) / U < free < (S + U) / U
    p = predictions(cfg, s, 0.02, 4e11, torch.float32)
    assert 1 < p["ttft_gain"] < free and p["ttft_band"][0] < p["ttft_gain"] < p["ttft_band"][1]
    slower = predictions(cfg, s, 0.02, 2e11, torch.float32)["ttft_gain"]  # half the rate: more to save
    assert p["ttft_band"][1] == pytest.approx(slower * 1.5) and p["ttft_band"][0] == pytest.approx(p["ttft_gain"] / 1.5)
    assert 1 < p["shared_gain"] < free


def figures(ttft=(1.5,) * 5, shared=(2.0,) * 5, host=(0.01,) * 5, bound=None):
    """What the lesson writes, with the gains per round given: predicted 1.5× (band 1–3) and 2× (band 1.4–4)."""
    s = lesson.sizes(1024, quick=False)
    p = {"fixed_s": 0.01, "ttft_gain": 1.5, "shared_gain": 2.0, "ttft_band": [1.0, 3.0], "shared_band": [1.4, 4.0],
         "ttft_off_s": [0.5, 0.8, 1.4, 2.6], "ttft_on_s": [0.3, 0.3, 0.3, 0.3]}
    return {"sizes": s, "predicted": p, "ttft_sweep": {"ttft_off_s": SWEEP["off"], "ttft_on_s": SWEEP["on"]},
            "per_round": {"ttft_gain": list(ttft), "shared_gain": list(shared), "control_raw": [0.9, 1.0, 1.1, 1.0, 1.0],
                          "control_host_share": list(host)},
            "throughput_bound": bound or {"prefill_share": 0.6, "tokens_saved": 0.75, "bound": 1.82},
            "on_off_turns": 1.3}


def test_each_check_can_fail():
    """Both ends of both bands: a gain under the band's low end or over its high end is NOT SUPPORTED, and only
    that check; inside both bands every check HOLDS."""
    assert [c.outcome() for c in lesson.checks(figures())] == [HOLDS] * 4
    assert [c.key for c in lesson.checks(figures())] == ["ttft_gain_low", "ttft_gain_high", "shared_gain_low",
                                                         "shared_gain_high"]
    for i, bad in enumerate([{"ttft": [0.8] * 5}, {"ttft": [4.0] * 5}, {"shared": [1.1] * 5}, {"shared": [5.0] * 5}]):
        outcomes = [c.outcome() for c in lesson.checks(figures(**bad))]
        assert outcomes[i] == NOT_SUPPORTED and outcomes.count(NOT_SUPPORTED) == 1, (bad, outcomes)
        assert judge("claim", lesson.checks(figures(**bad)), QUIET).outcome == NOT_SUPPORTED
    straddles = [c.outcome() for c in lesson.checks(figures(ttft=[0.8, 0.9, 1.2, 1.5, 1.6]))]
    assert straddles[0] == INCONCLUSIVE


def test_the_control_is_a_fact_the_host_time_caching_adds_never_a_verdict():
    """Nothing shared: the same tokens in the same passes either way, so caching's cost is its host time; two runs
    of the same work differ by more than that, so it is reported, not judged, whatever its value."""
    off = [{"makespan_s": 0.93, "host_s": 0.03, "throughput": 10 / 0.93},
           {"makespan_s": 1.13, "host_s": 0.03, "throughput": 10 / 1.13}]
    on = [{"makespan_s": 1.145, "host_s": 0.045, "throughput": 10 / 1.145},
          {"makespan_s": 0.945, "host_s": 0.045, "throughput": 10 / 0.945}]
    r = Rounds({"control off": off, "control on": on})
    assert same_forward_gains(r, "control") == pytest.approx([0.93 / 0.945, 1.13 / 1.145])
    facts = lesson.facts(figures(host=[0.5] * 5))  # even a 50% host cost
    assert "host cost" in facts[0].name and facts[0].value == 0.5
    verdict = judge("claim", lesson.checks(figures()), QUIET, facts=facts)
    assert verdict.outcome == HOLDS and any(line.startswith("fact: caching's host cost") for line in verdict.lines())


class Rounds:
    def __init__(self, runs):
        self.runs = runs

    def results(self, name):
        return self.runs[name]


def test_quick_keeps_the_proportions_that_decide_each_line():
    for quick in (False, True):
        s = lesson.sizes(1024, quick)
        assert (s["sweep"][-1] + s["sweep_suffix"]) / s["sweep_suffix"] == 25
        assert (s["prefix"] + s["suffix"]) / s["answer"] == 25
        assert s["prefix"] + s["suffix"] + s["answer"] <= 1024


def test_lesson_13_quick_writes_one_verdict_and_exact_counts(tmp_path):
    lesson.main(["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / f"{lesson.NAME}.json").read_text())
    assert doc["lesson"] == lesson.NAME and doc["quick"] is True
    assert (tmp_path / f"{lesson.NAME}.png").stat().st_size > 1000
    v, runs, s = doc["verdict"], doc["figures"]["runs"], doc["figures"]["sizes"]
    assert v["outcome"] in (HOLDS, NOT_SUPPORTED, INCONCLUSIVE) and len(v["checks"]) == 4 and len(v["facts"]) == 2
    assert all(len(c["values"]) >= s["repeats"] for c in v["checks"])
    assert any("without caching, steps that prefill" in r for r in v["reasons"])
    for off, on in zip(runs["shared off"], runs["shared on"]):
        assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"] == off["prompt_tokens"]
        assert off["hit_rate"] == 0 < on["hit_rate"]
    for off, on in zip(runs["control off"], runs["control on"]):
        assert on["prefill_tokens_computed"] == off["prefill_tokens_computed"] and on["hit_rate"] == 0
    for run in runs["control off"] + runs["control on"] + runs["shared on"]:  # the engine timed its passes apart
        assert 0 < run["host_s"] < run["makespan_s"]
    assert all(r["requests"] == len(s["sweep"]) for r in runs["sweep off"])
    assert all(r["requests"] == len(s["sweep"]) + 1 for r in runs["sweep on"])
    assert_lesson_results(doc)


@pytest.mark.slow
def test_a_student_copy_without_prefix_match_stops_lesson_13_with_one_line(tmp_path):
    from test_lessons_in_order import assert_stops_at_a_stub, copy_up_to, run_lesson

    copy, stubbed = copy_up_to(12, tmp_path / "student")
    assert "prefix-match" in [ex.id for ex in stubbed]
    assert_stops_at_a_stub(run_lesson(copy, 13, tmp_path / "out"), [ex for ex in stubbed if ex.id == "prefix-match"])


@pytest.mark.parametrize("quick", [True, False])
def test_every_line_is_judged_from_rounds_whose_range_is_a_90_percent_interval(quick):
    """A decisive verdict from two rounds rests on a range that holds their median half the time, and lesson 13's
    verdict differed between a quiet run and one beside a busy core. The lesson asks for the fewest rounds whose
    whole range is an interval of at least the verdict's confidence."""
    from minillm.bench.verdict import CONFIDENCE, median_interval
    n = lesson.sizes(PRESETS["gpt2"].n_ctx, quick)["repeats"]
    assert median_interval(list(range(n)))[2] >= CONFIDENCE
    assert median_interval(list(range(n - 1)))[2] < CONFIDENCE, "no more rounds than that takes"
