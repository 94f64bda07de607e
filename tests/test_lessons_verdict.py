"""The verdict library (minillm/bench/verdict.py, rounds.py, load.py): checks judged on both sides of every line,
predictions and measured ÷ predicted, facts that decide nothing, intervals and the machine's load, timing in turns
(never fewer than MIN_ROUNDS), and the stop at an exercise still to be written (lessons/common.py)."""
import math
import time

import pytest

from minillm.bench import verdict as measure
from minillm.bench.verdict import (HOLDS, INCONCLUSIVE, MIN_ROUNDS, NOT_SUPPORTED, Check, Fact, LoadReading, MachineLoad,
                                   interleave, judge)

from lessons_support import load_lesson  # also puts lessons/ on sys.path

import common  # noqa: E402  (lessons/common.py)


def load(share, cores=2):
    return MachineLoad(cores=cores, seconds=10.0, loadavg_before=0.1, loadavg_after=0.2, share=share)


# ---- one check ---------------------------------------------------------------------------------


@pytest.mark.parametrize("values,outcome", [
    ([1.6, 1.7, 1.8, 1.7, 1.6], HOLDS),            # the whole interval above the line
    ([1.5] * 5, HOLDS),                            # on the line counts as holding
    ([1.2, 1.3, 1.4, 1.3, 1.2], NOT_SUPPORTED),    # the whole interval below
    ([1.4, 1.6, 1.5, 1.6, 1.4], INCONCLUSIVE),     # the line inside the interval
    ([1.49, 1.9, 2.0, 1.9, 2.0], INCONCLUSIVE),    # five rounds: the interval is their range, one below is enough
])
def test_check_at_least(values, outcome):
    assert Check("gain", values, 1.5, ">=").outcome() == outcome


@pytest.mark.parametrize("values,outcome", [
    ([1.1, 1.2] * 3, HOLDS), ([1.5] * 5, HOLDS), ([1.51, 1.6] * 3, NOT_SUPPORTED), ([1.3, 1.6] * 3, INCONCLUSIVE),
])
def test_check_at_most(values, outcome):
    assert Check("cost", values, 1.5, "<=").outcome() == outcome


@pytest.mark.parametrize("n,k,coverage", [
    (1, 1, 0.0), (2, 1, 0.5), (3, 1, 0.75), (4, 1, 0.875), (5, 1, 0.9375), (8, 2, 1 - 2 * 9 / 256),
    (10, 2, 1 - 2 * 11 / 1024), (20, 6, 1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2 ** 20),
])
def test_the_interval_is_the_order_statistic_interval_of_the_median(n, k, coverage):
    values = [float(i) for i in range(n, 0, -1)]  # any order: sorted inside
    lo, hi, cov = measure.median_interval(values)
    assert (lo, hi) == (float(k), float(n + 1 - k)) and cov == pytest.approx(coverage)
    if k > 1:  # the next k would fall under 90%
        assert 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n < measure.CONFIDENCE <= cov


def test_more_rounds_narrow_the_interval_but_an_outlier_does_not_decide():
    """One slow round in ten (a burst of load) leaves the 90% interval inside the other nine."""
    values = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.1, 1.9, 2.0, 0.4]
    c = Check("speedup", values, 1.0, ">=")
    assert c.interval() == (1.9, 2.1) and c.outcome() == HOLDS
    assert Check("speedup", values[-4:], 1.0, ">=").outcome() == INCONCLUSIVE  # 4 rounds: the range, outlier in


@pytest.mark.parametrize("n", range(1, MIN_ROUNDS))
def test_a_timed_check_from_fewer_than_min_rounds_is_never_decided(n):
    """With n ≤ 4 rounds no interval holds the median 90% of the time: however far from the line, no verdict."""
    assert MIN_ROUNDS == 5 and measure.median_interval([1.0] * n)[2] < measure.CONFIDENCE
    for values in ([9.0] * n, [0.1] * n):
        c = Check("speedup", values, 1.0, ">=")
        assert c.outcome() == INCONCLUSIVE
        assert f"only {n} rounds: a timed check is decided from at least 5" in "\n".join(judge("x", [c], load(0)).lines())
    assert Check("speedup", [9.0] * MIN_ROUNDS, 1.0, ">=").outcome() == HOLDS
    assert Check("bytes", [9.0], 1.0, ">=", timed=False).outcome() == HOLDS, "a count has no rounds to need"


