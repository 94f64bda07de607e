"""Lesson 02 exercises in minillm/sampling.py: top-k and top-p (nucleus) filtering of logits.

The answer of a case is which token ids each row keeps (key_sampling.py works it out, one row at a time, with
what a few common mistakes would keep instead); `judge` compares the ids the output kept, and that the kept
logits came back unchanged. Logits are distinct, so "the k largest" is never ambiguous, and no p lies near a
row's running sum of probabilities, so float rounding cannot change which tokens reach it.
"""
import math

import torch

from exercise_checks import Check, kind

NEG_INF = float("-inf")


def distinct_logits(rows, vocab, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * scale for _ in range(rows)]) + \
        torch.randn(rows, 1, generator=g) * 10


def kept_ids(result, logits, what, where) -> list[list[int]]:
    """The ids each row of `result` kept (not -inf), after checking its shape and that kept logits are unchanged."""
    if not isinstance(result, torch.Tensor) or result.shape != logits.shape:
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(logits.shape)} (same as the logits), "
                             f"got {kind(result)}. Look at {where}.")
    return [[i for i, x in enumerate(row) if x != NEG_INF] for row in result.tolist()]


def judge_kept(result, logits, expected, what, where) -> None:
    """`result` keeps exactly expected["keep"][row] of each row, values unchanged; every other entry is -inf.
    A wrong set that is exactly what one of expected["mistakes"] keeps is reported as that mistake."""
    kept = kept_ids(result, logits, what, where)
    if kept != expected["keep"]:
        named = [m for m, answer in expected.get("mistakes", {}).items() if answer == kept]
        row = next(r for r, (got, want) in enumerate(zip(kept, expected["keep"])) if got != want)
        raise AssertionError(f"{what}, row {row}: expected to keep token ids {expected['keep'][row]} and set the rest "
                             f"to -inf, kept {kept[row]}." + (f" This looks like a known mistake: {named[0]}."
                                                             if named else "") + f" Look at {where}.")
    for row, keep in enumerate(kept):
        changed = [i for i in keep if result[row, i].item() != logits[row, i].item()]
        if not changed:
            continue
        probs = expected.get("probabilities")
        as_probs = probs is not None and all(math.isclose(result[row, i].item(), probs[row][i], rel_tol=1e-4,
                                                          abs_tol=1e-6) for i in keep)
        raise AssertionError(f"{what}, row {row}: kept tokens must keep their logits; token {changed[0]} had "
                             f"{logits[row, changed[0]].item():g}, came back {result[row, changed[0]].item():g}"
                             + (" (its probability: return the logits, not probabilities)" if as_probs else "")
                             + f". Look at {where}.")


def probabilities(*rows):
    """Logits whose softmax is exactly each row of the given probabilities (each row sums to 1)."""
    return torch.tensor(rows).log()


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

    def edges(self):
        # Vocabularies other than 2k - 1, so that keeping the V - k + 1 largest (an ascending sort) differs.
        def logits(d, rows, vocab):
            return distinct_logits(rows, vocab, seed=d.int(0, 10**9))

        return {
            "k = vocab - 1 drops only the smallest": lambda d: {"logits": logits(d, 3, 12), "k": 11},
            "a single row": lambda d: {"logits": logits(d, 1, 9), "k": 3},
            "rows far apart: each needs its own threshold": lambda d: {
                "logits": logits(d, 3, 10) + torch.tensor([[0.0], [100.0], [-100.0]]), "k": 3},
            "every logit negative, k = 1 on four rows": lambda d: {"logits": logits(d, 4, 6) - 1000.0, "k": 1},
        }

    def run(self, inputs):
        from minillm.sampling import apply_top_k
        return apply_top_k(inputs["logits"], inputs["k"])   # as the engine passes them: they must come back unchanged

    def expect(self, inputs):
        from key_sampling import top_k_key
        return top_k_key(inputs["logits"], inputs["k"])

    def judge(self, inputs, output, expected):
        logits, k = inputs["logits"], inputs["k"]
        judge_kept(output, logits, expected,
                   f"apply_top_k(logits of shape {tuple(logits.shape)}, k={k}) (each row keeps its own k largest)",
                   self.where)


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
        four = probabilities([0.30, 0.05, 0.50, 0.15])
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

    def edges(self):
        # Probabilities with no running sum near the p asked of them. The draw moves each row's tokens to other
        # ids (the most likely ones mostly away from the front, so that a mask left in sorted order keeps other
        # ids) and shifts its logits by a constant, which leaves its softmax, and so its nucleus, as it was.
        shuffled = ([0.04, 0.06, 0.10, 0.35, 0.25, 0.20],   # running sums .35 .60 .80 .90 .96 1
                    [0.02, 0.03, 0.15, 0.05, 0.45, 0.30],   # .45 .75 .90 .95 .98 1
                    [0.01, 0.02, 0.07, 0.10, 0.30, 0.50])   # .50 .80 .90 .97 .99 1

        def moved(d, *rows):
            logits = probabilities(*rows)
            order = torch.stack([d.randperm(logits.shape[1]) for _ in rows])
            return logits.gather(1, order) + torch.tensor([[d.random.uniform(-5, 5)] for _ in rows])

        return {
            "a per-row tensor p, a different p for each row": lambda d: {
                "logits": moved(d, *shuffled), "p": torch.tensor([[0.7], [0.5], [0.2]])},
            "the token that makes the mass cross p is kept": lambda d: {"logits": moved(d, *shuffled), "p": 0.62},
            "the most likely token alone reaches p": lambda d: {"logits": moved(d, [0.1, 0.2, 0.7]), "p": 0.6},
            "a single row whose nucleus is all but its least likely token": lambda d: {
                "logits": moved(d, [0.05, 0.3, 0.15, 0.26, 0.24]), "p": 0.9},
        }

    def run(self, inputs):
        from minillm.sampling import apply_top_p
        return apply_top_p(inputs["logits"], inputs["p"])   # as the engine passes them: they must come back unchanged

    def expect(self, inputs):
        from key_sampling import top_p_key
        return top_p_key(inputs["logits"], inputs["p"])

    def judge(self, inputs, output, expected):
        logits, p = inputs["logits"], inputs["p"]
        per_row = p.flatten().tolist() if isinstance(p, torch.Tensor) else None
        shown = f"p={p:.6g}" if per_row is None else f"a per-row p of {[round(x, 4) for x in per_row]}"
        judge_kept(output, logits, expected,
                   f"apply_top_p(logits of shape {tuple(logits.shape)}, {shown}) (each row keeps its most likely "
                   f"tokens until their probability reaches its p)", self.where)


TOP_K, TOP_P = TopK(), TopP()
test_top_k = TOP_K.pytest_test()
test_top_p = TOP_P.pytest_test()
