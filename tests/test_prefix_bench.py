"""The prefix-caching measurement: its workloads share what they claim to, and its counts are exact.

Times are not asserted (they are the lesson's business); the counts that explain them are.
"""
import pytest

from minillm import GPT2, PRESETS
from minillm.prefix_bench import (compare, default_workloads, make_engine, multi_turn_workload, no_sharing_workload,
                                  serve, shared_prefix_workload)

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    return GPT2(CFG, seed=0).eval()  # GPT-2's own init: what is counted here does not depend on the values


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


def test_each_turn_of_a_conversation_reuses_the_history(model):
    work = multi_turn_workload(2, 3, 20, 6, 5, CFG.vocab_size)
    on = serve(make_engine(model, work, caching=True), work)
    records = on["records"]
    assert [(r["conversation"], r["turn"], r["prompt_tokens"]) for r in records] == \
        [(c, t, 20 + t * 11) for c in range(2) for t in range(3)]
    for r in records:  # what the previous turn computed: its prompt and answer but the last token, whole blocks
        want = 0 if r["turn"] == 0 else (r["prompt_tokens"] - 6 - 1) // 16 * 16
        assert r["cached_tokens"] == want, r


def test_the_control_shares_nothing_and_one_client_sends_one_request_at_a_time(model):
    work = no_sharing_workload(3, 20, 4, CFG.vocab_size)
    engine = make_engine(model, work, caching=True)
    on = serve(engine, work, concurrency=1)
    assert on["hit_rate"] == 0 and on["prefill_tokens_computed"] == 60
    assert max(s.num_seqs for s in engine.timeline) == 1


def test_compare_pairs_every_run_and_reports_ratios_per_repeat(model):
    work = default_workloads(CFG.vocab_size, CFG.n_ctx, quick=True)
    result = compare(model, {"shared": work["shared"]}, repeats=2)
    r = result["shared"]
    assert len(r["off"]) == len(r["on"]) == len(r["ratios"]) == 2
    assert all(x["prefill_tokens_ratio"] < 1 and x["hit_ttft_p50_speedup"] > 0 for x in r["ratios"])
    assert set(r["median_ratios"]) == {"ttft_p50_speedup", "hit_ttft_p50_speedup", "throughput_gain",
                                       "prefill_tokens_ratio"}
