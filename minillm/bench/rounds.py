"""Timing in turns: each configuration once per round, the order reversed every other round.

A lesson compares configurations by timing them, and on a shared machine a burst of load slows whichever
one it lands on. `interleave` calls them a b c | c b a | a b c ..., so drift in the load hits each alike,
and keeps every round's time and return value (`Rounds`), so a lesson judges one value per round (a ratio
of two configurations timed in the same round). With `until`, it adds rounds while a check is undecided,
up to a printed cap. It runs at least MIN_ROUNDS = 5 rounds: with n rounds the interval of a check is the
order-statistic interval of their median, and for n ≤ 4 none covers it 90% of the time (3 rounds: their
range, 75%). The verdict built from the rounds is `verdict.py`'s.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from ..device import synchronize


def progress(total: int, desc: str | None, unit: str) -> tqdm:
    """A progress bar on the terminal (none when desc is None, or when stderr is not a terminal)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=True if desc is None else None)


@dataclass
class Rounds:
    """What `interleave` measured: for each name, one time (and one return value) per round."""
    names: list[str]
    seconds: dict[str, list[float]]
    returned: dict[str, list]
    base: int = 0          # rounds asked for
    added: int = 0         # rounds added while a check was undecided, under a cap of
    cap_rounds: int = 0    # this many rounds in all
    cap_s: float = 0.0     # or this many seconds of added rounds, whichever came first

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
ADDED_ROUNDS = 2  # and bring the rounds to at most this many times those asked for (+1, so 5 → 11)
MIN_ROUNDS = 5    # the fewest rounds a timed check is decided from: the order-statistic interval of the median of
#                   n rounds covers it 1 − 2/2ⁿ of the time at best, under 90% for n ≤ 4 (75% at 3: a check whose
#                   true median sits on its line would come out decisive one run in four)


def interleave(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, device: torch.device | str = "cpu",
               desc: str | None = None, until: Callable[[Rounds], bool] | None = None, max_repeats: int | None = None,
               cap_s: float | None = None) -> Rounds:
    """Call every function `warmup` times untimed, then once per round for `repeats` rounds, in turns:
    a b c | c b a | a b c ..., so slow drift in the machine's load hits every configuration alike. At least
    MIN_ROUNDS rounds run whatever `repeats` asks (a `--quick` run included). With `until`,
    add rounds while `until(rounds)` is false, up to `max_repeats` rounds in all (default ADDED_ROUNDS·repeats + 1)
    or `cap_s` seconds of added rounds (default ADDED_TIME × the asked-for rounds' time)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    repeats = max(repeats, MIN_ROUNDS)
    names = list(fns)
    bar = progress((warmup + repeats) * len(names), desc, "run")
    for name in [n for n in names for _ in range(warmup)]:
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
        t1 = time.perf_counter()
        rounds.cap_rounds = max(max_repeats, repeats) if max_repeats is not None else ADDED_ROUNDS * repeats + 1
        rounds.cap_s = cap_s if cap_s is not None else ADDED_TIME * (t1 - t0)
        while (rounds.count < rounds.cap_rounds and time.perf_counter() - t1 < rounds.cap_s
               and not until(rounds)):
            bar.total += len(names)
            one_round(rounds.count)
            rounds.added += 1
    bar.close()
    return rounds
