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
    pred = f["predicted"]  # the throughput line is the cost model's, with its chunk steps at half their ceiling
    assert [c["line"] for c in v["checks"]] == [stutter.STUTTER_FACTOR, pred["throughput_line"]]
    assert [c["predicted"] for c in v["checks"]] == [pred["stall_cut"], pred["throughput_kept"]]
    assert 0 < pred["throughput_line"] < pred["throughput_kept"] and pred["chunk_step_s"] > pred["fixed_s"] >= 0


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


def run(max_itl, throughput, ttft=0.01):
    return {"window_max_itl_s": max_itl, "itl_before_median_s": 1e-3, "throughput": throughput, "long_ttft_s": ttft}


def figures(stall=(4.0, 4.2, 3.9, 4.1, 4.0), kept=(0.95, 0.97, 0.93, 0.96, 0.94), line=0.8) -> dict:
    """Every check holds: a stall cut about 4-fold, 95% of the throughput kept against the model's line of 0.8."""
    return {"setup": {"chunk_budget": 64, "long_prompt": 512},
            "predicted": {"stall_cut": 4.5, "throughput_kept": 1.02, "throughput_line": line, "chunk_step_s": 2e-3},
            "runs": {"unchunked": [run(0.04, 100.0) for _ in stall],
                     "chunked 64": [run(0.04 / x, 100.0 * k) for x, k in zip(stall, kept)]}}


def test_each_check_can_fail():
    """For each check in turn, a measurement on its wrong side: that check, and only it, is NOT SUPPORTED."""
    assert {c.key: c.outcome() for c in stutter.checks(figures())} == {"stall_cut": "HOLDS", "throughput_kept": "HOLDS"}
    wrong = {"stall_cut": figures(stall=(1.5, 1.6, 1.4, 1.5, 1.55)),
             "throughput_kept": figures(kept=(0.6, 0.62, 0.58, 0.61, 0.6))}  # chunk steps far slower than the model's
    for key, figs in wrong.items():
        outcomes = {c.key: c.outcome() for c in stutter.checks(figs)}
        assert outcomes.pop(key) == "NOT SUPPORTED", key
        assert set(outcomes.values()) == {"HOLDS"}, (key, outcomes)


def test_the_throughput_line_is_the_cost_models_not_a_fixed_share():
    """The same measurement holds against a model that allows its loss and fails against one that does not."""
    kept = (0.85, 0.86, 0.84, 0.85, 0.86)
    outcome = lambda line: next(c for c in stutter.checks(figures(kept=kept, line=line))  # noqa: E731
                                if c.key == "throughput_kept").outcome()
    assert outcome(0.77) == "HOLDS" and outcome(0.9) == "NOT SUPPORTED"
