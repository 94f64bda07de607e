"""Measuring on a shared machine, and a verdict that says when it cannot tell.

A lesson compares configurations (naive against cached, paged against
contiguous, chunked against not) by timing them. On a machine that other
processes share, one timing means little: a burst of load slows whichever
configuration it lands on, and a verdict built on it can flip from run to run.
So every lesson measures and judges the same way:

    before = read_load()
    rounds = interleave({"naive": f, "cached": g}, repeats=3)    # f g | g f | f g: drift hits both alike
    speedup = rounds.ratio("naive", "cached")                    # one value per round
    checks = [Check("naive time / cached time", speedup, line=1.0, holds_if=">=")]
    verdict = judge("the KV cache makes decoding faster", checks, MachineLoad.between(before, read_load()))
    print_verdict(verdict)

The API
-------
    read_load() -> LoadReading                a snapshot: load average, CPU time of the machine and of this process
    MachineLoad.between(before, after)        the load over a window, and `share`: the fraction of the
                                              machine's CPU time other processes took in it (/proc/stat
                                              on Linux; elsewhere estimated from the load average)
    interleave(fns, repeats, ...) -> Rounds   call every function once per round, in turns, order reversed
                                              every other round; times (and return values) per round
    Rounds.times / median / ratio / results   what each round measured
    Check(name, values, line, holds_if)       one measured quantity (a value per repeat) against the claim's line
    judge(claim, checks, load) -> Verdict     exactly one verdict per lesson: HOLDS, NOT SUPPORTED or INCONCLUSIVE
    print_verdict(verdict)                    the verdict, every check with its spread, and the machine's load

How a check is judged
---------------------
A timed check's spread is the range of its values over the repeats. The range
cannot show a load that slowed every repeat alike, so on a busy machine it is
widened by the share s of the CPU that other processes took meanwhile. Losing
that share stretches a time by 1/(1 − s), and a parallel kernel loses about as
much again, since its threads wait at every barrier for the one that was
descheduled (two busy processes on 2 cores, s ≈ 0.5, slowed gpt2's decode step
8× and its prefill 3× on the machine these lessons were written on). So the
spread becomes lo·(1 − s)² .. hi/(1 − s)²: nothing on a quiet machine (s of a
few percent), and only a large effect survives a busy one.

    HOLDS           the whole spread lies on the claim's side of the line
    NOT SUPPORTED   the whole spread lies on the other side: the data contradicts the claim
    INCONCLUSIVE    the line falls inside the spread: the spread is wider than the effect
                    (|median − line|), so this run cannot tell; rerun on a quiet machine

A counted check (tokens, bytes: nothing timed) has no spread and is never
inconclusive. The lesson's verdict is NOT SUPPORTED if any check is, else
INCONCLUSIVE if any check is, else HOLDS: never a confident verdict that the
spread does not support.
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

from minillm.timing import synchronize

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
    """What `interleave` measured: for each name, one time (and one return value) per round."""
    names: list[str]
    seconds: dict[str, list[float]]
    returned: dict[str, list]

    def times(self, name: str) -> list[float]:
        return self.seconds[name]

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, a: str, b: str) -> list[float]:
        """time(a) / time(b), round by round: paired, so a burst of load that hits one round cancels."""
        return [x / y for x, y in zip(self.seconds[a], self.seconds[b])]

    def results(self, name: str) -> list:
        return self.returned[name]


def interleave(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
               device: torch.device | str = "cpu", desc: str | None = None) -> Rounds:
    """Call every function `warmup` times untimed, then once per round for `repeats` rounds, in turns:
    a b c | c b a | a b c ..., so slow drift in the machine's load hits every configuration alike."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    names = list(fns)
    bar = progress((warmup + repeats) * len(names), desc, "run")
    for name in names:
        for _ in range(warmup):
            fns[name]()
            bar.update()
    seconds: dict[str, list[float]] = {n: [] for n in names}
    returned: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            synchronize(device)
            t0 = time.perf_counter()
            out = fns[name]()
            synchronize(device)
            seconds[name].append(time.perf_counter() - t0)
            returned[name].append(out)
            bar.update()
    bar.close()
    return Rounds(names, seconds, returned)


