"""Lesson 12 (goodput over HTTP): the pieces its verdict is built from, and (slow) its whole --quick run.

The run starts two servers in processes of their own and sweeps request rates, which takes a minute on a busy
2-core machine, so it is marked slow; what the default suite checks is the arithmetic the verdict rests on,
fed numbers on both sides of each line.
"""
import json
import math

import pytest


from lessons_support import load_lesson  # noqa: E402  (also puts lessons/ on sys.path)

from minillm.bench.goodput import goodput  # noqa: E402
from minillm.bench.serve import RequestResult, meets  # noqa: E402
from minillm.bench.verdict import HOLDS, INCONCLUSIVE, MIN_ROUNDS, NOT_SUPPORTED  # noqa: E402

lesson = load_lesson("12_goodput")


def test_the_highest_sustained_rate_is_the_highest_with_enough_goodput():
    rates = [2.0, 4.0, 8.0]
    share = lambda *xs: [{"goodput_share": x} for x in xs]  # noqa: E731
    assert lesson.highest_sustained(share(1.0, 0.95, 0.5), rates) == 4.0
    assert lesson.highest_sustained(share(1.0, 0.89, 0.9), rates) == 8.0  # the line is ≥ 90%, at any rate
    assert lesson.highest_sustained(share(0.5, 0.2, 0.0), rates) == 1.0   # none: half the lowest rate


def test_what_http_adds_is_client_time_against_the_engine_record_of_the_same_request():
    client = RequestResult(True, 8, start=10.000, token_times=[10.050, 10.061, 10.072], output_tokens=3, id="a")
    engine = {"a": {"id": "a", "arrival": 10.004, "token_times": [10.040, 10.060, 10.070]}}
    cost = lesson.http_cost([client, RequestResult(False, 8, id="b")], engine)
    assert cost["requests"] == 1
    assert cost["ttft_added_p50_s"] == pytest.approx(0.050 - 0.036)
    assert cost["delivery_p50_s"] == pytest.approx(0.002)  # the gaps 10, 1, 2 ms: their median
    assert cost["client_itl_p50_s"] == pytest.approx(0.011) and cost["engine_itl_p50_s"] == pytest.approx(0.015)


def test_goodput_counts_a_request_only_when_its_ttft_and_every_gap_meet_their_targets():
    """The course's one definition (bench/goodput.py), which lessons 12 and 15 use: one gap over the ITL target, or
    a TTFT over its target, and the request does not count; a failed one never does."""
    targets = {"ttft": 0.1, "itl": 0.02}
    ok, stall, late = (0.05, [0.01, 0.015]), (0.05, [0.01, 0.03]), (0.2, [0.01])
    g = goodput([ok, stall, late, None], 2.0, targets)
    assert g == {"goodput": 0.5, "share": 0.25, "met": 1, "requests": 4}
    client = RequestResult(True, 8, start=0.0, token_times=[0.05, 0.06, 0.09], output_tokens=3)
    assert not meets(client, targets) and meets(client, {"ttft": 0.1, "itl": 0.03})  # bench-serve: the same test
    point = lesson.point([client], 1.0, {"ttft": 0.1, "itl": 0.03})
    assert point["goodput_share"] == 1.0 and point["request_goodput"] == 1.0


def plan(stall_s=0.030, budget=64, long=256, rates=(2.0, 4.0, 8.0)):
    """A plan: decode 5 ms, a long prefill of `stall_s` − 5 ms, an ITL target of 15 ms, 16 tokens out."""
    s = {"long": long, "output": 16, "requests": 12, "short": 16}
    p = {"s": s, "budget": budget, "cost": {"decode": 0.005, "prefill_long": stall_s - 0.005, "capacity": 10.0},
         "targets": {"itl": 0.015, "ttft": 0.1}, "rates": list(rates), "stall": stall_s}
    return p | {"predicted": lesson.predict_rates(p)}


def test_the_model_predicts_the_rate_each_mode_sustains():
    """Unchunked, a 30 ms step misses the 15 ms target, so a request survives only if no long prompt arrives while
    it decodes (80 ms): exp(−λ · 0.25 · 0.08) ≥ 90% up to λ ≈ 5.3/s; chunked (64 of 256 tokens: 11.25 ms) never
    misses. Under the target unchunked too, chunking buys nothing."""
    pr = plan()["predicted"]
    assert pr["stall_s"]["chunked"] == pytest.approx(0.025 / 4 + 0.005) and pr["life_s"] == pytest.approx(0.08)
    assert pr["highest"] == {"chunked": 8.0, "unchunked": 4.0} and pr["ratio"] == 2.0
    assert pr["band"] == [1.0, 4.0]  # one step of the grid either way: its widest step is 2× (1 → 2 → 4 → 8)
    assert plan(stall_s=0.012)["predicted"]["ratio"] == 1.0


