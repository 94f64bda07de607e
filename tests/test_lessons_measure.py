"""The lessons' measuring layer (lessons/measure.py): checks judged on both sides of every line, the spread
and the machine's load, timing in turns, and the stop at an exercise still to be written (lessons/common.py)."""
import sys

import pytest

from lessons_support import load_lesson  # also puts lessons/ on sys.path

import common  # noqa: E402
import measure  # noqa: E402
from measure import HOLDS, INCONCLUSIVE, NOT_SUPPORTED, Check, LoadReading, MachineLoad, interleave, judge  # noqa: E402


def load(share, cores=2):
    return MachineLoad(cores=cores, seconds=10.0, loadavg_before=0.1, loadavg_after=0.2, share=share)


# ---- one check --------------------------------------------------------------------------------


@pytest.mark.parametrize("values,outcome", [
    ([1.6, 1.7, 1.8], HOLDS),            # the whole spread above the line
    ([1.5, 1.5], HOLDS),                 # on the line counts as holding
    ([1.2, 1.3, 1.4], NOT_SUPPORTED),    # the whole spread below
    ([1.4, 1.6], INCONCLUSIVE),          # the line inside the spread: wider than the effect
    ([1.49, 1.9, 2.0], INCONCLUSIVE),    # one repeat on the wrong side is enough to doubt
])
def test_check_at_least(values, outcome):
    assert Check("gain", values, 1.5, ">=").outcome(0.0) == outcome


@pytest.mark.parametrize("values,outcome", [
    ([1.1, 1.2], HOLDS), ([1.5], HOLDS), ([1.51, 1.6], NOT_SUPPORTED), ([1.3, 1.6], INCONCLUSIVE),
])
def test_check_at_most(values, outcome):
    assert Check("cost", values, 1.5, "<=").outcome(0.0) == outcome


def test_the_load_widens_a_timed_spread_by_the_share_others_took():
    c = Check("cost", [1.2, 1.25], 1.5, "<=")
    assert c.spread(0.0) == (1.2, 1.25)
    lo, hi = c.spread(0.1)
    assert lo == pytest.approx(1.2 * 0.81) and hi == pytest.approx(1.25 / 0.81)
    assert c.outcome(0.05) == HOLDS            # 1.25 / 0.9025 = 1.385: still under the line
    assert c.outcome(0.1) == INCONCLUSIVE      # 1.25 / 0.81 = 1.54: a busy machine could have made it look so
    far = Check("cost", [3.0, 3.1], 1.5, "<=")
    assert far.outcome(0.2) == NOT_SUPPORTED   # 3.0 · 0.64 = 1.92: no load explains it
    assert far.outcome(0.3) == INCONCLUSIVE    # 3.0 · 0.49 = 1.47: a busy enough machine could
    assert Check("cost", [1.2], 1.5, "<=").outcome(None) == HOLDS  # load unknown: judged on the spread alone


def test_a_counted_check_has_no_spread_and_ignores_the_load():
    c = Check("waste", [0.039], 0.04, "<=", timed=False)
    assert c.spread(0.9) == (0.039, 0.039) and c.outcome(0.9) == HOLDS
    assert Check("waste", [0.041], 0.04, "<=", timed=False).outcome(0.9) == NOT_SUPPORTED
    assert Check("tokens differing", [0], 0, "<=", timed=False).outcome(0.5) == HOLDS


