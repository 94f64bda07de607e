"""The answer keys of lesson 02's sampling exercises: which token ids each row keeps, worked out in plain Python.

Instructor only: `make` leaves every key_*.py out of a copy, and writes the visible cases' answers into it as
literal data instead. Each function walks one row at a time: sort, count, add up probabilities. Besides the right
answer, each key says what a few common mistakes would keep, so that a message can name the mistake it sees.
"""
import math


def k_largest(row: list[float], k: int) -> list[int]:
    """The ids of the k largest logits of one row, in increasing id order (logits are distinct)."""
    return sorted(sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:k])


def top_k_key(logits, k: int) -> dict:
    """What apply_top_k must keep of each row, and what four mistakes would keep instead."""
    rows = logits.tolist()
    every = sorted((x for row in rows for x in row), reverse=True)
    lowest_threshold = min(sorted(row, reverse=True)[k - 1] for row in rows)
    flat_threshold = every[k - 1]
    return {
        "keep": [k_largest(row, k) for row in rows],
        "probabilities": [_softmax(row) for row in rows],
        "mistakes": {
            "one threshold for the whole batch (the lowest row's k-th largest) instead of one per row":
                [[i for i, x in enumerate(row) if x >= lowest_threshold] for row in rows],
            "the k largest of the whole batch instead of the k largest of each row":
                [[i for i, x in enumerate(row) if x >= flat_threshold] for row in rows],
            "keeps k + 1 tokens: the threshold is the (k+1)-th largest logit": [k_largest(row, k + 1) for row in rows],
            "keeps k - 1 tokens: the k-th largest logit itself is dropped": [k_largest(row, k - 1) for row in rows],
            "keeps the largest V - k + 1: the threshold is the k-th smallest logit (an ascending sort)":
                [k_largest(row, len(row) - k + 1) for row in rows],
        },
    }


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    z = sum(math.exp(x - top) for x in row)
    return [math.exp(x - top) / z for x in row]


def nucleus(row: list[float], p: float, keep_crossing: bool = True) -> list[int]:
    """Token ids, most likely first, of the smallest set of most likely tokens whose probability reaches p, one
    token at a time. `keep_crossing=False` gives a classic mistake: the token that makes the mass cross p dropped."""
    probs = _softmax(row)
    keep, mass = [], 0.0
    for i in sorted(range(len(row)), key=lambda i: probs[i], reverse=True):
        if mass >= p or (not keep_crossing and keep and mass + probs[i] > p):
            break
        keep.append(i)
        mass += probs[i]
    return keep


def top_p_key(logits, p) -> dict:
    """What apply_top_p must keep of each row, and what three mistakes would keep instead."""
    rows = logits.tolist()
    per_row = p.flatten().tolist() if hasattr(p, "flatten") else [p] * len(rows)
    keep = [nucleus(row, q) for row, q in zip(rows, per_row)]
    mistakes = {
        "the token whose probability makes the mass cross p was dropped":
            [sorted(nucleus(row, q, keep_crossing=False)) for row, q in zip(rows, per_row)],
        "the decisions made in sorted order were applied to the token ids as they are (not scattered back)":
            [list(range(len(ids))) for ids in keep],
    }
    if hasattr(p, "flatten"):
        mistakes["one p for all rows: the first row's p was used for every row"] = \
            [sorted(nucleus(row, per_row[0])) for row in rows]
    return {"keep": [sorted(ids) for ids in keep], "mistakes": mistakes}
