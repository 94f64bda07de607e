"""Lesson 06 exercise in minillm/quantize.py: weight-only int8's scale and rounding (`quantize_per_channel`).

A case is one weight matrix W [out, in] (fp32 or bf16). The answer key (key_quantize.py) gives each row's
scale (None for a row of zeros, where any positive finite scale is right) and each weight over its row's
scale, the real number q must round. `judge` checks the pair that came back: q int8 [out, in] within half a
step of that number (either neighbour at an exact half), inside [-127, 127]; scales fp32 [out], each its row's
own. It names the mistakes it recognises: one scale for the tensor, for each column, from the largest weight
rather than magnitude, over 128 or 255; rounding toward zero or down; a zero scale for a row of zeros.
"""
import math

import torch

from exercise_checks import Check, kind

SLACK = 2e-3  # on half a step: a scale right to fp32's rounding moves W / scale by at most 127 · 2⁻²³ per unit


def rows_on_scales(d, out: int, cols: int, spread: float = 3.0) -> torch.Tensor:
    """out rows of cols weights, row o scaled by 10^u, u drawn in [-spread, spread]: maxima far apart."""
    return d.randn(out, cols) * torch.tensor([10 ** d.random.uniform(-spread, spread) for _ in range(out)])[:, None]


def negative_peaks(d, out: int, cols: int) -> torch.Tensor:
    """Rows whose largest magnitude is a negative weight, each larger than any of the row's positive ones."""
    w = d.randn(out, cols).abs() * 0.5
    for o in range(out):
        w[o, d.int(0, cols - 1)] = -(1.0 + d.random.random())
    return w


def far_apart(d, out: int, cols: int) -> torch.Tensor:
    """Rows of drawn weights, the first scaled down by 100 or more and the last up by 100 or more."""
    w = d.randn(out, cols)
    w[0] *= 10 ** d.random.uniform(-3, -2)
    w[-1] *= 10 ** d.random.uniform(2, 3)
    return w