@pytest.mark.parametrize("kwargs,message", [
    ({"holds_if": ">"}, "holds_if"),
    ({"values": []}, "finite"),
    ({"values": [float("nan")]}, "finite"),
    ({"values": [0.0, 1.0]}, "positive"),
])
def test_check_rejects_what_it_cannot_judge(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Check(**{"name": "x", "values": [1.0], "line": 1.0, "holds_if": ">=", **kwargs})


# ---- the lesson's one verdict -------------------------------------------------------------------


def test_verdict_not_supported_wins_over_inconclusive_which_wins_over_holds():
    holds, fails, unclear = Check("a", [2.0], 1, ">="), Check("b", [0.5], 1, ">="), Check("c", [0.9, 1.1], 1, ">=")
    assert judge("claim", [holds], load(0.0)).outcome == HOLDS
    assert judge("claim", [holds, unclear], load(0.0)).outcome == INCONCLUSIVE
    assert judge("claim", [holds, unclear, fails], load(0.0)).outcome == NOT_SUPPORTED
    with pytest.raises(ValueError):
        judge("claim", [], load(0.0))


def test_an_inconclusive_verdict_gives_the_spread_the_load_and_the_advice():
    v = judge("paging is cheap", [Check("paged ÷ contiguous", [1.2, 1.3], 1.5, "<=")], load(0.25))
    assert v.outcome == INCONCLUSIVE and not v.holds
    text = "\n".join(v.lines())
    assert "1.2–1.3 over 2 repeats" in text and "allowing for the load" in text
    assert "25% of the CPU" in text and "quiet machine" in text and "paged ÷ contiguous" in text
    doc = v.as_dict()
    assert doc["outcome"] == INCONCLUSIVE and doc["checks"][0]["spread"][1] == pytest.approx(1.3 / 0.75 ** 2)


def test_a_decisive_verdict_names_no_rerun_but_records_the_load():
    v = judge("claim", [Check("x", [2.0, 2.1], 1.5, ">=")], load(0.02))
    assert v.outcome == HOLDS and "quiet machine" not in "\n".join(v.lines())
    assert "2% of the CPU" in v.lines()[-1] and v.as_dict()["load"]["share"] == 0.02


def test_print_verdict_labels_each_outcome(capsys):
    for values, label in (([2.0], "CLAIM HOLDS"), ([0.5], "NOT SUPPORTED"), ([0.5, 2.0], "INCONCLUSIVE")):
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
    rounds = interleave(fns, repeats=3, warmup=1)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")  # warm-ups, then a b c | c b a | a b c
    assert rounds.results("b") == ["B"] * 3 and len(rounds.times("a")) == 3
    rounds.seconds = {"a": [2.0, 4.0, 9.0], "b": [1.0, 2.0, 3.0]}
    assert rounds.ratio("a", "b") == [2.0, 2.0, 3.0] and rounds.median("a") == 4.0
    with pytest.raises(ValueError):
        interleave(fns, repeats=0)


# ---- a lesson that reaches an exercise still to be written ---------------------------------------------


def stubbed():
    raise NotImplementedError("exercise kv-cache-write (lesson 02): store the new keys. Hint: ...")


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
    assert "test_lessons_measure.py:" in err and ", in stubbed;" in err  # where the stub is: file, line, function


def test_a_stub_reached_through_another_error_is_still_named(capsys):
    def wrapped():
        try:
            stubbed()
        except NotImplementedError as e:
            raise RuntimeError("while preparing the step") from e
    assert run_to_exit(lambda: (_ for _ in ()).throw(NotImplementedError("exercise paged-free (lesson 05): x"))) == 3
    assert "paged-free" in capsys.readouterr().err
    assert common.stub_of(RuntimeError("x")) is None
    try:
        wrapped()
    except RuntimeError as e:
        assert common.stub_of(e) == "kv-cache-write"


def test_any_other_not_implemented_error_keeps_its_traceback():
    with pytest.raises(NotImplementedError, match="not a stub"):
        common.run(lambda: (_ for _ in ()).throw(NotImplementedError("not a stub")))


# ---- under a synthetic load ---------------------------------------------------------------------


@pytest.mark.slow
def test_under_two_busy_processes_a_timed_verdict_says_inconclusive_instead_of_flipping(tmp_path):
    """Two processes that spin on every core a 2-core machine has: the lessons must see the load and not
    give a confident verdict its spread cannot carry."""
    import subprocess
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        verdicts = {}
        for stem in ("02_kv_cache", "06_paging_cost"):
            argv = ["--model", "tiny", "--device", "cpu", "--quick", "--out", str(tmp_path)]
            verdicts[stem] = load_lesson(stem).main(argv)["verdict"]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for stem, v in verdicts.items():
        assert v.load.share is not None and v.load.share > 0.25, f"{stem}: the busy processes went unseen: {v.load}"
    unclear = [v for v in verdicts.values() if v.outcome == INCONCLUSIVE]
    assert unclear, {stem: v.lines() for stem, v in verdicts.items()}
    for v in unclear:
        assert "quiet machine" in v.lines()[-1] and "of the CPU" in v.lines()[-1]
