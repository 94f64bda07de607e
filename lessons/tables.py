"""What the lessons' printed tables share: a share of a ceiling, a duration, and a plain aligned table.

`common` re-exports each, so a lesson imports them from there.
"""
from __future__ import annotations


def pct(share: float) -> str:
    """A share of a ceiling for tables. The ceilings are measured to bound every kernel a step runs
    (`roofline.py`), so a share stays ≤ 100%; one above is flagged (*): a bug in the ceiling, never a share."""
    return f"{share:.0%}" if share <= 1 else f"{share:.0%}*"


def print_over_100_note(rows: list[list]) -> None:
    """Explain the flag of `pct` once under a table that shows one."""
    if any(isinstance(c, str) and c.endswith("%*") for r in rows for c in r):
        print("* above 100%: the step ran faster than every kernel that measured this ceiling, so the ceiling is not "
              "one: a kernel the step runs is missing from minillm/bench/roofline.py's ceiling_kernels\n")


def ms(seconds: float) -> str:
    """A duration for tables: milliseconds below a second, seconds above."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def print_table(headers: list[str], rows: list[list], title: str = "") -> None:
    """A plain aligned table; cells are shown with str()."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print()