def test_the_load_never_widens_an_interval():
    """A speedup of 2.30–2.34 against a line of 1.0 holds however busy the machine was while it was measured."""
    c = Check("speedup", [2.30, 2.34, 2.31, 2.32, 2.33], 1.0, ">=")
    for share in (0.0, 0.5, 0.95):
        assert judge("claim", [c], load(share)).outcome == HOLDS and c.interval() == (2.30, 2.34)


def test_a_share_of_a_ceiling_over_100_percent_is_flagged():
    c = Check("share of the matmul ceiling", [0.04, 0.5, 4.68, 0.6, 0.5], 0.2, ">=", fmt="{:.0%}", of_ceiling=True)
    assert "4%–468%*" in c.describe() and "* over 100%" in c.describe()
    assert "*" not in Check("share", [0.4, 0.5, 0.6, 0.5, 0.4], 0.2, ">=", fmt="{:.0%}", of_ceiling=True).describe()


def test_a_counted_check_has_no_spread():
    c = Check("waste", [0.039], 0.04, "<=", timed=False)
    assert c.interval() == (0.039, 0.039) and c.outcome() == HOLDS
    assert Check("waste", [0.041], 0.04, "<=", timed=False).outcome() == NOT_SUPPORTED
    assert Check("tokens differing", [0], 0, "<=", timed=False).outcome() == HOLDS