def test_the_rates_start_just_under_the_unchunked_knee_and_stop_under_the_capacity():
    """λ* is where unchunked's predicted share falls to 90%; the grid runs in equal ratios from 0.7 λ* (a point the
    model predicts sustained, the knee inside the first step) to 3/4 of the capacity. With no knee (a stall within
    the target), or a knee too near the capacity, the grid starts at half its top."""
    knee = lesson.unchunked_knee(stall=0.030, life=0.08, itl=0.015)
    assert math.exp(-knee * lesson.LONG_SHARE * 0.08) == pytest.approx(lesson.GOOD_SHARE)
    assert lesson.unchunked_knee(stall=0.012, life=0.08, itl=0.015) == math.inf
    rates = lesson.rate_grid(knee, 100.0, 5)
    assert rates[0] == pytest.approx(0.7 * knee, rel=1e-2) and rates[0] < knee < rates[1] and rates[-1] == 75.0
    steps = [b / a for a, b in zip(rates, rates[1:])]
    assert max(steps) == pytest.approx(min(steps), rel=1e-2)  # equal ratios
    assert lesson.rate_grid(math.inf, 100.0, 3) == [37.5, 53.0, 75.0]
    assert lesson.rate_grid(60.0, 100.0, 3)[0] == 37.5


def test_the_full_size_is_larger_than_quick_where_the_verdict_needs_it():
    """More requests per rate (the share's resolution), more rates (the grid's step, hence the band), at least five
    sweeps; the same long prompt, so the prediction's stall is the same."""
    quick, full = lesson.sizes(256, True), lesson.sizes(256, False)
    assert full["requests"] > quick["requests"] and full["rates"] > quick["rates"] and full["long"] == quick["long"]
    assert full["sweeps"] >= MIN_ROUNDS


def sweep_points(chunked_best, unchunked_best, rates=(2.0, 4.0, 8.0), tput=1.0):
    """One sweep whose goodput shares put each mode's highest sustained rate where asked."""
    share = lambda best: [{"goodput_share": 1.0 if r <= best else 0.5, "output_throughput": 100.0} for r in rates]  # noqa
    chunked = share(chunked_best)
    chunked[-1] = {**chunked[-1], "output_throughput": 100.0 * tput}
    return {"chunked": chunked, "unchunked": share(unchunked_best)}


def test_each_check_can_fail():
    """Chunked sustains 8/s and unchunked 4/s in every sweep: 2×, as predicted (band 1–4), and every check HOLDS.
    Chunked at 2/s against 4/s (0.5×, under the band), chunked at 8/s against unchunked at half the lowest rate
    (8×, over it), and chunked throughput at 80% of unchunked's: each NOT SUPPORTED, and only that check."""
    p = plan()
    figs = lambda *w: lesson.sweep_figures([sweep_points(*w)] * 5, p, "")  # noqa: E731
    assert [c.outcome() for c in lesson.checks(figs(8.0, 4.0))] == [HOLDS] * 3
    for i, bad in enumerate([(2.0, 4.0), (8.0, 0.0), (8.0, 4.0, (2.0, 4.0, 8.0), 0.8)]):
        outcomes = [c.outcome() for c in lesson.checks(figs(*bad))]
        assert outcomes[i] == NOT_SUPPORTED and outcomes.count(NOT_SUPPORTED) == 1, (bad, outcomes)
    assert lesson.checks(lesson.sweep_figures([sweep_points(8.0, 4.0)] * 5, p, "one core free"))[0].outcome() \
        == INCONCLUSIVE  # too few free cores: undecided, whatever the sweeps show


@pytest.mark.slow
def test_the_quick_run_sweeps_both_modes_and_gives_one_verdict(tmp_path):
    out = lesson.main(["--quick", "--out", str(tmp_path)])
    figures = out["figures"]
    assert set(figures["points"]) == {"chunked", "unchunked"}
    assert figures["targets_s"]["itl"] == pytest.approx(lesson.K_ITL * figures["step_costs_s"]["decode"])
    assert out["verdict"]["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE")
    assert all(h["requests"] > 0 for h in figures["http_cost"].values())
    saved = json.loads((tmp_path / "12_goodput.json").read_text())
    assert saved["verdict"]["outcome"] == out["verdict"]["outcome"] and (tmp_path / "12_goodput.png").exists()


@pytest.mark.slow
def test_the_quick_run_explains_itself_and_prints_only_its_own_numbers(tmp_path):
    """Every lesson's rules on lesson 12 too: every check carries a computed `why`, a NOT SUPPORTED prints it, and
    every number in a verdict line is a value of the results file."""
    from lesson_checks import assert_explained, assert_one_number_per_quantity
    lesson.main(["--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "12_goodput.json").read_text())
    assert_explained(doc)
    assert_one_number_per_quantity(doc)
