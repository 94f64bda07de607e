"""The answer key of lesson 06's quantizer exercise: each row's scale and where each weight falls on its row's grid.

Instructor only: `make` leaves every key_*.py out of a copy, and writes the visible cases' answers into it as
literal data instead. Worked out in float64, one row at a time:

    scale[o]   the row's largest magnitude over 127 (None for a row of zeros: any positive finite scale will do)
    exact[o]   each weight over its row's scale: the real number q must round (q is within half a step of it)

and what the plausible mistakes would give instead, so that a message can name the one an output fits.
"""


def row_scale(row: list[float]) -> float | None:
    top = max(abs(x) for x in row)
    return top / 127 if top > 0 else None


def answer(weight) -> dict:
    rows = weight.double().tolist()
    scales = [row_scale(row) for row in rows]
    exact = [[x / s if s else 0.0 for x in row] for row, s in zip(rows, scales)]
    whole = max(abs(x) for row in rows for x in row) / 127
    return {"scales": scales, "exact": exact, "mistakes": {
        "one scale for the whole tensor (its largest magnitude over 127), not one per row":
            [whole] * len(rows),
        "the scale from the row's largest weight, not its largest magnitude": [max(row) / 127 for row in rows],
        "the scale over 128 (int8's most negative value), not 127: the symmetric range is [-127, 127]":
            [s * 127 / 128 if s else None for s in scales],
        "the scale over 255 levels of an unsigned range, not 127": [s * 127 / 255 if s else None for s in scales]}}