class PerChannel(Check):
    exercise = "quantize-per-channel"
    where = "minillm/quantize.py, quantize_per_channel"

    def visible(self):
        g = torch.Generator().manual_seed(0)
        return {
            "rows of different sizes each get their own scale":
                {"weight": torch.randn(4, 12, generator=g) * torch.tensor([1e-3, 1e-1, 1e1, 1e3])[:, None]},
            "a row whose largest magnitude is a negative weight":
                {"weight": torch.tensor([[0.5, -2.0, 1.0, 0.25], [3.0, -1.0, 0.5, 2.0]])},
            "a row of zeros keeps a positive scale and q of zeros":
                {"weight": torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 3.0, -4.0]])},
            "bf16 weights": {"weight": torch.randn(3, 16, generator=g).to(torch.bfloat16)},
            "one column: every weight is its row's extreme": {"weight": torch.randn(5, 1, generator=g)},
            "a square matrix, rows on different scales":
                {"weight": torch.randn(6, 6, generator=g) * torch.logspace(-2, 2, 6)[:, None]},
        }

    def situations(self):
        return {
            "rows of different sizes": lambda d: {"weight": rows_on_scales(d, d.int(2, 8), d.int(3, 32))},
            "a negative peak": lambda d: {"weight": negative_peaks(d, d.int(1, 5), d.int(2, 16))},
            "a row of zeros": lambda d: {"weight": self.with_zero_row(d, d.int(2, 6), d.int(2, 16))},
            "bf16 weights": lambda d: {"weight": rows_on_scales(d, d.int(1, 6), d.int(8, 40)).to(torch.bfloat16)},
            "one column": lambda d: {"weight": rows_on_scales(d, d.int(2, 9), 1)},
            "a square matrix": lambda d: {"weight": rows_on_scales(d, (n := d.int(2, 9)), n)},
        }

    def edges(self):
        return {
            "rows four or more orders of magnitude apart":
                lambda d: {"weight": far_apart(d, d.int(3, 6), d.int(8, 24))},
            "a row of zeros among rows of weights":
                lambda d: {"weight": self.with_zero_row(d, d.int(3, 6), d.int(4, 20))},
            "every row's largest magnitude negative":
                lambda d: {"weight": negative_peaks(d, d.int(2, 5), d.int(4, 20))},
            "a square matrix, rows on different scales":
                lambda d: {"weight": rows_on_scales(d, (n := d.int(3, 8)), n)},
        }

    @staticmethod
    def with_zero_row(d, out: int, cols: int) -> torch.Tensor:
        w = rows_on_scales(d, out, cols, 2.0)
        w[d.int(0, out - 1)] = 0.0
        return w

    def run(self, inputs):
        from minillm.quantize import quantize_per_channel
        return quantize_per_channel(inputs["weight"])

    def expect(self, inputs):
        from key_quantize import answer
        return answer(inputs["weight"])

    def judge(self, inputs, output, expected):
        w = inputs["weight"]
        out, cols = w.shape
        what = f"quantize_per_channel(W of shape {tuple(w.shape)}, {str(w.dtype).removeprefix('torch.')})"
        if not (isinstance(output, (tuple, list)) and len(output) == 2):
            raise AssertionError(f"{what}: expected the pair (q, scales), got {kind(output)}. Look at {self.where}.")
        q, scales = output
        if not isinstance(scales, torch.Tensor) or scales.shape != (out,):
            shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else None
            named = (" That is one scale for the whole tensor: each row needs its own." if shape in ((), (1,)) else
                     " That is one scale per column (input channel): the scale belongs to a row (output channel)."
                     if shape == (cols,) else "")
            raise AssertionError(f"{what}: expected scales as a tensor of shape ({out},), one per row, got "
                                 f"{kind(scales)}.{named} Look at {self.where}.")
        if scales.dtype != torch.float32:
            raise AssertionError(f"{what}: scales came back {scales.dtype}, expected torch.float32. "
                                 f"Look at {self.where}.")
        if not isinstance(q, torch.Tensor) or q.shape != (out, cols) or q.dtype != torch.int8:
            raise AssertionError(f"{what}: expected q as an int8 tensor of shape ({out}, {cols}), got {kind(q)}"
                                 + (f" of {q.dtype}" if isinstance(q, torch.Tensor) else "")
                                 + f": one byte a weight is the point. Look at {self.where}.")
        got = scales.double().tolist()
        for o, (s, want) in enumerate(zip(got, expected["scales"])):
            if want is None and not (math.isfinite(s) and s > 0):
                raise AssertionError(f"{what}: row {o} is all zeros and its scale came back {s}; W / scale must stay "
                                     "defined (0 / 0 is NaN): give such a row any positive scale, its q is 0 "
                                     f"anyway. Look at {self.where}.")
            if want is not None and not math.isclose(s, want, rel_tol=1e-5):
                named = [m for m, ms in expected["mistakes"].items() if ms[o] is not None and
                         math.isclose(s, ms[o], rel_tol=1e-5)]
                raise AssertionError(f"{what}: row {o}'s scale is {s:.6g}, expected {want:.6g}, the row's largest "
                                     "magnitude over the top of the symmetric range." + (
                                         f" This looks like a known mistake: {named[0]}." if named else "")
                                     + f" Look at {self.where}.")
        values = q.tolist()
        low, high = min(min(r) for r in values), max(max(r) for r in values)
        if low < -127 or high > 127:
            raise AssertionError(f"{what}: q holds {low if low < -127 else high}, outside [-127, 127]: -128 has no "
                                 f"positive twin, so the range is symmetric. Look at {self.where}.")
        for o, (row, exact) in enumerate(zip(values, expected["exact"])):
            for i, (x, e) in enumerate(zip(row, exact)):
                if abs(x - e) > 0.5 + SLACK:
                    toward = (" It was rounded toward zero (a cast to int8 truncates): round to the nearest."
                              if x == math.trunc(e) else " It was rounded down: round to the nearest."
                              if x == math.floor(e) else "")
                    raise AssertionError(f"{what}: q[{o}, {i}] is {x}, but W[{o}, {i}] over its row's scale is "
                                         f"{e:.4f}: q must be the nearest integer, within half a step.{toward} "
                                         f"Look at {self.where}.")


PER_CHANNEL = PerChannel()
test_quantize_per_channel = PER_CHANNEL.pytest_test()
