"""Goodput, one definition for the whole course (DistServe): the rate of requests that met both latency targets.

    a request meets the targets  ⇔  its TTFT ≤ the TTFT target  and  every gap between two of its tokens
                                    (each ITL) ≤ the ITL target
    goodput                      =  requests that met both ÷ the seconds the run took      (requests/s)
    its share                    =  requests that met both ÷ the requests sent             (0 to 1)

Every gap, not their mean: a stall is what a user sees. A failed request meets no
target. Throughput counts every token served; goodput only the requests served
well, so a server can keep its throughput while its goodput falls. Lessons 12 and
15 judge by it; `bench-serve --goodput` (serve.py) applies the same test and takes
vLLM's other targets as well (tpot, e2el), each a request's own value.

Invariant (tests/test_lesson_12_goodput.py): one gap over the ITL target, or a
TTFT over its target, and the request does not count.
"""
from __future__ import annotations

from typing import Mapping, Sequence


def meets(ttft_s: float | None, itls_s: Sequence[float], targets: Mapping[str, float],
          other: Mapping[str, float | None] | None = None) -> bool:
    """Did a request meet every target (seconds)? "ttft": its TTFT; "itl": its every gap; any other key: its value
    in `other` (a value of None, as a one-token request's TPOT, meets its target)."""
    values = {"ttft": ttft_s, "itl": max(itls_s, default=None), **(other or {})}
    return all(values.get(key) is None or values[key] <= limit for key, limit in targets.items())


def goodput(requests: Sequence[tuple[float, Sequence[float]] | None], duration_s: float,
            targets: Mapping[str, float]) -> dict:
    """Over `requests`, each (TTFT, its gaps) or None for one that failed: the requests/s that met every target
    ("goodput"), their share, and the counts."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0: goodput is requests per second of a run that took time")
    met = sum(r is not None and meets(r[0], r[1], targets) for r in requests)
    return {"goodput": met / duration_s, "share": met / len(requests) if requests else 0.0, "met": met,
            "requests": len(requests)}
