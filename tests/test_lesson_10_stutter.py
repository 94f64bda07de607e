"""Lesson 10 (stutter): its quick run writes each request's timeline, and its analysis takes the right gaps."""
import pytest

from minillm.sequence import RequestMetrics

from lessons_support import load_lesson, run_quick  # also puts lessons/ on sys.path

stutter = load_lesson("10_stutter")


def test_07_quick_writes_each_request_timeline(tmp_path, one_thread, capsys):
    doc = run_quick(stutter, tmp_path, capsys)
    f, v = doc["figures"], doc["verdict"]
    assert set(f["runs"]) == {"unchunked", f"chunked {f['setup']['chunk_budget']}"}
    for runs in f["runs"].values():
        assert len(runs) >= f["setup"]["repeats"]
        for r in runs:
            assert r["window_max_itl_s"] >= r["window_p99_itl_s"] > 0 and r["long_ttft_s"] > 0
            long = r["requests"][-1]
            assert long["arrival"] == 0 and len(long["tokens"]) == f["setup"]["long_tokens"]
    assert [c["line"] for c in v["checks"]] == [stutter.STUTTER_FACTOR, 1 - stutter.THROUGHPUT_LOSS_LIMIT]


def metrics(arrival, times):
    return RequestMetrics(arrival_time=arrival, token_times=list(times))


def test_analyse_stutter_takes_the_gaps_that_overlap_the_long_prefill():
    # streams emit at 1, 2, 3, then stall until 7, then 8; the long prompt arrives at 3.5, first token at 6.9
    streams = [metrics(0.0, [1, 2, 3, 7, 8]), metrics(0.0, [1, 2, 3, 7, 8])]
    long = metrics(3.5, [6.9, 7.5])
    a = stutter.analyse_stutter(streams, long, generated=12)
    assert a["window_max_itl_s"] == 4 and a["window_itls"] == 2  # only the 3 → 7 gap of each stream
    assert a["itl_before_median_s"] == 1 and a["long_ttft_s"] == pytest.approx(3.4)
    assert a["makespan_s"] == 8 and a["throughput"] == 12 / 8
    assert a["requests"][0] == {"arrival": -3.5, "tokens": [-2.5, -1.5, -0.5, 3.5, 4.5]}
    assert a["requests"][-1]["arrival"] == 0


@pytest.mark.parametrize("prompt,budget", [(900, 128), (768, 128), (767, 64), (512, 64), (100, 16), (10, 8)])
def test_sized_budget_is_the_power_of_two_under_prompt_over_2k(prompt, budget):
    assert stutter.sized_budget(prompt, factor=3.0) == budget