@pytest.mark.parametrize("kwargs,message", [
    ({"holds_if": ">"}, "holds_if"),
    ({"values": []}, "finite"),
    ({"values": [float("nan")]}, "finite"),
    ({"values": [0.0, 1.0]}, "positive"),
])
def test_check_rejects_what_it_cannot_judge(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Check(**{"name": "x", "values": [1.0], "line": 1.0, "holds_if": ">=", **kwargs})


# ---- predicted, measured ÷ predicted, facts ------------------------------------------------------


def test_a_check_reports_measured_over_predicted_with_its_interval():
    c = Check("speedup", [1.8, 2.0, 2.2, 2.0, 1.9], 1.0, ">=", fmt="{:.2f}", predicted=4.0, key="speedup")
    assert c.over_predicted() == pytest.approx((0.5, 0.45, 0.55))
    assert "predicted 4.00, measured ÷ predicted 0.50 (0.45–0.55) → HOLDS" in c.describe()
    entry = judge("claim", [c], load(0.0)).as_dict()["checks"][0]
    assert entry["key"] == "speedup" and entry["predicted"] == 4.0
    assert entry["measured_over_predicted"] == pytest.approx([0.5, 0.45, 0.55])
    below = Check("ratio", [2.0] * 5, 1.0, ">=", predicted=-4.0)  # a negative prediction keeps lo ≤ hi
    assert below.over_predicted() == (-0.5, -0.5, -0.5)


def test_a_check_without_a_prediction_carries_null_and_prints_none():
    c = Check("tokens", [3.0], 1.0, ">=", timed=False)
    entry = judge("claim", [c], load(0.0)).as_dict()["checks"][0]
    assert entry["predicted"] is None and entry["measured_over_predicted"] is None
    assert "predicted" not in c.describe()
    zero = Check("tokens that differ", [0.0], 0.0, "<=", timed=False, predicted=0)
    assert zero.over_predicted() is None and "predicted 0 →" in zero.describe()  # no ratio over 0
    count = Check("bytes", [110.0], 120.0, "<=", timed=False, predicted=100)
    assert "measured ÷ predicted 1.10 →" in count.describe()  # a count: no interval to print


def test_the_ratio_judges_the_mechanism_on_a_band():
    """A lesson judges measured ÷ predicted against its band by judging values ÷ predicted: a run at half the
    prediction fails a band of 0.7–1.3 on the low side whatever the paper's figure says."""
    predicted, measured = 2.0, [1.0, 1.05, 0.95, 1.0, 1.02]
    ratio = [m / predicted for m in measured]
    assert Check("measured ÷ predicted", ratio, 0.7, ">=", predicted=1.0).outcome() == NOT_SUPPORTED
    assert Check("measured ÷ predicted", [r * 2 for r in ratio], 0.7, ">=", predicted=1.0).outcome() == HOLDS


@pytest.mark.parametrize("kwargs,message", [({"predicted": float("inf")}, "finite prediction"),
                                            ({"predicted": float("nan")}, "finite prediction")])
def test_a_prediction_must_be_a_number(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Check("x", [1.0] * 5, 1.0, ">=", **kwargs)


def test_a_check_key_defaults_to_its_name_and_keys_must_differ():
    assert Check("Paged ÷ contiguous, block 16", [1.0], 1.0, ">=", timed=False).key == "paged_contiguous_block_16"
    assert Check("x", [1.0], 1.0, ">=", timed=False, key="step_ratio").key == "step_ratio"
    twins = [Check("a", [1.0], 1, ">=", timed=False, key="k"), Check("b", [1.0], 1, ">=", timed=False, key="k")]
    with pytest.raises(ValueError, match=r"\['k'\] repeat"):
        judge("claim", twins, load(0.0))


def test_a_fact_is_printed_and_recorded_but_never_judged():
    holds = Check("speedup", [2.0] * 5, 1.0, ">=")
    fact = Fact("KV bytes per token", 36864, predicted=36864, fmt="{:.0f}", why="a count equal to its formula")
    odd = Fact("a figure far off its prediction", 1.0, predicted=100.0)
    v = judge("claim", [holds], load(0.0), facts=[fact, odd])
    assert v.outcome == HOLDS, "a fact 100× off its prediction decides nothing"
    assert ("fact: KV bytes per token: 36864 (predicted 36864, measured ÷ predicted 1.00); a count equal to its "
            "formula") in v.lines()
    doc = v.as_dict()
    assert doc["facts"][1] == {"name": "a figure far off its prediction", "value": 1.0, "predicted": 100.0,
                               "measured_over_predicted": 0.01, "why": ""}
    assert all(c["name"] != fact.name for c in doc["checks"])
    assert judge("claim", [holds], load(0.0)).as_dict()["facts"] == []
    assert Fact("x", 2.0).describe() == "fact: x: 2"


# ---- the lesson's one verdict -------------------------------------------------------------------


def test_verdict_not_supported_wins_over_inconclusive_which_wins_over_holds():
    holds, fails, unclear = Check("a", [2.0] * 5, 1, ">="), Check("b", [0.5] * 5, 1, ">="), Check("c", [0.9, 1.1] * 3, 1, ">=")
    assert judge("claim", [holds], load(0.0)).outcome == HOLDS
    assert judge("claim", [holds, unclear], load(0.0)).outcome == INCONCLUSIVE
    assert judge("claim", [holds, unclear, fails], load(0.0)).outcome == NOT_SUPPORTED
    with pytest.raises(ValueError):
        judge("claim", [], load(0.0))


def test_an_inconclusive_verdict_names_the_check_its_interval_the_line_and_the_cap():
    rounds = measure.Rounds(["a"], {"a": [1.0] * 5}, {"a": [None] * 5}, base=3, added=2, cap_rounds=7, cap_s=4.0)
    v = judge("paging is cheap", [Check("paged ÷ contiguous", [1.2, 1.3, 1.6, 1.7, 1.4], 1.5, "<=")], load(0.25),
              [rounds])
    assert v.outcome == INCONCLUSIVE and not v.holds
    text = "\n".join(v.lines())
    assert "INCONCLUSIVE on “paged ÷ contiguous”: 1.2–1.7, where the true median lies (94% sure)," in text
    assert "straddles the line ≤ 1.5" in text and "3 + 2 added until decided; cap 7 rounds or 4 s" in text
    assert "25% of the CPU" in text
    doc = v.as_dict()
    assert doc["checks"][0]["interval"] == [1.2, 1.7] and doc["rounds"][0]["added"] == 2


def test_a_not_supported_check_prints_its_why_and_a_holding_one_does_not():
    fails = Check("gain", [1.1, 1.2, 1.15, 1.1, 1.2], 1.4, ">=", why="steps of 6 tokens at both budgets")
    holds = Check("cost", [1.1, 1.2, 1.15, 1.1, 1.2], 1.4, "<=", why="never printed")
    v = judge("claim", [fails, holds], load(0.0))
    assert v.outcome == NOT_SUPPORTED
    assert "why (gain): steps of 6 tokens at both budgets" in v.lines()
    assert not any("never printed" in line for line in v.lines())
    assert v.as_dict()["checks"][0]["why"] == "steps of 6 tokens at both budgets"
    bare = judge("claim", [Check("gain", [1.0] * 5, 1.4, ">=")], load(0.0))
    assert any("gives no explanation" in line for line in bare.lines())  # a missing why shows, it is not hidden


def test_a_decisive_verdict_names_no_rerun_but_records_the_load():
    v = judge("claim", [Check("x", [2.0, 2.1] * 3, 1.5, ">=")], load(0.02))
    assert v.outcome == HOLDS and "quiet" not in "\n".join(v.lines())
    assert "2% of the CPU" in v.lines()[-1] and v.as_dict()["load"]["share"] == 0.02


def test_print_verdict_labels_each_outcome(capsys):
    for values, label in (([2.0] * 5, "CLAIM HOLDS"), ([0.5] * 5, "NOT SUPPORTED"), ([0.5, 2.0] * 3, "INCONCLUSIVE")):
        measure.print_verdict(judge("claim", [Check("x", values, 1.0, ">=")], load(0.0)))
        assert label in capsys.readouterr().out


# ---- the machine's load -----------------------------------------------------------------------------


def test_load_share_is_what_other_processes_used():
    before = LoadReading(wall=0.0, own_cpu_s=1.0, machine_busy_s=100.0, loadavg=0.5)
    after = LoadReading(wall=10.0, own_cpu_s=11.0, machine_busy_s=125.0, loadavg=1.5)  # we used 10 s of 25 busy
    m = MachineLoad.between(before, after)
    assert m.share == pytest.approx(min(1.0, 15 / (10 * m.cores)))
    quiet = MachineLoad.between(before, LoadReading(10.0, 11.0, 110.0, 0.5))  # only our own 10 s
    assert quiet.share == 0.0
    unknown = MachineLoad.between(LoadReading(0.0, 0.0, None, None), LoadReading(1.0, 0.5, None, None))
    assert unknown.share is None and "unknown" in unknown.describe()
    # without /proc/stat: the load average, less the cores this process kept busy
    estimated = MachineLoad.between(LoadReading(0.0, 0.0, None, 2.5), LoadReading(10.0, 10.0, None, 3.0))
    assert estimated.estimated and estimated.share == pytest.approx(min(1.0, 2.0 / estimated.cores))
    assert "estimated from the load average" in estimated.describe()


def test_read_load_on_this_machine():
    a = measure.read_load()
    sum(i * i for i in range(200_000))  # some CPU time of our own
    b = measure.read_load()
    assert b.wall > a.wall and b.own_cpu_s >= a.own_cpu_s
    share = MachineLoad.between(a, b).share
    assert share is None or 0.0 <= share <= 1.0


# ---- timing in turns ------------------------------------------------------------------------------


def test_interleave_alternates_the_order_and_keeps_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name) or name.upper()) for name in "abc"}
    rounds = interleave(fns, repeats=5, warmup=1)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc") + list("cba") + list("abc")  # warm-ups, then
    assert rounds.results("b") == ["B"] * 5 and len(rounds.times("a")) == 5 and rounds.added == 0  # a b c | c b a ...
    rounds.seconds = {"a": [2.0, 4.0, 9.0], "b": [1.0, 2.0, 3.0]}
    assert rounds.ratio("a", "b") == [2.0, 2.0, 3.0] and rounds.median("a") == 4.0
    with pytest.raises(ValueError):
        interleave(fns, repeats=0)


