"""Measuring on a shared machine, and a verdict from the uncertainty the run itself measured.

A lesson compares configurations (naive against cached, paged against
contiguous, chunked against not) by timing them. On a machine that other
processes share, one timing means little: a burst of load slows whichever
configuration it lands on. So every lesson measures and judges the same way:

    before = read_load()
    checks = lambda r: [Check("naive time / cached time", r.ratio("naive", "cached"), line=1.0, holds_if=">=",
                              why=...)]                                 # one value per round
    rounds = interleave({"naive": f, "cached": g}, repeats=3, until=settled(checks))   # f g | g f | f g ...
    verdict = judge("the KV cache makes decoding faster", checks(rounds), MachineLoad.between(before, read_load()))
    print_verdict(verdict)

The API
-------
    read_load() -> LoadReading                a snapshot: load average, CPU time of the machine and of this process
    MachineLoad.between(before, after)        the load over a window, and `share`: the fraction of the
                                              machine's CPU time other processes took in it (/proc/stat
                                              on Linux; elsewhere estimated from the load average)
    interleave(fns, repeats, until=...)       call every function once per round, in turns, order reversed
                                              every other round; while `until(rounds)` is false, add rounds,
                                              up to a cap that is printed; times (and return values) per round
    Rounds.times / median / ratio / results   what each round measured
    Check(name, values, line, holds_if, why)  one measured quantity (a value per round) against the claim's line;
                                              `why` explains, from the run's numbers, a value on the wrong side
    median_interval(values)                   the order-statistic interval of the median, and its coverage
    settled(make_checks)                      the `until` that stops adding rounds once every check is decided
    judge(claim, checks, load) -> Verdict     exactly one verdict per lesson: HOLDS, NOT SUPPORTED or INCONCLUSIVE
    print_verdict(verdict)                    the verdict, every check with its interval, and the machine's load

How a check is judged
---------------------
A timed check is one value per round, each taken inside its round: a ratio of
two configurations timed in turns (the load of that moment hits both sides),
or a rate divided by a ceiling kernel timed in the same round. Its interval is
the order-statistic interval of the median: sorted values x(1) ≤ … ≤ x(n), the
interval x(k) .. x(n+1−k) holds the median with probability
1 − 2·P(Binomial(n, ½) < k), whatever the distribution. k is the largest that
keeps that at 90% or more (for n ≤ 4 no k does, and the interval is the whole
range: 50%, 75%, 88% for 2, 3, 4 rounds; the coverage is printed). Nothing else
widens it: the load is read and printed, and it decides nothing but how long
the rounds take. When the interval straddles the line, `interleave` adds rounds
(a busy machine scatters the rounds, so it needs more of them) until the
interval clears the line or the cap is reached: the cap is printed.

    HOLDS           the whole interval lies on the claim's side of the line
    NOT SUPPORTED   the whole interval lies on the other side: the data contradicts the claim,
                    and the check's `why` says what the run's numbers show about the cause
    INCONCLUSIVE    the line falls inside the interval, even after the added rounds; the message
                    names the check, its interval and the line

A counted check (tokens, bytes: nothing timed) has no spread and is never
inconclusive. The lesson's verdict is NOT SUPPORTED if any check is, else
INCONCLUSIVE if any check is, else HOLDS.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from ..device import synchronize

HOLDS, NOT_SUPPORTED, INCONCLUSIVE = "HOLDS", "NOT SUPPORTED", "INCONCLUSIVE"


# ---- the machine's load -----------------------------------------------------------------


@dataclass
class LoadReading:
    wall: float                   # time.perf_counter()
    own_cpu_s: float              # CPU seconds this process (and its finished children) used so far
    machine_busy_s: float | None  # CPU seconds all cores spent busy since boot (/proc/stat), None off Linux
    loadavg: float | None         # 1-minute load average


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait; steal counts as busy: not ours
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def read_load() -> LoadReading:
    t = os.times()
    try:
        loadavg = os.getloadavg()[0]
    except OSError:
        loadavg = None
    return LoadReading(time.perf_counter(), t.user + t.system + t.children_user + t.children_system,
                       _machine_busy_s(), loadavg)


@dataclass
class MachineLoad:
    cores: int
    seconds: float
    loadavg_before: float | None
    loadavg_after: float | None
    share: float | None  # fraction of the machine's CPU time other processes took over the window; None: unknown
    estimated: bool = False  # share estimated from the load average (no /proc/stat: macOS, Windows)

    @classmethod
    def between(cls, before: LoadReading, after: LoadReading) -> "MachineLoad":
        cores, seconds = os.cpu_count() or 1, max(after.wall - before.wall, 1e-9)
        own = after.own_cpu_s - before.own_cpu_s
        if before.machine_busy_s is not None and after.machine_busy_s is not None:
            others = after.machine_busy_s - before.machine_busy_s - own
            return cls(cores, seconds, before.loadavg, after.loadavg, min(1.0, max(0.0, others / (seconds * cores))))
        if after.loadavg is not None:  # runnable threads on average, less the cores this process kept busy
            others = max(before.loadavg or 0.0, after.loadavg) - own / seconds
            return cls(cores, seconds, before.loadavg, after.loadavg, min(1.0, max(0.0, others / cores)), True)
        return cls(cores, seconds, before.loadavg, after.loadavg, None)

    def describe(self) -> str:
        avg = (f"load average {self.loadavg_before:.2f} → {self.loadavg_after:.2f} on {self.cores} cores"
               if self.loadavg_before is not None else f"{self.cores} cores")
        if self.share is None:
            return f"{avg}; what other processes used is unknown on this system"
        how = " (estimated from the load average)" if self.estimated else ""
        return f"{avg}; other processes took {self.share:.0%} of the CPU{how} while this lesson measured"


# ---- timing in turns --------------------------------------------------------------------


def progress(total: int, desc: str | None, unit: str) -> tqdm:
    """A progress bar on the terminal (none when desc is None, or when stderr is not a terminal)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=True if desc is None else None)


