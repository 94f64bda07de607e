"""Lesson 01 exercises in minillm/sampling.py: top-k and top-p (nucleus) filtering of logits.

The oracles walk each row in plain Python: sort, count, add up probabilities.
Logits are distinct, so "the k largest" is never ambiguous.
"""
import math

import torch

from exercise_checks import Check, kind

NEG_INF = float("-inf")


def distinct_logits(rows, vocab, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * scale for _ in range(rows)]) + \
        torch.randn(rows, 1, generator=g) * 10


def check_kept(result, logits, keep_per_row, what, where):
    """result keeps exactly the listed token ids of each row, values unchanged; every other entry is -inf."""
    if not isinstance(result, torch.Tensor) or result.shape != logits.shape:
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(logits.shape)} (same as the logits), "
                             f"got {kind(result)}. Look at {where}.")
    for row, keep in enumerate(keep_per_row):
        kept = [i for i, x in enumerate(result[row].tolist()) if x != NEG_INF]
        if kept != sorted(keep):
            raise AssertionError(f"{what}, row {row}: expected to keep token ids {sorted(keep)} and set the rest to "
                                 f"-inf, kept {kept}. Look at {where}.")
        changed = [i for i in keep if result[row, i].item() != logits[row, i].item()]
        if changed:
            raise AssertionError(f"{what}, row {row}: kept tokens must keep their logits; token {changed[0]} had "
                                 f"{logits[row, changed[0]].item():g}, came back {result[row, changed[0]].item():g}. "
                                 f"Look at {where}.")


def k_largest(row, k):
    return sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:k]


class TopK(Check):
    exercise = "sampling-top-k"
    where = "minillm/sampling.py, apply_top_k"

    def visible(self):
        cases = {f"k={k} keeps the k largest of each row": {"logits": distinct_logits(3, 10, seed=k), "k": k}
                 for k in (1, 3, 9)}
        # Row 1's smallest logit is above row 0's largest: one threshold for the whole batch keeps all of row 1.
        cases["each row has its own threshold"] = {
            "logits": torch.stack([torch.arange(8.0), torch.arange(8.0) + 100.0, -torch.arange(8.0)]), "k": 2}
        return cases

    def situations(self):
        def middle(d):
            vocab = d.int(4, 40)
            return {"logits": distinct_logits(d.int(1, 4), vocab, seed=d.int(0, 10**9)), "k": d.int(2, vocab - 1)}

        def one(d):
            return {"logits": distinct_logits(d.int(1, 4), d.int(3, 30), seed=d.int(0, 10**9)), "k": 1}

        def offsets(d):
            rows, vocab = d.int(2, 4), d.int(5, 20)
            logits = distinct_logits(rows, vocab, seed=d.int(0, 10**9)) + torch.arange(rows)[:, None] * 100.0
            return {"logits": logits, "k": d.int(1, vocab - 1)}

        return {"k between 1 and the vocabulary": middle, "k = 1": one, "rows on different scales": offsets}

    def run(self, inputs):
        from minillm.sampling import apply_top_k
        return apply_top_k(inputs["logits"].clone(), inputs["k"])

    def verify(self, inputs, output):
        logits, k = inputs["logits"], inputs["k"]
        check_kept(output, logits, [k_largest(r, k) for r in logits.tolist()],
                   f"apply_top_k(logits of shape {tuple(logits.shape)}, k={k}) (each row keeps its own k largest)",
                   self.where)


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


def p_away_from_every_running_sum(d, logits, margin=1e-3):
    """A p in (0.05, 0.95) that no row's running sum of sorted probabilities comes within `margin` of, so that
    float32 rounding cannot change which tokens reach it."""
    sums = []
    for row in logits.tolist():
        probs = sorted((math.exp(x - max(row)) for x in row), reverse=True)
        z, mass = sum(probs), 0.0
        for q in probs:
            mass += q / z
            sums.append(mass)
    while True:
        p = d.random.uniform(0.05, 0.95)
        if all(abs(p - s) > margin for s in sums):
            return p


class TopP(Check):
    exercise = "sampling-top-p"
    where = "minillm/sampling.py, apply_top_p"

    def visible(self):
        # Probabilities 0.30, 0.05, 0.50, 0.15 at token ids 0..3: the sorted order is 2, 0, 3, 1.
        four = torch.tensor([[0.30, 0.05, 0.50, 0.15]]).log()
        cases = {f"p={p} over probabilities [0.30, 0.05, 0.50, 0.15]": {"logits": four, "p": p}
                 for p in (0.45, 0.79, 0.81, 0.99)}
        # Nearly flat: the top token has ~1/16 of the mass, and a tiny p still keeps it.
        cases["a tiny p keeps each row's most likely token"] = {"logits": distinct_logits(2, 16, seed=7, scale=0.01),
                                                                 "p": 1e-6}
        for p in (0.3, 0.9):
            cases[f"p={p} on four rows of 40"] = {"logits": distinct_logits(4, 40, seed=11, scale=0.15), "p": p}
        return cases

    def situations(self):
        def rows(d):
            logits = distinct_logits(d.int(1, 4), d.int(5, 40), seed=d.int(0, 10**9), scale=d.choice([0.1, 0.3, 1.0]))
            return {"logits": logits, "p": p_away_from_every_running_sum(d, logits)}

        def tiny(d):
            return {"logits": distinct_logits(d.int(1, 3), d.int(4, 20), seed=d.int(0, 10**9), scale=0.05),
                    "p": 10 ** -d.int(4, 8)}

        def per_row(d):   # p as an (N, 1) column, one value per row, as the engine passes it
            logits = distinct_logits(d.int(2, 4), d.int(5, 30), seed=d.int(0, 10**9), scale=d.choice([0.1, 0.3, 1.0]))
            ps = [p_away_from_every_running_sum(d, logits[r:r + 1]) for r in range(len(logits))]
            return {"logits": logits, "p": torch.tensor(ps)[:, None]}

        return {"p between 0.05 and 0.95": rows, "a tiny p": tiny, "a per-row tensor p": per_row}

    def run(self, inputs):
        from minillm.sampling import apply_top_p
        return apply_top_p(inputs["logits"].clone(), inputs["p"])

    def verify(self, inputs, output):
        logits, p = inputs["logits"], inputs["p"]
        per_row = p.flatten().tolist() if isinstance(p, torch.Tensor) else [p] * len(logits)
        shown = f"p={p:.6g}" if not isinstance(p, torch.Tensor) else f"a per-row p of {[round(x, 4) for x in per_row]}"
        check_kept(output, logits, [nucleus(r, q) for r, q in zip(logits.tolist(), per_row)],
                   f"apply_top_p(logits of shape {tuple(logits.shape)}, {shown}) (each row keeps its most likely "
                   f"tokens until their probability reaches its p)", self.where)


TOP_K, TOP_P = TopK(), TopP()
test_top_k = TOP_K.pytest_test()
test_top_p = TOP_P.pytest_test()