def test_interleave_adds_rounds_until_decided_and_stops_at_its_cap():
    """A burst of load spoils the first round: the range of up to 7 rounds keeps it and straddles the line; at 8
    rounds the 90% interval drops the extreme rounds (k = 2) and clears it."""
    per_round = [0.9, 1.3, 1.2, 1.25, 1.3, 1.2, 1.3, 1.2, 1.3, 1.2, 1.3, 1.2]
    fns = {"a": lambda: None}

    def checks(r):
        return [Check("x", per_round[:r.count], 1.0, ">=")]
    decided = interleave(fns, repeats=5, warmup=0, until=measure.settled(checks), max_repeats=12, cap_s=60)
    assert decided.count == 8 and decided.added == 3 and checks(decided)[0].interval() == (1.2, 1.3)
    never = interleave(fns, repeats=5, warmup=0, until=lambda r: False, cap_s=60)
    assert never.count == never.cap_rounds == 2 * 5 + 1 and never.added == 6
    assert "5 + 6 added until decided; cap 11 rounds" in never.describe()
    timed_out = interleave({"slow": lambda: time.sleep(0.01)}, repeats=5, warmup=0, until=lambda r: False, cap_s=0.0)
    assert timed_out.count == 5  # no time for added rounds: the cap in seconds holds too
    plain = interleave(fns, repeats=5, warmup=0)
    assert plain.cap_rounds == 0 and plain.describe() == "5 rounds"