@dataclass
class Rounds:
    """What `interleave` measured: for each name, one time (and one return value) per round.

    `base` rounds were asked for; `added` more were run because the checks were not yet decided, under a cap
    of `cap_rounds` rounds in all or `cap_s` seconds of added rounds, whichever came first."""
    names: list[str]
    seconds: dict[str, list[float]]
    returned: dict[str, list]
    base: int = 0
    added: int = 0
    cap_rounds: int = 0
    cap_s: float = 0.0

    def times(self, name: str) -> list[float]:
        return self.seconds[name]

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, a: str, b: str) -> list[float]:
        """time(a) / time(b), round by round: paired, so a burst of load that hits one round cancels."""
        return [x / y for x, y in zip(self.seconds[a], self.seconds[b])]

    def results(self, name: str) -> list:
        return self.returned[name]

    @property
    def count(self) -> int:
        return len(next(iter(self.seconds.values()), []))

    def describe(self) -> str:
        """How many rounds ran and the cap on adding more."""
        text = f"{self.count} round{'s' * (self.count != 1)}"
        if self.cap_rounds > self.base:
            text += (f" ({self.base} + {self.added} added until decided; cap {self.cap_rounds} rounds or "
                     f"{self.cap_s:.2g} s of added rounds)")
        return text


ADDED_TIME = 1.0  # added rounds may take at most this many times what the asked-for rounds took
ADDED_ROUNDS = 2  # and bring the rounds to at most this many times those asked for (+1, so 2 → 5)