# ---- checks and the verdict ---------------------------------------------------------------


@dataclass
class Check:
    """One measured quantity against the line a claim draws.

    values: one per repeat (a counted quantity: one value); holds_if: ">=" or "<=";
    timed: False for counts (tokens, bytes), which have no spread; fmt formats a value.
    """
    name: str
    values: list[float]
    line: float
    holds_if: str
    timed: bool = True
    fmt: str = "{:.3g}"

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

    def spread(self, share: float | None = 0.0) -> tuple[float, float]:
        """The range of the values, widened by the load: lo·(1 − s)² .. hi/(1 − s)²; a count has none."""
        lo, hi = min(self.values), max(self.values)
        if not self.timed:
            return lo, hi
        stretch = (1 - min(share or 0.0, 0.95)) ** 2
        return lo * stretch, hi / stretch

    def _holds(self, x: float) -> bool:
        return x >= self.line if self.holds_if == ">=" else x <= self.line

    def outcome(self, share: float | None = 0.0) -> str:
        lo, hi = self.spread(share)
        if self._holds(lo) and self._holds(hi):
            return HOLDS
        if not self._holds(lo) and not self._holds(hi):
            return NOT_SUPPORTED
        return INCONCLUSIVE

    def describe(self, share: float | None = 0.0) -> str:
        f = self.fmt.format
        text = f"{self.name} {self.holds_if.replace('>=', '≥').replace('<=', '≤')} {f(self.line)}: {f(self.median)}"
        if self.timed:
            lo, hi = min(self.values), max(self.values)
            text += f" ({f(lo)}–{f(hi)} over {len(self.values)} repeat{'s' * (len(self.values) > 1)}"
            wlo, whi = self.spread(share)
            text += f"; {f(wlo)}–{f(whi)} allowing for the load)" if share else ")"
        return text + f" → {self.outcome(share)}"


@dataclass
class Verdict:
    claim: str
    outcome: str
    checks: list[Check]
    load: MachineLoad
    notes: list[str] = field(default_factory=list)  # the lesson's reading of the numbers, after the checks

    @property
    def holds(self) -> bool:
        return self.outcome == HOLDS

    def lines(self) -> list[str]:
        lines = [c.describe(self.load.share) for c in self.checks] + self.notes
        if self.outcome == INCONCLUSIVE:
            unclear = [c.name for c in self.checks if c.outcome(self.load.share) == INCONCLUSIVE]
            lines.append(f"the spread between repeats is wider than the effect for: {', '.join(unclear)}; "
                         f"{self.load.describe()}. Rerun on a quiet machine (close other programs) "
                         "for a verdict")
        else:
            lines.append(self.load.describe())
        return lines

    def as_dict(self) -> dict:
        share = self.load.share
        return {"claim": self.claim, "outcome": self.outcome, "holds": self.holds, "reasons": self.lines(),
                "load": vars(self.load),
                "checks": [{"name": c.name, "values": c.values, "median": c.median, "line": c.line,
                            "holds_if": c.holds_if, "timed": c.timed, "spread": list(c.spread(share)),
                            "outcome": c.outcome(share)} for c in self.checks]}


def judge(claim: str, checks: list[Check], load: MachineLoad) -> Verdict:
    """The lesson's one verdict: NOT SUPPORTED if any check is, else INCONCLUSIVE if any is, else HOLDS."""
    if not checks:
        raise ValueError("a verdict needs at least one check")
    outcomes = {c.outcome(load.share) for c in checks}
    outcome = NOT_SUPPORTED if NOT_SUPPORTED in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else HOLDS
    return Verdict(claim, outcome, checks, load)


def print_verdict(verdict: Verdict) -> None:
    label = {HOLDS: "CLAIM HOLDS", NOT_SUPPORTED: "CLAIM NOT SUPPORTED BY THIS RUN",
             INCONCLUSIVE: "INCONCLUSIVE: this run cannot tell"}[verdict.outcome]
    print(f"Verdict: {label}\n  claim: {verdict.claim}\n  " + "\n  ".join(verdict.lines()) + "\n")
