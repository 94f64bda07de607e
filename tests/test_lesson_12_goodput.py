"""Lesson 12 (goodput over HTTP): the pieces its verdict is built from, and (slow) its whole --quick run.

The run starts two servers in processes of their own and sweeps request rates, which takes a minute on a busy
2-core machine, so it is marked slow; what the default suite checks is the arithmetic the verdict rests on,
fed numbers on both sides of each line.
"""
import json

import pytest


from lessons_support import load_lesson  # noqa: E402  (also puts lessons/ on sys.path)

from minillm.bench.serve import RequestResult  # noqa: E402

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
