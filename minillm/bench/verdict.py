"""A verdict from the uncertainty the run itself measured, on a machine others share.

A lesson compares configurations (naive against cached, chunked against not) by
timing them, and on a shared machine a burst of load slows whichever one it
lands on. So every lesson measures and judges the same way:

    before = read_load()
    checks = lambda r: [Check("naive time / cached time", r.ratio("naive", "cached"), line=1.0, holds_if=">=",
                              predicted=model_ratio, key="speedup", why=...)]
    rounds = interleave({"naive": f, "cached": g}, repeats=5, until=settled(checks))   # f g | g f | f g ...
    print_verdict(judge("the KV cache makes decoding faster", checks(rounds), MachineLoad.between(before, read_load()),
                        facts=[Fact("FLOPs naive ÷ cached", flops_ratio, why="the cost model's arithmetic")]))

0. Predict, then measure. A check carries `predicted`: the lesson's cost model evaluated on this
   machine's measured ceilings before anything is timed, in the units of its values. It prints
   measured ÷ predicted with its interval; a check whose point is the mechanism is judged on that
   ratio against a band the cost model's uncertainty sets. A figure that cannot refute the claim (a
   count equal to its formula by construction) is a `Fact`: printed and recorded, never judged.

1. Measure in turns (`interleave`, in `rounds.py`): each configuration once per round, the order
   reversed every other round, and judge one value per round: a ratio of two of them,
   or a rate ÷ a ceiling kernel timed in that round, so a moment's load hits both sides.
2. The interval is the run's own: sorted, x(k) .. x(n+1−k) holds the median with probability
   1 − 2·P(Binomial(n, ½) < k) whatever the distribution; k is the largest that keeps 90%
   (`median_interval`; for n ≤ 4 none does, and it is the whole range: 50%, 75%, 88%). So
   `interleave` runs at least MIN_ROUNDS = 5 rounds (the range of 5 holds the median 94% of the
   time), and a timed check with fewer values is INCONCLUSIVE whatever they show.
   The load (`read_load`, `MachineLoad`, in `load.py`) is printed and widens nothing.
3. A check HOLDS if its whole interval lies on the claim's side of the line, is
   NOT SUPPORTED if on the other (its `why` says what the run's numbers show of
   the cause), INCONCLUSIVE if the line falls inside it (the message names the
   interval, the line, the rounds and the cap). A count (tokens, bytes) has no
   spread and is never inconclusive; one the lesson cannot decide (`undecided`,
   with its reason) always is.
4. While a check straddles its line (a busy machine scatters the rounds),
   `until=settled(checks)` adds rounds up to a printed cap: 2 × the rounds asked
   for + 1, or as long again as they took.
5. One verdict (`judge`): NOT SUPPORTED if any check is, else INCONCLUSIVE if any is, else
   HOLDS; facts never enter it. A busy machine can make a lesson slower or INCONCLUSIVE; it cannot
   flip its verdict.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable

from .load import LoadReading, MachineLoad, read_load  # noqa: F401  (re-exported: lessons import them from here)
from .rounds import ADDED_ROUNDS, ADDED_TIME, MIN_ROUNDS, Rounds, interleave, progress  # noqa: F401  (the same)

HOLDS, NOT_SUPPORTED, INCONCLUSIVE = "HOLDS", "NOT SUPPORTED", "INCONCLUSIVE"


CONFIDENCE = 0.9  # the interval of a timed check holds the median of its rounds at least this often (n ≥ 5)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(lo, hi, coverage): the order-statistic interval x(k) .. x(n+1−k) of the median with the largest k whose
    coverage 1 − 2·P(Binomial(n, ½) < k) is at least `confidence`; the whole range (k = 1) when none is."""
    xs, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    coverage = lambda k: 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n  # noqa: E731
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], max(0.0, coverage(k))