@pytest.mark.parametrize("repeats", [1, 2, 3, 4])
def test_interleave_runs_at_least_min_rounds_whatever_it_is_asked(repeats):
    """A --quick lesson asking for 2 or 3 rounds still gets 5: fewer decide no timed check."""
    calls = []
    rounds = interleave({"a": lambda: calls.append(1)}, repeats=repeats, warmup=0)
    assert rounds.count == len(calls) == MIN_ROUNDS and rounds.base == MIN_ROUNDS
    capped = interleave({"a": lambda: None}, repeats=repeats, warmup=0, until=lambda r: False, max_repeats=repeats,
                        cap_s=60)
    assert capped.count == MIN_ROUNDS, "a cap below MIN_ROUNDS does not cut the rounds under it"


# ---- a lesson that reaches an exercise still to be written ---------------------------------------------


def stubbed():
    raise NotImplementedError("exercise kv-cache-write (lesson 01): store the new keys. Hint: ...")


def run_to_exit(main) -> int:
    """common.run(main)'s exit status. A stub that escapes must fail here: left to propagate, tests/conftest.py
    would report it as a skip ("needs exercise ..."), and the test could never fail."""
    escaped = None
    try:
        common.run(main)
    except SystemExit as stop:
        return stop.code
    except NotImplementedError as e:
        escaped = str(e)  # failed outside the handler, so that the failure does not carry the stub as its context
    pytest.fail(f"the stub escaped the lesson as a traceback: {escaped}" if escaped else "the lesson did not stop")


def test_a_stub_stops_the_lesson_with_one_line(capsys):
    assert run_to_exit(stubbed) == common.STUB_EXIT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "exercise kv-cache-write" in err and "python -m minillm.classroom check kv-cache-write" in err
    assert "test_lessons_verdict.py:" in err and ", in stubbed;" in err  # where the stub is: file, line, function


def test_a_stub_reached_through_another_error_is_still_named(capsys):
    def wrapped():
        try:
            stubbed()
        except NotImplementedError as e:
            raise RuntimeError("while preparing the step") from e
    assert run_to_exit(lambda: (_ for _ in ()).throw(NotImplementedError("exercise paged-free (lesson 07): x"))) == 3
    assert "paged-free" in capsys.readouterr().err
    assert common.stub_of(RuntimeError("x")) is None
    try:
        wrapped()
    except RuntimeError as e:
        assert common.stub_of(e) == "kv-cache-write"


def test_any_other_not_implemented_error_keeps_its_traceback():
    with pytest.raises(NotImplementedError, match="not a stub"):
        common.run(lambda: (_ for _ in ()).throw(NotImplementedError("not a stub")))


def test_a_check_the_run_cannot_decide_is_inconclusive_and_says_why_and_stops_adding_rounds():
    decided = Check("ratio", [2.0, 2.1, 2.2, 2.1, 2.0], 1.0, ">=")
    starved = Check("ratio", [2.0, 2.1, 2.2, 2.1, 2.0], 1.0, ">=", undecided="two cores were needed and one was free")
    assert decided.outcome() == HOLDS and starved.outcome() == INCONCLUSIVE
    lines = judge("claim", [starved], MachineLoad(2, 1.0, None, None, 0.5)).lines()
    assert "INCONCLUSIVE on “ratio”: two cores were needed and one was free" in lines
    assert measure.settled(lambda rounds: [starved])(None), "no number of rounds decides it: adding them is waste"