def interleave(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
               device: torch.device | str = "cpu", desc: str | None = None,
               until: Callable[[Rounds], bool] | None = None, max_repeats: int | None = None,
               cap_s: float | None = None) -> Rounds:
    """Call every function `warmup` times untimed, then once per round for `repeats` rounds, in turns:
    a b c | c b a | a b c ..., so slow drift in the machine's load hits every configuration alike.

    With `until`, keep adding rounds while `until(rounds)` is false, up to `max_repeats` rounds in all (default
    ADDED_ROUNDS·repeats + 1) or `cap_s` seconds of added rounds (default ADDED_TIME × the asked-for rounds' time):
    a busy machine scatters the rounds, and more of them narrow the interval of their median again."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    names = list(fns)
    bar = progress((warmup + repeats) * len(names), desc, "run")
    for name in names:
        for _ in range(warmup):
            fns[name]()
            bar.update()
    rounds = Rounds(names, {n: [] for n in names}, {n: [] for n in names}, base=repeats)

    def one_round(r: int) -> None:
        for name in names if r % 2 == 0 else names[::-1]:
            synchronize(device)
            t0 = time.perf_counter()
            out = fns[name]()
            synchronize(device)
            rounds.seconds[name].append(time.perf_counter() - t0)
            rounds.returned[name].append(out)
            bar.update()

    t0 = time.perf_counter()
    for r in range(repeats):
        one_round(r)
    if until is not None:
        base_s = time.perf_counter() - t0
        rounds.cap_rounds = max_repeats if max_repeats is not None else ADDED_ROUNDS * repeats + 1
        rounds.cap_s = cap_s if cap_s is not None else ADDED_TIME * base_s
        t1 = time.perf_counter()
        while (rounds.count < rounds.cap_rounds and time.perf_counter() - t1 < rounds.cap_s
               and not until(rounds)):
            bar.total += len(names)
            one_round(rounds.count)
            rounds.added += 1
    bar.close()
    return rounds


# ---- checks and the verdict ---------------------------------------------------------------

CONFIDENCE = 0.9  # the interval of a timed check holds the median of its rounds at least this often (n ≥ 5)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(lo, hi, coverage): the order-statistic interval x(k) .. x(n+1−k) of the median with the largest k whose
    coverage 1 − 2·P(Binomial(n, ½) < k) is at least `confidence`; the whole range (k = 1) when none is."""
    xs, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], max(0.0, coverage(k))


@dataclass
class Check:
    """One measured quantity against the line a claim draws.

    values: one per round (a counted quantity: one value); holds_if: ">=" or "<=";
    timed: False for counts (tokens, bytes), which have no spread; fmt formats a value;
    why: what the run's own numbers say about a value on the wrong side of the line (printed when the
    check is NOT SUPPORTED; every lesson gives one for every check);
    of_ceiling: the values are shares of a ceiling, so one above 1 is flagged (*), never shown as a share;
    undecided: why this run cannot decide the check whatever its interval, computed by the lesson from its own
    readings (lesson 12: fewer free cores than the processes it times need); the check is then INCONCLUSIVE.
    """
    name: str
    values: list[float]
    line: float
    holds_if: str
    timed: bool = True
    fmt: str = "{:.3g}"
    why: str = ""
    of_ceiling: bool = False
    undecided: str = ""

    def __post_init__(self):
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
        if not self.timed:
            return min(self.values), max(self.values)
        lo, hi, _ = median_interval(self.values)
        return lo, hi

    @property
    def coverage(self) -> float:
        return median_interval(self.values)[2] if self.timed else 1.0

    def _holds(self, x: float) -> bool:
        return x >= self.line if self.holds_if == ">=" else x <= self.line

    def spread(self, share: float | None = None) -> tuple[float, float]:
        """The former name of `interval`, kept for lessons written against it; the load no longer widens it."""
        return self.interval()

    def outcome(self, share: float | None = None) -> str:
        """HOLDS, NOT SUPPORTED or INCONCLUSIVE from the interval (`share`, the load, is accepted and ignored)."""
        if self.undecided:
            return INCONCLUSIVE
        lo, hi = self.interval()
        if self._holds(lo) and self._holds(hi):
            return HOLDS
        if not self._holds(lo) and not self._holds(hi):
            return NOT_SUPPORTED
        return INCONCLUSIVE

    def _f(self, x: float) -> str:
        return self.fmt.format(x) + ("*" if self.of_ceiling and x > 1 else "")

    def relation(self) -> str:
        return f"{self.holds_if.replace('>=', '≥').replace('<=', '≤')} {self.fmt.format(self.line)}"

    def interval_text(self) -> str:
        f, (lo, hi), n = self._f, self.interval(), len(self.values)
        return f"{f(lo)}–{f(hi)}: the {self.coverage:.0%} interval of the median of {n} round{'s' * (n != 1)}"

    def describe(self, share: float | None = None) -> str:
        text = f"{self.name} {self.relation()}: {self._f(self.median)}"
        if self.timed:
            text += f" ({self.interval_text()})"
        text += f" → {self.outcome()}"
        if self.of_ceiling and max(self.values) > 1:
            text += " (* over 100%: faster than the ceiling kernel of its round, which is then not its limit)"
        return text