@dataclass
class Check:
    """One measured quantity against the line a claim draws."""
    name: str
    values: list[float]     # one per round; a counted quantity: one value
    line: float
    holds_if: str           # ">=" or "<=": the claim's side of the line
    timed: bool = True      # False for counts (tokens, bytes), which have no spread
    fmt: str = "{:.3g}"
    why: str = ""           # what the run's numbers say of a value on the wrong side; printed when NOT SUPPORTED
    of_ceiling: bool = False  # shares of a ceiling: one above 1 is flagged (*), never shown as a share
    undecided: str = ""     # why this run cannot decide it whatever its interval (lesson 12: too few free cores)
    predicted: float | None = None  # the cost model's value of the same quantity on this machine, before measuring
    key: str = ""           # a short identifier (`--predict key=value`); made from the name when empty

    def __post_init__(self):
        self.key = self.key or re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")
        if self.predicted is not None:
            self.predicted = float(self.predicted)
            if not math.isfinite(self.predicted):
                raise ValueError(f"check {self.name!r} needs a finite prediction, got {self.predicted}")
        if self.holds_if not in (">=", "<="):
            raise ValueError(f"holds_if={self.holds_if!r} must be '>=' or '<='")
        self.values = [float(v) for v in self.values]
        if not self.values or not all(math.isfinite(v) for v in self.values):
            raise ValueError(f"check {self.name!r} needs finite values, got {self.values}")
        if self.timed and min(self.values) <= 0:
            raise ValueError(f"timed check {self.name!r} needs positive values (times, rates or their ratios), "
                             f"got {self.values}")

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def interval(self) -> tuple[float, float]:
        """The order-statistic interval of the median (see `median_interval`); a count is its own interval."""
        return median_interval(self.values)[:2] if self.timed else (min(self.values), max(self.values))

    @property
    def coverage(self) -> float:
        return median_interval(self.values)[2] if self.timed else 1.0

    @property
    def too_few_rounds(self) -> bool:
        """A timed check from fewer than MIN_ROUNDS values: its interval holds the median under 90% of the time."""
        return self.timed and len(self.values) < MIN_ROUNDS

    def over_predicted(self) -> tuple[float, float, float] | None:
        """measured ÷ predicted: (median, lo, hi) of the values and their interval over the prediction; None
        without a prediction (or with a prediction of 0, where a ratio means nothing)."""
        if not self.predicted:
            return None
        lo, hi = sorted(x / self.predicted for x in self.interval())
        return self.median / self.predicted, lo, hi

    def _holds(self, x: float) -> bool:
        return x >= self.line if self.holds_if == ">=" else x <= self.line

    def outcome(self) -> str:
        """HOLDS, NOT SUPPORTED or INCONCLUSIVE: where the interval lies against the line."""
        lo, hi = (self._holds(x) for x in self.interval())
        return INCONCLUSIVE if self.undecided or self.too_few_rounds or lo != hi else HOLDS if lo else NOT_SUPPORTED

    def _f(self, x: float) -> str:
        return self.fmt.format(x) + ("*" if self.of_ceiling and x > 1 else "")

    def relation(self) -> str:
        return f"{self.holds_if.replace('>=', '≥').replace('<=', '≤')} {self.fmt.format(self.line)}"

    def describe(self) -> str:
        (lo, hi), n = self.interval(), len(self.values)
        text = f"{self.name} {self.relation()}: {self._f(self.median)}"
        if self.timed:
            text += f" (median of {n} round{'s' * (n != 1)}; the true median lies in {self._f(lo)}–{self._f(hi)}, " \
                    f"{self.coverage:.0%} sure)"
        if self.predicted is not None:
            text += f"; predicted {self.fmt.format(self.predicted)}"
            if (r := self.over_predicted()) is not None:
                text += f", measured ÷ predicted {r[0]:.2f}" + (f" ({r[1]:.2f}–{r[2]:.2f})" if self.timed else "")
        text += f" → {self.outcome()}"
        if self.of_ceiling and max(self.values) > 1:
            text += " (* over 100%: faster than every kernel that measured the ceiling: a bug in the ceiling)"
        return text


@dataclass
class Fact:
    """A figure the run reports that cannot refute the claim (a count equal to its formula by construction, a
    quantity the lesson set itself): printed as "fact: ..." and recorded under "facts", never judged."""
    name: str
    value: float
    predicted: float | None = None
    fmt: str = "{:.3g}"
    why: str = ""  # why it cannot refute the claim

    def __post_init__(self):
        self.value = float(self.value)
        self.predicted = None if self.predicted is None else float(self.predicted)

    def over_predicted(self) -> float | None:
        return self.value / self.predicted if self.predicted else None

    def describe(self) -> str:
        text = f"fact: {self.name}: {self.fmt.format(self.value)}"
        if self.predicted is not None:
            text += f" (predicted {self.fmt.format(self.predicted)}" + (
                f", measured ÷ predicted {r:.2f})" if (r := self.over_predicted()) is not None else ")")
        return text + (f"; {self.why}" if self.why else "")

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "predicted": self.predicted,
                "measured_over_predicted": self.over_predicted(), "why": self.why}