def test_lesson_12_is_undecided_when_the_client_and_the_server_cannot_have_a_core_each():
    lesson = load_lesson("12_goodput")
    quiet, busy = MachineLoad(2, 10.0, None, None, 0.03), MachineLoad(2, 10.0, None, None, 0.5)
    assert lesson.starved(quiet, 0.004) == ""
    reason = lesson.starved(busy, 0.004)
    assert "left 1.0 of the 2 cores free" in reason and "ITL target 4 ms" in reason
    assert lesson.starved(MachineLoad(8, 10.0, None, None, 0.5), 0.004) == "", "4 free cores of 8 are enough"
    assert lesson.starved(MachineLoad(2, 10.0, None, None, None), 0.004) == "", "an unknown load decides nothing"


# ---- the student's own prediction (--predict KEY=VALUE) --------------------------------------------------------


def test_predict_flag_parses_key_value_pairs_and_rejects_the_rest(capsys):
    parser = common.make_parser("doc")
    args = parser.parse_args(["--predict", "speedup=3.5", "--predict", " step_growth = 2 "])
    assert args.predict == [("speedup", 3.5), ("step_growth", 2.0)]
    assert parser.parse_args([]).predict == []
    for bad in ("speedup", "speedup=fast", "=3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--predict", bad])
        assert "is not KEY=VALUE with VALUE a number" in capsys.readouterr().err


def tiny_lesson(tmp_path, predictions):
    import torch
    from minillm import PRESETS
    from minillm.checkpoints.load import random_model
    args = common.make_parser("doc").parse_args(["--model", "tiny", "--out", str(tmp_path)]
                                                + [x for k, v in predictions for x in ("--predict", f"{k}={v}")])
    return common.Lesson("99_example", args, random_model(PRESETS["tiny"], "cpu", torch.float32), torch.device("cpu"),
                         torch.float32, None, tmp_path, measure.read_load())


def test_the_students_prediction_is_printed_beside_the_lessons_and_the_measurement_and_kept(tmp_path, capsys):
    import json
    lesson = tiny_lesson(tmp_path, [("speedup", 3.0)])
    common.predict(lesson, "the cache is faster", expect={"speedup": 2.0, "tokens": 0})
    out = capsys.readouterr().out
    assert "prediction: speedup = 2   (yours: 3)" in out and "prediction: tokens = 0\n" in out
    checks = [Check("speedup", [2.4, 2.5, 2.6, 2.5, 2.4], 1.0, ">=", predicted=2.0, key="speedup"),
              Check("tokens", [0], 0, "<=", timed=False, predicted=0, key="tokens")]
    path = common.write_results(lesson, {}, judge("claim", checks, load(0.0)))
    doc = json.loads(path.read_text())
    assert doc["student_predictions"] == {"speedup": 3.0}
    assert doc["lesson_predictions"] == {"speedup": 2.0, "tokens": 0.0}
    assert "--predict speedup=3" in doc["command"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("speedup"))
    assert row.split() == ["speedup", "2", "3", "2.5", "1.25"]  # lesson's, yours, measured median, ÷ lesson's


def test_a_prediction_for_no_check_stops_before_measuring_and_names_the_keys(tmp_path):
    lesson = tiny_lesson(tmp_path, [("speedup", 3.0), ("nonsense", 1.0)])
    with pytest.raises(SystemExit, match=r"--predict nonsense: no check of this lesson has that key; its checks' keys "
                                         r"are speedup, tokens"):
        common.predict(lesson, expect={"speedup": 2.0, "tokens": 0})
    late = tiny_lesson(tmp_path, [("nonsense", 1.0)])  # a lesson that names no keys before measuring: caught at the end
    with pytest.raises(SystemExit, match="nonsense"):
        common.write_results(late, {}, judge("claim", [Check("x", [1.0], 1, ">=", timed=False, key="x")], load(0)))
