"""Lesson 01 exercises in minillm/sampling.py: top-k and top-p (nucleus) filtering of logits.

The oracles walk each row in plain Python: sort, count, add up probabilities.
Logits are distinct, so "the k largest" is never ambiguous.
"""
import math

import pytest
import torch

from minillm.sampling import apply_top_k, apply_top_p

TOP_K = "minillm/sampling.py, apply_top_k"
TOP_P = "minillm/sampling.py, apply_top_p"
NEG_INF = float("-inf")


def distinct_logits(rows, vocab, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * scale for _ in range(rows)]) + \
        torch.randn(rows, 1, generator=g) * 10


def check_kept(result, logits, keep_per_row, what, where):
    """result keeps exactly the listed token ids of each row, values unchanged; every other entry is -inf."""
    assert isinstance(result, torch.Tensor) and result.shape == logits.shape, (
        f"{what}: expected a tensor of shape {tuple(logits.shape)} (same as the logits), got "
        f"{tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__}. Look at {where}.")
    for row, keep in enumerate(keep_per_row):
        kept = [i for i, x in enumerate(result[row].tolist()) if x != NEG_INF]
        assert kept == sorted(keep), (
            f"{what}, row {row}: expected to keep token ids {sorted(keep)} and set the rest to -inf, "
            f"kept {kept}. Look at {where}.")
        changed = [i for i in keep if result[row, i].item() != logits[row, i].item()]
        assert not changed, (f"{what}, row {row}: kept tokens must keep their logits; token {changed[0]} had "
                             f"{logits[row, changed[0]].item():g}, came back {result[row, changed[0]].item():g}. "
                             f"Look at {where}.")


def k_largest(row, k):
    return sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:k]


@pytest.mark.exercise("sampling-top-k")
@pytest.mark.parametrize("k", [1, 3, 9])
def test_top_k_keeps_the_k_largest_of_each_row(k):
    logits = distinct_logits(rows=3, vocab=10, seed=k)
    result = apply_top_k(logits.clone(), k)
    check_kept(result, logits, [k_largest(r, k) for r in logits.tolist()], f"apply_top_k(logits, k={k})", TOP_K)


@pytest.mark.exercise("sampling-top-k")
def test_top_k_uses_each_rows_own_threshold():
    # Row 1's smallest logit is above row 0's largest: one threshold for the whole batch keeps all of row 1.
    logits = torch.stack([torch.arange(8.0), torch.arange(8.0) + 100.0, -torch.arange(8.0)])
    result = apply_top_k(logits.clone(), 2)
    check_kept(result, logits, [[6, 7], [6, 7], [0, 1]],
               "apply_top_k(logits, k=2) where each row has its own scale (the k-th largest is per row)", TOP_K)


def nucleus(row, p):
    """Token ids of the smallest set of most likely tokens whose probability reaches p, one token at a time."""
    z = sum(math.exp(x - max(row)) for x in row)
    probs = [math.exp(x - max(row)) / z for x in row]
    keep, mass = [], 0.0
    for i in sorted(range(len(row)), key=lambda i: probs[i], reverse=True):
        if mass >= p:
            break
        keep.append(i)
        mass += probs[i]
    return keep


@pytest.mark.exercise("sampling-top-p")
@pytest.mark.parametrize("p, keep", [(0.45, [2]), (0.79, [2, 0]), (0.81, [2, 0, 3]), (0.99, [2, 0, 3, 1])])
def test_top_p_keeps_the_smallest_set_reaching_p(p, keep):
    # Probabilities 0.30, 0.05, 0.50, 0.15 at token ids 0..3: the sorted order is 2, 0, 3, 1.
    logits = torch.tensor([[0.30, 0.05, 0.50, 0.15]]).log()
    result = apply_top_p(logits.clone(), p)
    check_kept(result, logits, [keep], f"apply_top_p(logits, p={p}) with probabilities [0.30, 0.05, 0.50, 0.15] "
               f"(cumulative in sorted order 0.50, 0.80, 0.95, 1.00)", TOP_P)


@pytest.mark.exercise("sampling-top-p")
def test_top_p_always_keeps_the_most_likely_token():
    logits = distinct_logits(rows=2, vocab=16, seed=7, scale=0.01)   # nearly flat: the top token has ~1/16 of the mass
    result = apply_top_p(logits.clone(), 1e-6)
    check_kept(result, logits, [k_largest(r, 1) for r in logits.tolist()],
               "apply_top_p(logits, p=1e-6) (a tiny p still keeps each row's most likely token)", TOP_P)


@pytest.mark.exercise("sampling-top-p")
@pytest.mark.parametrize("p", [0.3, 0.9])
def test_top_p_matches_a_running_sum_on_every_row(p):
    logits = distinct_logits(rows=4, vocab=40, seed=11, scale=0.15)
    result = apply_top_p(logits.clone(), p)
    check_kept(result, logits, [nucleus(r, p) for r in logits.tolist()], f"apply_top_p(logits, p={p})", TOP_P)
