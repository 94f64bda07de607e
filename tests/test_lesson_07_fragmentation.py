"""Lesson 07 (fragmentation): its quick run judges the full run's trace, and the waste it measures follows
the formula. Memory is decided by token counts alone, so even a noisy quick run must get it right."""
import pytest
import torch

from minillm import PRESETS
from minillm.bench import workloads
from minillm.bench.kv_waste import kv_use
from minillm.checkpoints.load import random_model

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

frag = load_lesson("07_fragmentation")


def test_05_quick_judges_the_same_trace_as_the_full_run(tmp_path, one_thread, capsys):
    doc = run_quick(frag, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    cont, paged = f["contiguous"], f["paged"]
    assert f["trace"]["requests"] == frag.REQUESTS and f["reservation_tokens"] == PRESETS["tiny"].n_ctx
    # Memory is decided by token counts alone, so even a noisy quick run must show it:
    assert cont["peak_running"] <= frag.RESERVATIONS < paged["peak_running"]
    assert cont["waste"] > paged["waste"] and cont["generated_tokens"] == paged["generated_tokens"]
    by_block = {row["block_size"]: row for row in f["block_sweep"]}
    assert by_block[1]["waste"] == 0 and by_block[64]["waste"] > by_block[16]["waste"] == paged["waste"]
    assert [c["timed"] for c in v["checks"]] == [False, False, False]  # counts: never inconclusive
    share = f["sharing"]  # n samples of a prompt: block arithmetic predicts the blocks and the copies exactly
    assert share["measured"]["grouped"] == share["predicted"]["grouped"] < share["predicted"]["separate"] \
        == share["measured"]["separate"]
    assert share["measured"]["copies"] == sum(p["predicted_copies"] for p in share["prompts"]) > 0
    assert [p["grouped"] for p in share["prompts"]] == [p["predicted_grouped"] for p in share["prompts"]]
    together = share["together"]
    assert together["grouped"]["generated_tokens"] == together["separate"]["generated_tokens"]
    assert together["grouped"]["steps"] < together["separate"]["steps"]
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED")


def test_kv_use_counts_only_allocated_memory_and_waiting_steps():
    snaps = [{"real_tokens": 30, "allocated_tokens": 40, "running": 3, "waiting": 2},
             {"real_tokens": 10, "allocated_tokens": 10, "running": 1, "waiting": 0},
             {"real_tokens": 0, "allocated_tokens": 0, "running": 0, "waiting": 0}]  # the pool after the end
    use = kv_use(snaps, budget_tokens=100)
    assert use["waste"] == pytest.approx(1 - 40 / 50)
    assert use["real_share_of_budget"] == pytest.approx(40 / 200)
    assert use["peak_running"] == 3 and use["sustained_running"] == 3


def test_05_waste_of_a_replay_follows_the_formula(one_thread):
    """Paged waste ≈ running · block/2 ÷ (tokens + running · block/2): larger blocks, more waste; contiguous most."""
    model = frag.narrow_model(random_model(PRESETS["tiny"], "cpu", torch.float32))
    trace = workloads.lognormal_trace(12, 128, 512, 20, 8, seed=0)
    wastes = [frag.serve_in_budget(model, trace, 4 * 128, bs)["waste"] for bs in (1, 8, 32)]
    contiguous = frag.serve_in_budget(model, trace, 4 * 128, 8, slabs=frag.RESERVATIONS)
    assert wastes[0] == 0 < wastes[1] < wastes[2] < contiguous["waste"]
    assert contiguous["peak_running"] == frag.RESERVATIONS


def figures(paged_waste=0.21, paged_running=16.0, grouped=53) -> dict:
    """A run's figures where every check holds: the formula's 19.9% paged waste measured 21%, paging running 4× the
    slabs' sequences, 53 blocks held by samples sharing their prompts as block arithmetic gives."""
    return {"reservation_tokens": 128,
            "predicted": {"life_mean_len": 30.0, "paged_waste": 0.199, "contiguous_waste": 0.76, "concurrency": 3.4},
            "contiguous": {"waste": 0.77, "sustained_running": 4.0, "preemptions": 0},
            "paged": {"waste": paged_waste, "sustained_running": paged_running, "preemptions": 2},
            "block_sweep": [{"block_size": 1, "waste": 0.0}],
            "sharing": {"samples": 4, "measured": {"grouped": grouped, "separate": 80},
                        "predicted": {"grouped": 53, "separate": 80}}}


def test_each_check_can_fail():
    """For each check in turn, a count on its wrong side: that check, and only it, is NOT SUPPORTED."""
    assert {c.key: c.outcome() for c in frag.checks(figures())} == {
        "paged_waste": "HOLDS", "concurrency": "HOLDS", "shared_blocks": "HOLDS"}
    wrong = {"paged_waste": figures(paged_waste=0.45),      # over 2 × the formula's 19.9%: blocks held past their use
             "concurrency": figures(paged_running=6.0),     # 1.5× the slabs' sequences
             "shared_blocks": figures(grouped=80)}          # the samples held as many blocks as separate requests
    for key, figs in wrong.items():
        outcomes = {c.key: c.outcome() for c in frag.checks(figs)}
        assert outcomes.pop(key) == "NOT SUPPORTED", key
        assert set(outcomes.values()) == {"HOLDS"}, (key, outcomes)


def test_the_formula_predicts_paged_waste_from_the_lengths_over_a_life():
    assert frag.paged_waste(1, 30.0) == 0 and frag.paged_waste(16, 30.0) == pytest.approx(7.5 / 37.5)
    assert frag.paged_waste(64, 30.0) > frag.paged_waste(16, 30.0)


def test_vllms_figures_are_facts_beside_the_checks_never_lines():
    fs = frag.facts({**figures(), "sharing": {**figures()["sharing"], "saving": 0.3375}})
    assert [f.name for f in fs] == ["contiguous waste", "KV blocks saved by 4 samples sharing a prompt"]
    assert fs[0].predicted == 0.76 and "60%–80%" in fs[0].why and "under 4%" in fs[0].why
    assert fs[1].predicted == pytest.approx(1 - 53 / 80) and "6.1%" in fs[1].why
    assert all(c.line not in (frag.PAGED_WASTE_LIMIT, frag.PAPER_SHARING_SAVING) for c in frag.checks(figures()))
