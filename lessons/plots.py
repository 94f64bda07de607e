"""What the lessons' figures share: ticks at exact values, a roofline, and a verdict's checks on one axis.

A lesson draws its own panels; these are the ones several lessons draw alike.
`common.save_plot` saves the figure with the verdict as its title.
"""
from __future__ import annotations

import textwrap

import matplotlib
from matplotlib.ticker import FixedLocator, NullLocator

from minillm.bench.roofline import Ceilings
from minillm.bench.verdict import Verdict


def ticks_at(ax, values, axis: str = "x") -> None:
    """Ticks exactly at `values`, labelled plainly (1, 2, 4, 8), also on a log axis."""
    values = sorted(set(values))
    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(FixedLocator(values))
    a.set_minor_locator(NullLocator())
    a.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{v:g}" for v in values]))


def plot_roofline(ax, ceilings: Ceilings, groups: dict[str, tuple[list[float], list[float]]]) -> None:
    """A roofline on log-log axes: the roof min(peak, I·bandwidth), and groups of (intensity, FLOP/s) points."""
    xs = [x for pts in groups.values() for x in pts[0]] + [ceilings.ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(grid, [ceilings.attainable(i) for i in grid], "k-", label="roof: min(peak, I · bandwidth), best repeats")
    ax.axvline(ceilings.ridge, color="grey", ls=":", label=f"ridge {ceilings.ridge:.1f} FLOP/B")
    for (label, (intensity, flops)), marker in zip(groups.items(), "os^dv"):
        ax.loglog(intensity, flops, marker, label=label)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.legend(fontsize=8, loc="lower right")


def plot_checks(ax, verdict: Verdict) -> None:
    """Every check of the verdict on one axis: its rounds (dots), the median (bar) and its interval, and the cost
    model's prediction (×) where it has one, each divided by the claim's line, so that the line is 1 for all."""
    checks = [c for c in verdict.checks if c.line > 0]  # a count against 0 (tokens differing) has no ratio
    colors = {"HOLDS": "darkgreen", "NOT SUPPORTED": "firebrick", "INCONCLUSIVE": "darkorange"}
    for i, c in enumerate(checks):
        scale = c.line
        vals = [v / scale for v in c.values]
        lo, hi = (x / scale for x in c.interval())
        color = colors[c.outcome()]
        ax.plot([i] * len(vals), vals, ".", color="grey", alpha=0.7, label="one round" if i == 0 else None)
        ax.errorbar([i], [c.median / scale], yerr=[[c.median / scale - lo], [hi - c.median / scale]], fmt="_",
                    markersize=18, capsize=6, color=color, label="median, interval" if i == 0 else None)
        if c.predicted is not None:
            ax.plot([i + 0.25], [c.predicted / scale], "x", color="navy", markersize=8,
                    label="predicted (the cost model)" if c is next(d for d in checks if d.predicted is not None)
                    else None)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="the claim's line")
    if len(checks) <= 5:  # names fit side by side; more are named by their keys (the JSON's), slanted
        ax.set_xticks(range(len(checks)), [textwrap_fill(c.name, 22) for c in checks], fontsize=7)
    else:
        ax.set_xticks(range(len(checks)), [c.key or textwrap_fill(c.name, 30) for c in checks], fontsize=7,
                      rotation=30, ha="right", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(checks) - 0.4)
    ax.set_ylabel("value ÷ the claim's line")
    ax.set_title("the checks: rounds, median, interval\n(≥ checks hold above 1, ≤ checks below)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ys = [v / c.line for c in checks for v in c.values + ([c.predicted] if c.predicted else [])] + [1.0]
    if min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")


def textwrap_fill(text: str, width: int) -> str:
    """At most four lines of `text`, `width` characters wide: a tick label."""
    return "\n".join(textwrap.wrap(text, width)[:4])
