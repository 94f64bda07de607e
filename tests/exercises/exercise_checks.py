"""Assertions for the exercise tests whose failures teach: what was expected, what came back, where to look."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch


def assert_close(actual, expected: torch.Tensor, what: str, where: str,
                 axes: tuple[str, ...] | None = None, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """`actual` equals `expected` within fp32 tolerances (-inf only matches -inf).

    `axes` names the dimensions, so a wrong value is reported as e.g. (row 1, head 2, query 0, dim 5).
    """
    named = f" = ({', '.join(axes)})" if axes else ""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(expected.shape)}{named}, "
                             f"got {type(actual).__name__}. Look at {where}.")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {tuple(expected.shape)}{named}, "
                             f"got shape {tuple(actual.shape)}. Look at {where}.")
    got, want = actual.detach().cpu().double(), expected.detach().cpu().double()
    close = torch.isclose(got, want, rtol=rtol, atol=atol)
    if bool(close.all()):
        return
    bad = (~close).nonzero()
    first = tuple(bad[0].tolist())
    at = ", ".join(f"{a} {i}" for a, i in zip(axes, first)) if axes else ", ".join(map(str, first))
    raise AssertionError(f"{what}: {len(bad)} of {want.numel()} values are wrong. The first is at ({at}): "
                         f"expected {want[first].item():.6g}, got {got[first].item():.6g}. Look at {where}.")


def softmax_weights(scores: list[float]) -> list[float]:
    """softmax of a short list of Python floats, written out: the tests' oracle never calls the code under test."""
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def attend_one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query (D,) over L keys and values (L, D): Σ_s softmax_s(q·k_s/√D) · v_s, one key at a time."""
    D = q.shape[-1]
    scores = [float((q.double() * keys[s].double()).sum()) / math.sqrt(D) for s in range(keys.shape[0])]
    out = torch.zeros(D, dtype=torch.float64)
    for s, w in enumerate(softmax_weights(scores)):
        out += w * values[s].double()
    return out


def attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """model.causal_attention's contract, one query at a time: the queries are the last T of the L keys, unless
    `mask` (True = may look) says which keys each sees. Tests of other exercises put it in place of
    causal_attention, so that they pass or fail on their own region alone."""
    B, H, T, _ = q.shape
    L = k.shape[-2]
    allowed = (mask.expand(B, H, T, L) if mask is not None
               else torch.tensor([[s <= L - T + t for s in range(L)] for t in range(T)]).expand(B, H, T, L))
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                seen = allowed[b, h, t].nonzero().flatten()
                out[b, h, t] = attend_one_query(q[b, h, t], k[b, h, seen], v[b, h, seen])
    return out.to(q.dtype)


class Raised:
    value: BaseException | None = None


@contextmanager
def expect_error(error: type[BaseException], what: str, where: str):
    """Like pytest.raises, but an exercise's stub does not count: NotImplementedError is a RuntimeError."""
    raised = Raised()
    try:
        yield raised
    except NotImplementedError:
        raise
    except error as e:
        raised.value = e
        return
    raise AssertionError(f"{what}: expected a {error.__name__}, nothing was raised. Look at {where}.")