def settled(make_checks: Callable[[Rounds], list[Check]]) -> Callable[[Rounds], bool]:
    """An `until` for `interleave`: every check built from the rounds so far is decided, or `undecided`."""
    return lambda rounds: all(c.outcome() != INCONCLUSIVE or c.undecided for c in make_checks(rounds))


@dataclass
class Verdict:
    claim: str
    outcome: str
    checks: list[Check]
    load: MachineLoad
    notes: list[str] = field(default_factory=list)  # the lesson's reading of the numbers, after the checks
    rounds: list[Rounds] = field(default_factory=list)  # the timed rounds the checks came from (for their caps)
    facts: list[Fact] = field(default_factory=list)  # figures reported beside the checks, never judged

    @property
    def holds(self) -> bool:
        return self.outcome == HOLDS

    def lines(self) -> list[str]:
        """Every check, every fact, the `why` of each NOT SUPPORTED check, the notes, each INCONCLUSIVE one's
        reason, the load."""
        lines = [c.describe() for c in self.checks] + [f.describe() for f in self.facts]
        lines += [f"why ({c.name}): {c.why or 'this lesson gives no explanation for this check'}"
                  for c in self.checks if c.outcome() == NOT_SUPPORTED] + self.notes
        for c in (c for c in self.checks if c.outcome() == INCONCLUSIVE):
            (lo, hi), n = c.interval(), len(c.values)
            ran = next((r.describe() for r in self.rounds if r.count == n), f"{n} rounds")  # the check's rounds
            lines.append(f"INCONCLUSIVE on “{c.name}”: " + (c.undecided or (
                f"only {n} rounds: a timed check is decided from at least {MIN_ROUNDS}" if c.too_few_rounds else
                f"{c._f(lo)}–{c._f(hi)}, where the true median lies ({c.coverage:.0%} sure), straddles the line "
                f"{c.relation()} after {ran}; rerun, ideally on a quieter machine, for a verdict")))
        lines.append(self.load.describe())
        return lines

    def as_dict(self) -> dict:
        return {"claim": self.claim, "outcome": self.outcome, "holds": self.holds, "reasons": self.lines(),
                "load": vars(self.load), "rounds": [{"count": r.count, "base": r.base, "added": r.added,
                                                     "cap_rounds": r.cap_rounds, "cap_s": r.cap_s}
                                                    for r in self.rounds],
                "checks": [{"name": c.name, "values": c.values, "median": c.median, "line": c.line,
                            "holds_if": c.holds_if, "timed": c.timed, "interval": list(c.interval()),
                            "coverage": c.coverage, "outcome": c.outcome(), "why": c.why, "undecided": c.undecided,
                            "key": c.key, "predicted": c.predicted,
                            "measured_over_predicted": None if (r := c.over_predicted()) is None else list(r)}
                           for c in self.checks],
                "facts": [f.as_dict() for f in self.facts]}


def judge(claim: str, checks: list[Check], load: MachineLoad, rounds: list[Rounds] | None = None,
          facts: list[Fact] | None = None) -> Verdict:
    """The lesson's one verdict: NOT SUPPORTED if any check is, else INCONCLUSIVE if any is, else HOLDS; the facts
    are reported beside it and decide nothing."""
    if not checks:
        raise ValueError("a verdict needs at least one check")
    if dup := sorted({c.key for c in checks if [d.key for d in checks].count(c.key) > 1}):
        raise ValueError(f"check keys {dup} repeat: give each check its own key=")
    outcome = next((o for o in (NOT_SUPPORTED, INCONCLUSIVE) if o in {c.outcome() for c in checks}), HOLDS)
    return Verdict(claim, outcome, checks, load, rounds=list(rounds or []), facts=list(facts or []))


LABELS = {HOLDS: "CLAIM HOLDS", NOT_SUPPORTED: "CLAIM NOT SUPPORTED BY THIS RUN",
          INCONCLUSIVE: "INCONCLUSIVE: this run cannot tell"}


def print_verdict(verdict: Verdict) -> None:
    print(f"Verdict: {LABELS[verdict.outcome]}\n  claim: {verdict.claim}\n  " + "\n  ".join(verdict.lines()) + "\n")
