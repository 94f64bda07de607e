"""The answer key of the speculative-accept exercise: what the acceptance rule does with each guess.

Instructor only: `make` leaves every key_*.py out of a copy, and the check's `expect` imports it inside the
method. A case plays many seeded rounds of the same p and q, and a correct rule may draw its random
numbers any way it likes. So the key says what must hold of the tokens, not which tokens come out:

    keep[j][t]       the probability that guess t at position j is kept, once the round reaches it:
                     min(1, p_j(t) / q_j(t)); 0 where p_j(t) = 0, 1 where p_j(t) ≥ q_j(t)
    residual[j]      the distribution of the token emitted after a rejection at position j:
                     max(0, p_j − q_j), normalised
    target[j]        p_j itself: the bonus token's distribution (j = k), and, when the guesses were drawn
                     from q, the distribution of every token emitted at position j

and the same for the plausible mistakes (an inverted ratio, a test the wrong way round, a draw shared by
the guesses, a replacement from p, a bonus from the wrong row), so that the judge can name the one that
a wrong output's frequencies fit.
"""


def keep_probability(p: float, q: float) -> float:
    """min(1, p/q): how often the rule keeps a guess with target probability p and draft probability q."""
    if p <= 0:
        return 0.0
    return 1.0 if p >= q else p / q


def residual(p_row: list[float], q_row: list[float]) -> list[float]:
    """max(0, p − q), normalised: where the target's mass exceeds the draft's (all zeros if nowhere)."""
    excess = [max(0.0, a - b) for a, b in zip(p_row, q_row)]
    total = sum(excess)
    return [e / total for e in excess] if total > 0 else excess


KEEP_MISTAKES = {
    "the ratio is inverted: a guess is kept with probability min(1, q/p), not min(1, p/q)":
        lambda p, q: keep_probability(q, p),
    "the test is the wrong way round: a guess kept when its uniform draw exceeds p/q is kept with "
    "probability 1 − min(1, p/q)":
        lambda p, q: 1.0 - keep_probability(p, q),
    "a guess is kept only where p ≥ q, as greedy verification would, never with probability p/q where p < q":
        lambda p, q: float(p >= q),
}
SHARED_DRAW = ("one uniform draw is shared by every guess of a round, so a later guess is kept whenever an "
               "earlier, less likely one was: each guess needs a draw of its own")
FROM_P = "a rejected guess was resampled from the target p, not from the residual max(0, p − q) normalised"
BONUS_ROW = ("the bonus token was drawn from the last guess's row of p, not from the row after it (p has one row "
             "more than there are guesses)")


def shared_draw(keeps: list[float]) -> list[float]:
    """With one draw u for the whole round, guess j is kept, given that the round reached it, with probability
    P(u < min(keep[:j+1])) / P(u < min(keep[:j]))."""
    out, reached = [], 1.0
    for keep in keeps:
        now = min(reached, keep)
        out.append(now / reached if reached > 0 else 0.0)
        reached = now
    return out


def answer(inputs) -> dict:
    """The answer key of one case, as plain data (see the module docstring); the mistakes' tables only where
    they differ from the rule's."""
    q, p, rounds = inputs["q"].double().tolist(), inputs["p"].double().tolist(), inputs["rounds"]
    k = len(q)
    V = len(p[0])
    keep = [[keep_probability(p[j][t], q[j][t]) for t in range(V)] for j in range(k)]
    keep_if = {}
    for name, rule in KEEP_MISTAKES.items():
        table = [[rule(p[j][t], q[j][t]) for t in range(V)] for j in range(k)]
        if table != keep:
            keep_if[name] = table
    distinct = sorted({tuple(g) for g in rounds})
    shared = [[list(g), shared_draw([keep[j][t] for j, t in enumerate(g)])] for g in distinct]
    differs = any(s != [keep[j][t] for j, t in enumerate(g)] for g, s in shared)
    res = [residual(p[j], q[j]) for j in range(k)]
    return {"keep": keep, "residual": res, "target": p,
            "keep_if": keep_if, "keep_per_round_if": {SHARED_DRAW: shared} if differs else {},
            "replaced_if": {FROM_P: p[:k]} if p[:k] != res else {},
            "bonus_if": {BONUS_ROW: p[k - 1]} if k and p[k - 1] != p[k] else {}}
