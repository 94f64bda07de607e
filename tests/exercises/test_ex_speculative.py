"""Lesson 11 exercise in minillm/speculative.py: the acceptance rule of speculative sampling.

`rejection_sample(guesses, q, p, generator)` gets the draft's guesses, the
distributions q they were drawn from, and the target's distributions p at the
same positions plus one more. No model runs: p and q are written by hand over a
vocabulary of 4 tokens, so each test can say exactly what must come back. The
statistical tests use many seeded calls and a fixed significance level, so any
correct way of drawing the random numbers passes them.
"""
import pytest
import torch

from minillm.speculative import rejection_sample

WHERE = "minillm/speculative.py, rejection_sample"
LEVEL = 1e-4   # the statistical tests' significance level: a correct rule fails one in ten thousand seedings


def dist(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def call(guesses, q, p, seed=0):
    out = rejection_sample(list(guesses), q, p, torch.Generator().manual_seed(seed))
    assert isinstance(out, list) and all(type(t) is int for t in out), (
        f"rejection_sample returned {out!r}: expected a list of Python ints (the accepted guesses, then one "
        f"token of the target's own). Look at {WHERE}.")
    assert 1 <= len(out) <= len(guesses) + 1, (
        f"rejection_sample returned {len(out)} tokens for {len(guesses)} guesses: a round emits between 1 and "
        f"{len(guesses) + 1} (the accepted guesses, then exactly one more). Look at {WHERE}.")
    assert out[:-1] == list(guesses[:len(out) - 1]), (
        f"rejection_sample returned {out} for guesses {list(guesses)}: every token but the last must be a "
        f"guess, in order (the ones accepted before the first rejection). Look at {WHERE}.")
    return out


def p_value_two_sided(successes: int, n: int, prob: float) -> float:
    """How surprising `successes` in n draws of probability `prob` are (normal approximation, two-sided)."""
    sd = (n * prob * (1 - prob)) ** 0.5
    return float(torch.special.erfc(torch.tensor(abs(successes - n * prob) / sd / 2 ** 0.5)))


@pytest.mark.exercise("speculative-accept")
def test_guesses_the_target_would_make_as_often_are_all_kept():
    q = dist([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25])
    p = torch.cat([q, dist([0.0, 0.0, 1.0, 0.0])])   # p = q where the guesses are; then a sure bonus token, 2
    for seed in range(20):
        out = call([3, 1], q, p, seed)
        assert out == [3, 1, 2], (
            f"guesses [3, 1] with p = q at both positions must both be accepted (p/q = 1), then a bonus token "
            f"drawn from p's third row, which is all on token 2; got {out}. Look at {WHERE}.")


@pytest.mark.exercise("speculative-accept")
def test_a_guess_the_target_never_makes_is_rejected_and_replaced():
    q = dist([0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25])
    p = dist([0.0, 0.6, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25])
    seen = set()
    for seed in range(30):
        out = call([0, 1], q, p, seed)
        assert len(out) == 1, (f"guess 0 has p(0) = 0, so it must be rejected and the round must end there; "
                               f"got {out}. Look at {WHERE}.")
        seen.add(out[0])
    assert seen <= {1, 2} and 2 in seen, (
        f"after rejecting guess 0 the token must come from max(0, p − q) = [0, 0.1, 0.4, 0] (normalised), so it "
        f"is token 2 four times in five and never 0 or 3; over 30 seeds got {sorted(seen)}. Look at {WHERE}.")


@pytest.mark.exercise("speculative-accept")
def test_after_a_rejection_the_token_comes_from_where_p_exceeds_q():
    q = dist([0.5, 0.5, 0.0, 0.0])
    p = dist([0.1, 0.5, 0.4, 0.0], [0.0, 0.0, 0.0, 1.0])
    n, accepted = 400, 0
    for seed in range(n):
        out = call([0], q, p, seed)
        if len(out) == 2:
            accepted += 1
            assert out[1] == 3, f"after accepting guess 0 the bonus comes from p's next row (all on 3): {out}"
        else:
            assert out == [2], (
                f"guess 0 rejected: the replacement comes from max(0, p − q) = [0, 0, 0.4, 0], always token 2, "
                f"got {out}. Look at {WHERE}.")
    assert p_value_two_sided(accepted, n, 0.2) > LEVEL, (
        f"guess 0 has p = 0.1 and q = 0.5, so it must be accepted with probability 0.1/0.5 = 0.2; it was accepted "
        f"{accepted} times in {n}. Look at {WHERE}.")


@pytest.mark.exercise("speculative-accept")
def test_a_round_ends_at_its_first_rejection():
    q = dist([0.25] * 4, [0.25] * 4, [0.25] * 4)
    p = dist([0.25] * 4, [0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4)   # guess 1 has p(1) = 0; guess 3 is sure
    for seed in range(20):
        out = call([0, 1, 3], q, p, seed)
        assert out == [0, 2], (
            f"guesses [0, 1, 3]: guess 0 has p = q (kept), guess 1 has p(1) = 0 (rejected, replaced by the only "
            f"token where p > q, 2), and the round stops there whatever guess 3 is; got {out}. Look at {WHERE}.")


@pytest.mark.exercise("speculative-accept")
def test_no_guesses_means_one_token_from_the_target():
    empty = torch.zeros(0, 4)
    for seed in range(10):
        out = call([], empty, dist([0.0, 0.0, 0.0, 1.0]), seed)
        assert out == [3], f"with no guesses the round is one token drawn from p's only row; got {out}. Look at {WHERE}."


@pytest.mark.exercise("speculative-accept")
def test_the_first_token_follows_the_targets_distribution():
    """The point of the rule: whatever the draft guessed, the first token emitted is distributed as p."""
    q_row, p_row = [0.6, 0.3, 0.05, 0.05], [0.1, 0.2, 0.3, 0.4]
    q, p = dist(q_row), dist(p_row, [0.25] * 4)
    g = torch.Generator().manual_seed(1234)
    n, counts = 3000, [0] * 4
    for seed in range(n):
        guess = int(torch.multinomial(q[0], 1, generator=g))   # the draft's guess, drawn from q as a draft would
        counts[call([guess], q, p, seed)[0]] += 1
    stat = sum((c - n * pr) ** 2 / (n * pr) for c, pr in zip(counts, p_row))
    p_value = float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2)))   # χ², 3 degrees of freedom
    assert p_value > LEVEL, (
        f"with q = {q_row} and p = {p_row}, the first token emitted must be distributed as p; over {n} rounds it "
        f"came out {[round(c / n, 3) for c in counts]} (χ² p = {p_value:.1e}). Look at {WHERE}.")


@pytest.mark.exercise("speculative-accept")
def test_randomness_comes_from_the_generator():
    """A seeded request is reproducible: every random draw goes through the generator it was given."""
    q = dist([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1])
    p = dist([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4])
    runs = [[tuple(call([0, 1], q, p, seed)) for seed in range(40)] for _ in range(2)]
    torch.manual_seed(99)   # the global stream moves between the runs; the answers must not
    runs.append([tuple(call([0, 1], q, p, seed)) for seed in range(40)])
    assert runs[0] == runs[1] == runs[2], (
        f"the same seeds gave different tokens: draw every random number (the uniforms and the final token) from "
        f"`generator`, not from torch's global stream. Look at {WHERE}.")
    assert len(set(runs[0])) > 3, f"40 seeds gave only {set(runs[0])}: is the generator used at all? Look at {WHERE}."
