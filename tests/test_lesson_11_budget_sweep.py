"""Lesson 11 (the budget sweep): its quick run judges a fixed large budget against the old default, round by
round."""
import pytest

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

sweep = load_lesson("11_budget_sweep")


def test_08_quick_judges_a_fixed_large_budget_against_the_old_default(tmp_path, one_thread, capsys):
    doc = run_quick(sweep, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert set(f["configs"]) == {"chunked 512", "chunked 4096", "unchunked 2048"}
    for c in f["configs"].values():
        assert len(c["runs"]) >= 2 and all(r["preemptions"] == 0 and r["generated_tokens"] > 0 for r in c["runs"])
    gains = [a["throughput"] / b["throughput"] for a, b in zip(f["configs"]["chunked 4096"]["runs"],
                                                               f["configs"]["chunked 512"]["runs"])]
    assert f["gain_per_round"] == pytest.approx(gains) and v["checks"][0]["values"] == pytest.approx(gains)
    assert v["checks"][0]["line"] == pytest.approx(1.4)