def settled(make_checks: Callable[[Rounds], list[Check]]) -> Callable[[Rounds], bool]:
    """An `until` for `interleave`: true once every check built from the rounds so far is decided, or cannot be
    by any number of rounds (`Check.undecided`)."""
    return lambda rounds: all(c.outcome() != INCONCLUSIVE or c.undecided for c in make_checks(rounds))


@dataclass
class Verdict:
    claim: str
    outcome: str
    checks: list[Check]
    load: MachineLoad
    notes: list[str] = field(default_factory=list)  # the lesson's reading of the numbers, after the checks
    rounds: list[Rounds] = field(default_factory=list)  # the timed rounds the checks came from (for their caps)

    @property
    def holds(self) -> bool:
        return self.outcome == HOLDS

    def explanations(self) -> list[str]:
        """One line per NOT SUPPORTED check: its `why`, computed by the lesson from the run's numbers."""
        return [f"why ({c.name}): {c.why or 'this lesson gives no explanation for this check'}"
                for c in self.checks if c.outcome() == NOT_SUPPORTED]

    def lines(self) -> list[str]:
        lines = [c.describe() for c in self.checks] + self.explanations() + self.notes
        for c in self.checks:
            if c.outcome() == INCONCLUSIVE and c.undecided:
                lines.append(f"INCONCLUSIVE on “{c.name}”: {c.undecided}")
            elif c.outcome() == INCONCLUSIVE:
                mine = [r for r in self.rounds if r.count == len(c.values)]  # the rounds this check came from
                ran = mine[0].describe() if mine else f"{len(c.values)} rounds"
                lo, hi = c.interval()
                lines.append(f"INCONCLUSIVE on “{c.name}”: its interval {c._f(lo)}–{c._f(hi)} "
                             f"({c.coverage:.0%} interval of the median) straddles the line {c.relation()} after "
                             f"{ran}; rerun, ideally on a quieter machine, for a verdict")
        lines.append(self.load.describe())
        return lines

    def as_dict(self) -> dict:
        return {"claim": self.claim, "outcome": self.outcome, "holds": self.holds, "reasons": self.lines(),
                "load": vars(self.load),
                "rounds": [{"count": r.count, "base": r.base, "added": r.added, "cap_rounds": r.cap_rounds,
                            "cap_s": r.cap_s} for r in self.rounds],
                "checks": [{"name": c.name, "values": c.values, "median": c.median, "line": c.line,
                            "holds_if": c.holds_if, "timed": c.timed, "interval": list(c.interval()),
                            "coverage": c.coverage, "outcome": c.outcome(), "why": c.why, "undecided": c.undecided}
                           for c in self.checks]}


def judge(claim: str, checks: list[Check], load: MachineLoad, rounds: list[Rounds] | None = None) -> Verdict:
    """The lesson's one verdict: NOT SUPPORTED if any check is, else INCONCLUSIVE if any is, else HOLDS."""
    if not checks:
        raise ValueError("a verdict needs at least one check")
    outcomes = {c.outcome() for c in checks}
    outcome = NOT_SUPPORTED if NOT_SUPPORTED in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else HOLDS
    return Verdict(claim, outcome, checks, load, rounds=list(rounds or []))


LABELS = {HOLDS: "CLAIM HOLDS", NOT_SUPPORTED: "CLAIM NOT SUPPORTED BY THIS RUN",
          INCONCLUSIVE: "INCONCLUSIVE: this run cannot tell"}


def print_verdict(verdict: Verdict) -> None:
    print(f"Verdict: {LABELS[verdict.outcome]}\n  claim: {verdict.claim}\n  " + "\n  ".join(verdict.lines()) + "\n")
