"""Lesson 14 exercise in minillm/speculative.py: the acceptance rule of speculative sampling.

`rejection_sample(guesses, q, p, generator)` gets the draft's guesses, the
distributions q they were drawn from, and the target's distributions p at the
same positions plus one more. No model runs: a case writes p and q by hand (or
draws them, every probability a multiple of 1/32, so that float32 holds them
exactly and "p ≥ q" is never a rounding question) and plays many rounds, each
with its own seeded generator. A correct rule may draw its random numbers any
way it likes, so the answer key (tests/exercises/key_speculative.py, instructor
only) gives what must hold of the tokens, as probabilities: how often each
guess is kept once the round reaches it, the distribution of the token after a
rejection, and the target's own rows. The judge compares what came back with
them:

  * exactly, round by round: the tokens are the accepted guesses in order, then
    one more; a guess kept with probability 1 (p ≥ q at it) is always kept, one
    kept with probability 0 (p = 0) never; the token after a rejection is one
    the residual can make; the bonus token after accepting every guess is one
    the target's next distribution can make; the same seed gives the same
    round again, whatever torch's global random stream did in between;
  * in frequency, over the rounds: the guesses kept, the tokens after a
    rejection, the bonus tokens and, when the guesses were drawn from q as a
    draft would draw them, every token emitted, against the key's
    probabilities. Each is a test at significance LEVEL, run only where the
    counts are large enough for its approximation (χ² cells expecting
    MIN_EXPECTED tokens, counts whose variance is MIN_VARIANCE), so a correct
    rule fails one about once in a million (a few times that at worst: the
    approximations are not exact so far out in the tail).

The key also holds what the plausible mistakes would give (an inverted ratio,
a test the wrong way round, a draw shared by the guesses, a replacement drawn
from p, a bonus from the wrong row), and a message names the one that a wrong
output fits. Edges, graded on every seed: every guess kept then the bonus
(γ = 4), the first guess one the target never makes, q equal to p (γ = 1, every
round replayed), a guess kept a quarter of the time, two guesses that each need
a draw of their own, and γ = 6 with guesses drawn from q. Each situation is
fixed; its tokens, the rows where the situation allows, and every round's seed
are drawn from the grade's seed.
"""
import math

import torch

from exercise_checks import Check, kind

LEVEL = 1e-6       # a correct rule fails a frequency test this rarely
MIN_EXPECTED = 10  # a χ² cell expects at least this many tokens (smaller ones are pooled)
MIN_VARIANCE = 25  # a count is tested against its mean only when its variance is at least this
UNIT = 32          # drawn probabilities are multiples of 1/UNIT


def dist(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def rounds_of(guesses: list[int], n: int) -> dict:
    """n rounds of the same guesses, seeds 0..n-1."""
    return {"rounds": [list(guesses)] * n, "seeds": list(range(n))}


def p_value_normal(observed: float, mean: float, var: float) -> float:
    """Two-sided tail of a count against its mean and variance (normal approximation)."""
    return math.erfc(abs(observed - mean) / math.sqrt(2 * var))


def p_value_chi2(counts: dict[int, int], probs: list[float]) -> tuple[float, int]:
    """Pearson's χ² of token counts against `probs` (cells expecting under MIN_EXPECTED pooled); (p-value, tokens).
    A p-value of 1 when there are too few tokens to test."""
    n = sum(counts.values())
    cells = sorted(((n * pr, counts.get(t, 0)) for t, pr in enumerate(probs) if pr > 0), reverse=True)
    big = [c for c in cells if c[0] >= MIN_EXPECTED]
    small = [c for c in cells if c[0] < MIN_EXPECTED]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] >= MIN_EXPECTED:
            big.append(pooled)
        elif big:
            e, o = big.pop()
            big.append((e + pooled[0], o + pooled[1]))
    if len(big) < 2:
        return 1.0, n
    stat = sum((o - e) ** 2 / e for e, o in big)
    dof = len(big) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), n


def shown(row: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in row) + "]"


# ---------------------------------------------------------------- drawn cases

def dyadic(d, V: int, support: list[int]) -> list[float]:
    """A distribution over V tokens with mass on `support` only, each a multiple of 1/UNIT and at least 2/UNIT."""
    units = {t: 2 for t in support}
    for _ in range(UNIT - 2 * len(support)):
        units[d.choice(support)] += 1
    return [units.get(t, 0) / UNIT for t in range(V)]


def some(d, V: int, lo: int = 2, hi: int | None = None) -> list[int]:
    return sorted(d.sample(range(V), d.int(lo, min(hi or V, V))))


def draw_from(d, row: list[float]) -> int:
    return d.random.choices(range(len(row)), weights=row)[0]


def case(d, q: list[list[float]], p: list[list[float]], rounds: list[list[int]], drawn: bool, replays: int = 10) -> dict:
    dtype = d.choice([torch.float32, torch.float64])
    V = len(p[0])
    return {"q": torch.tensor(q, dtype=dtype).reshape(len(q), V), "p": torch.tensor(p, dtype=dtype), "rounds": rounds,
            "seeds": [d.int(0, 2**31 - 1) for _ in rounds], "drawn": drawn, "replays": min(replays, len(rounds))}


def until(d, make, accept):
    """make(d) until accept(result): a drawn case with a property the situation needs."""
    for _ in range(1000):
        value = make(d)
        if accept(value):
            return value
    raise RuntimeError("no draw met the situation's condition in 1000 tries")


class Accept(Check):
    exercise = "speculative-accept"
    where = "minillm/speculative.py, rejection_sample"

    def visible(self):
        q = dist([0.1, 0.2, 0.3, 0.4], [0.25] * 4)
        cases = {
            # p = q where the guesses are; then a sure bonus token, 2.
            "guesses the target would make as often are all kept, then the bonus":
                {"q": q, "p": torch.cat([q, dist([0.0, 0.0, 1.0, 0.0])]), **rounds_of([3, 1], 20)},
            # p(0) = 0: rejected; the residual max(0, p − q) is [0, 0.1, 0.4, 0], token 2 four times in five.
            "a guess the target never makes is rejected and replaced":
                {"q": dist([0.5, 0.5, 0.0, 0.0], [0.25] * 4), "p": dist([0.0, 0.6, 0.4, 0.0], [0.25] * 4, [0.25] * 4),
                 **rounds_of([0, 1], 60)},
            # guess 0 kept with probability 0.1/0.5 = 0.2; else token 2, the only one where p > q.
            "after a rejection the token comes from where p exceeds q":
                {"q": dist([0.5, 0.5, 0.0, 0.0]), "p": dist([0.1, 0.5, 0.4, 0.0], [0.0, 0.0, 0.0, 1.0]),
                 **rounds_of([0], 400)},
            # guess 0 kept (p = q), guess 1 rejected (p = 0) and replaced by 2, and guess 3 (sure) never judged.
            "a round ends at its first rejection":
                {"q": dist([0.25] * 4, [0.25] * 4, [0.25] * 4),
                 "p": dist([0.25] * 4, [0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4), **rounds_of([0, 1, 3], 20)},
            "no guesses: one token from the target":
                {"q": torch.zeros(0, 4), "p": dist([0.0, 0.0, 0.0, 1.0]), **rounds_of([], 10)},
            # prompt lookup proposes without sampling: q is all on the guess, kept with probability p(guess).
            "a guess proposed without sampling (q all on it) is kept with probability p":
                {"q": dist([0.0, 1.0, 0.0, 0.0]), "p": dist([0.2, 0.5, 0.3, 0.0], [0.25] * 4),
                 **rounds_of([1], 300)},
            # guess 0 kept with probability 0.2/0.5 = 0.4, guess 1 then with 0.25/0.5 = 0.5: one draw for both
            # would keep guess 1 every time guess 0 was kept.
            "each guess is decided by a draw of its own":
                {"q": dist([0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]),
                 "p": dist([0.2, 0.3, 0.5, 0.0], [0.25] * 4, [0.25] * 4), **rounds_of([0, 1], 600)},
            "randomness comes from the generator":
                {"q": dist([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]),
                 "p": dist([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),
                 **rounds_of([0, 1], 200), "replays": 40},
        }
        # The point of the rule: with guesses drawn from q, as a draft draws them, the first token follows p.
        g = torch.Generator().manual_seed(1234)
        q_row, p_row = [0.6, 0.3, 0.05, 0.05], [0.1, 0.2, 0.3, 0.4]
        guesses = [[int(torch.multinomial(torch.tensor(q_row), 1, generator=g))] for _ in range(2000)]
        cases["the first token follows the target's distribution"] = {
            "q": dist(q_row), "p": dist(p_row, [0.25] * 4), "rounds": guesses, "seeds": list(range(2000)),
            "drawn": True}
        for c in cases.values():
            c.setdefault("drawn", False)
            c.setdefault("replays", 5)
        return cases

    def situations(self):
        def all_kept(d):
            V, k = d.int(4, 8), d.int(1, 4)
            q = [dyadic(d, V, some(d, V)) for _ in range(k)]
            p = q + [dyadic(d, V, some(d, V, 1, 3))]
            return case(d, q, p, [[draw_from(d, row) for row in q] for _ in range(150)], drawn=True)

        def never_made(d):
            V, k = d.int(4, 8), d.int(1, 3)

            def first_rows(d):
                q0 = dyadic(d, V, some(d, V))
                guess = draw_from(d, q0)
                p0 = dyadic(d, V, d.sample([t for t in range(V) if t != guess], d.int(2, V - 1)))
                return q0, p0, guess

            # some token the target makes no more often than the draft: a rule that redraws from p would emit it
            q0, p0, guess = until(d, first_rows, lambda r: any(0 < a <= b for a, b in zip(r[1], r[0])))
            q = [q0] + [dyadic(d, V, some(d, V)) for _ in range(k - 1)]
            p = [p0] + [dyadic(d, V, some(d, V)) for _ in range(k)]
            return case(d, q, p, [[guess] + [draw_from(d, row) for row in q[1:]] for _ in range(200)], drawn=False)

        def less_often(d):
            V = d.int(3, 8)

            def rows(d):
                q0, p0 = dyadic(d, V, some(d, V)), dyadic(d, V, some(d, V))
                return q0, p0, draw_from(d, q0)

            q0, p0, guess = until(d, rows, lambda r: 0.15 <= r[1][r[2]] / r[0][r[2]] <= 0.85)
            return case(d, [q0], [p0, dyadic(d, V, some(d, V))], [[guess]] * 400, drawn=False)

        def first_rejection(d):
            V, k = d.int(4, 8), d.int(2, 4)
            j = d.int(0, k - 2)   # the guess that is refused; every guess after it would be kept
            q = [dyadic(d, V, some(d, V)) for _ in range(k)]
            guess_j = draw_from(d, q[j])
            p = [list(row) for row in q] + [dyadic(d, V, some(d, V))]
            p[j] = dyadic(d, V, d.sample([t for t in range(V) if t != guess_j], d.int(1, V - 1)))
            rounds = [[guess_j if i == j else draw_from(d, row) for i, row in enumerate(q)] for _ in range(60)]
            return case(d, q, p, rounds, drawn=False)

        def no_guesses(d):
            V = d.int(3, 8)
            return case(d, [], [dyadic(d, V, some(d, V))], [[] for _ in range(200)], drawn=False)

        def without_sampling(d):
            V, k = d.int(3, 8), d.int(1, 3)
            guesses = [d.int(0, V - 1) for _ in range(k)]
            q = [[float(t == g) for t in range(V)] for g in guesses]
            p = until(d, lambda d: [dyadic(d, V, some(d, V)) for _ in range(k + 1)],
                      lambda p: all(0.15 <= p[i][g] <= 0.85 for i, g in enumerate(guesses)))
            return case(d, q, p, [list(guesses)] * 300, drawn=False)

        def own_draws(d):
            V, k = d.int(3, 8), d.int(2, 3)

            def row(d):
                q_row, p_row = dyadic(d, V, some(d, V)), dyadic(d, V, some(d, V))
                return q_row, p_row, draw_from(d, q_row)

            # the first guess kept at most half the time, each later one 0.3-0.6 of the time: a draw shared by
            # the guesses would keep a later one far more often than that
            rows = [until(d, row, lambda r: 0.25 <= r[1][r[2]] / r[0][r[2]] <= 0.5)]
            rows += [until(d, row, lambda r: 0.3 <= r[1][r[2]] / r[0][r[2]] <= 0.6)
                     for _ in range(k - 1)]
            q, p, guesses = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
            return case(d, q, p + [dyadic(d, V, some(d, V))], [list(guesses)] * 600, drawn=False)

        def replayed(d):
            V, k = d.int(3, 6), d.int(1, 3)
            q = [dyadic(d, V, some(d, V)) for _ in range(k)]
            p = [dyadic(d, V, some(d, V)) for _ in range(k + 1)]
            return case(d, q, p, [[draw_from(d, row) for row in q] for _ in range(40)], drawn=True, replays=40)

        def drawn(d):
            V, k = d.int(3, 6), d.int(1, 3)
            q = [dyadic(d, V, some(d, V)) for _ in range(k)]
            p = [dyadic(d, V, some(d, V)) for _ in range(k + 1)]
            return case(d, q, p, [[draw_from(d, row) for row in q] for _ in range(600)], drawn=True)

        return {"p = q at every guess": all_kept, "a guess the target never makes": never_made,
                "a guess the target makes less often": less_often, "a refusal before sure guesses": first_rejection,
                "no guesses": no_guesses, "guesses proposed without sampling": without_sampling,
                "a draw for each guess": own_draws,
                "the same seeds again": replayed, "guesses drawn from q": drawn}

    def edges(self):
        def relabelled(d, q, p, guesses, n, drawn=False, replays=5):
            """The situation's rows over 4 tokens, written into a drawn vocabulary of 4 to 8 (the extra tokens
            never made) under a drawn relabelling of the tokens, with the guesses relabelled the same way; each
            of the n rounds with a drawn seed. The probabilities, and so how reliable each test is, stay."""
            V = d.int(4, 8)
            label = d.sample(range(V), 4)

            def row(old):
                new = [0.0] * V
                for t, x in enumerate(old):
                    new[label[t]] = x
                return new

            return case(d, [row(r) for r in q], [row(r) for r in p], [[label[g] for g in guesses]] * n, drawn,
                        replays)

        quarter = [0.5, 0.5, 0.0, 0.0]
        even = [0.25] * 4

        def all_kept(d):
            # p ≥ q at every guess (twice q at the first: an inverted ratio keeps it half the time); the bonus
            # row makes 2 and 3 only, which the last guess's row never makes
            return relabelled(d, [[0.5, 0.25, 0.25, 0.0], even, quarter, quarter],
                              [[0.25, 0.5, 0.25, 0.0], [0.25, 0.25, 0.5, 0.0], quarter, [0.75, 0.25, 0.0, 0.0],
                               [0.0, 0.0, 0.5, 0.5]], [1, 2, 0, 0], 40, replays=40)

        def first_refused(d):
            # p(0) = 0: always refused, then token 3, the only one where p exceeds q; the later guesses are sure
            return relabelled(d, [[0.5, 0.25, 0.25, 0.0], even, even],
                              [[0.0, 0.25, 0.25, 0.5], even, even, even], [0, 1, 2], 30)

        def q_is_p(d):
            V = d.int(3, 8)
            q0 = dyadic(d, V, some(d, V))
            return case(d, [q0], [q0, dyadic(d, V, some(d, V))], [[draw_from(d, q0)]] * 200, drawn=False,
                        replays=200)

        def a_quarter(d):
            # kept with probability 0.125/0.5; then token 2, the only one where p exceeds q
            return relabelled(d, [quarter], [[0.125, 0.375, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]], [0], 400)

        def own_draws(d):
            # each kept half the time: one draw for both would keep guess 1 whenever guess 0 was kept
            return relabelled(d, [quarter, quarter], [[0.25, 0.25, 0.5, 0.0], [0.25, 0.25, 0.0, 0.5], even],
                              [0, 1], 600)

        def six(d):
            V, k = 5, 6
            q = [dyadic(d, V, some(d, V)) for _ in range(k)]
            p = [dyadic(d, V, some(d, V)) for _ in range(k + 1)]
            return case(d, q, p, [[draw_from(d, row) for row in q] for _ in range(600)], drawn=True)

        return {"every guess kept, then the bonus (γ = 4)": all_kept,
                "the first guess refused: the target never makes it (γ = 3)": first_refused,
                "q equal to p: always kept (γ = 1), every round replayed": q_is_p,
                "a guess kept a quarter of the time (γ = 1)": a_quarter,
                "two guesses, each kept half the time by a draw of its own (γ = 2)": own_draws,
                "γ = 6, the guesses drawn from q": six}

    def run(self, inputs):
        from minillm.speculative import rejection_sample
        q, p = inputs["q"], inputs["p"]

        def play(rounds, seeds):
            return [rejection_sample(list(g), q.clone(), p.clone(), torch.Generator().manual_seed(s))
                    for g, s in zip(rounds, seeds)]

        n = inputs["replays"]
        torch.manual_seed(inputs["seeds"][0] + 1)
        first = play(inputs["rounds"], inputs["seeds"])
        torch.manual_seed(inputs["seeds"][0] + 2)   # torch's global stream moves; a seeded round must not
        return {"rounds": first, "again": play(inputs["rounds"][:n], inputs["seeds"][:n])}

    def expect(self, inputs):
        from key_speculative import answer
        return answer(inputs)

    def judge(self, inputs, output, expected):
        q, p = inputs["q"].double().tolist(), inputs["p"].double().tolist()
        rounds, seeds = inputs["rounds"], inputs["seeds"]
        outs = output["rounds"]
        if not isinstance(outs, list) or len(outs) != len(rounds):
            raise AssertionError(f"the check played {len(rounds)} rounds but got {kind(outs)} back. "
                                 f"Look at {self.where}.")
        for guesses, seed, out in zip(rounds, seeds, outs):
            self.judge_round(q, p, guesses, seed, out, expected)
        for guesses, seed, out, again in zip(rounds, seeds, outs, output["again"]):
            if again != out:
                raise AssertionError(f"the round with guesses {guesses} and a generator seeded {seed} returned {out} "
                                     f"and then, seeded the same, {again}: draw every random number (each guess's "
                                     f"test and the last token) from `generator`, not from torch's global stream. "
                                     f"Look at {self.where}.")
        self.judge_frequencies(q, p, rounds, outs, inputs["drawn"], expected)

    def judge_round(self, q, p, guesses, seed, out, expected):
        k, V = len(guesses), len(p[0])
        keep, keep_if = expected["keep"], expected["keep_if"]
        at = f"the round with guesses {guesses} (generator seeded {seed})"
        if not isinstance(out, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
            raise AssertionError(f"{at} returned {kind(out)} {out!r:.100}: expected a list of Python ints (the "
                                 f"accepted guesses, then one token of the target's own). Look at {self.where}.")
        if k and out == guesses:
            raise AssertionError(f"{at} returned exactly its guesses, {out}: a round always ends with one token of "
                                 f"the target's own. After every guess is kept it is the bonus, from the next row of "
                                 f"p (p has {k + 1} rows for {k} guess{'es' if k > 1 else ''}); after a rejection it "
                                 f"comes from where p exceeds q, which is never the refused guess itself. "
                                 f"Look at {self.where}.")
        if not 1 <= len(out) <= k + 1:
            raise AssertionError(f"{at} returned {len(out)} tokens, {out}: a round emits between 1 and {k + 1} (the "
                                 f"accepted guesses, then exactly one more). Look at {self.where}.")
        n = len(out) - 1
        if out[:n] != guesses[:n]:
            went_on = " (it looks as if the round went on after a rejection)" if n == k else ""
            raise AssertionError(f"{at} returned {out}: every token but the last must be a guess, in order (the ones "
                                 f"accepted before the first rejection; the guesses after a refused one are never "
                                 f"judged){went_on}. Look at {self.where}.")
        if not 0 <= out[-1] < V:
            raise AssertionError(f"{at} returned {out}: token {out[-1]} is outside the vocabulary of {V}. "
                                 f"Look at {self.where}.")
        for i in range(n):
            if keep[i][guesses[i]] == 0:
                raise AssertionError(f"{at} returned {out}: it accepted guess {guesses[i]} at position {i}, where the "
                                     f"target's p is 0 (p = {shown(p[i])}); a token the target never makes is never "
                                     f"accepted.{self.named(keep_if, lambda t: t[i][guesses[i]] > 0)} "
                                     f"Look at {self.where}.")
        if n < k:
            g, x = guesses[n], out[n]
            if keep[n][g] == 1:
                raise AssertionError(f"{at} returned {out}: it rejected guess {g} at position {n}, where p = "
                                     f"{p[n][g]:.3g} ≥ q = {q[n][g]:.3g}; there p/q ≥ 1, so the guess is always "
                                     f"accepted.{self.named(keep_if, lambda t: t[n][g] < 1)} Look at {self.where}.")
            if expected["residual"][n][x] == 0:
                raise AssertionError(f"{at} returned {out}: after rejecting guess {g} at position {n} it emitted "
                                     f"token {x}, where p = {p[n][x]:.3g} does not exceed q = {q[n][x]:.3g}; the "
                                     f"token after a rejection comes from where p exceeds q (p = {shown(p[n])}, "
                                     f"q = {shown(q[n])})."
                                     f"{self.named(expected['replaced_if'], lambda rows: rows[n][x] > 0)} "
                                     f"Look at {self.where}.")
        elif expected["target"][k][out[k]] == 0:
            raise AssertionError(f"{at} returned {out}: after accepting every guess it emitted token {out[k]}, which "
                                 f"the target's next distribution p = {shown(p[k])} never makes; the bonus token comes "
                                 f"from the row after the last guess."
                                 f"{self.named(expected['bonus_if'], lambda row: row[out[k]] > 0)} "
                                 f"Look at {self.where}.")

    @staticmethod
    def named(mistakes: dict, fits) -> str:
        """' It looks like this mistake: ...' for the mistakes whose table `fits` the output, or ''."""
        like = [name for name, table in mistakes.items() if fits(table)]
        if not like:
            return ""
        return (f" It looks like this mistake: {like[0]}." if len(like) == 1 else
                f" It looks like one of these mistakes: {'; or '.join(like)}.")

    def judge_frequencies(self, q, p, rounds, outs, drawn, expected):
        k = len(rounds[0])
        about = f"over {len(rounds)} rounds"
        per_round = {name: {tuple(g): probs for g, probs in table}
                     for name, table in expected["keep_per_round_if"].items()}
        for j in range(k + 1):
            reached = [(g, out) for g, out in zip(rounds, outs) if len(out) > j]   # the first j guesses were kept
            if j < k:
                kept = sum(len(out) > j + 1 for _, out in reached)
                mean, var = counted([expected["keep"][j][g[j]] for g, _ in reached])
                if var >= MIN_VARIANCE and p_value_normal(kept, mean, var) < LEVEL:
                    fitting = {name: [t[j][g[j]] for g, _ in reached] for name, t in expected["keep_if"].items()}
                    fitting.update({name: [t[tuple(g)][j] for g, _ in reached] for name, t in per_round.items()})
                    raise AssertionError(
                        f"{about}, {len(reached)} reached position {j} and {kept} kept its guess; with "
                        f"p = {shown(p[j])} and q = {shown(q[j])} a guess is kept with probability p/q at it (at "
                        f"most 1), so about {mean:.0f} ± {math.sqrt(var):.1f} should have been."
                        f"{self.named(fitting, lambda probs: fits_count(kept, probs))} Look at {self.where}.")
                replaced = [out[j] for _, out in reached if len(out) == j + 1]
                self.follows(replaced, expected["residual"][j],
                             f"{about}, the {len(replaced)} tokens emitted after a rejection at position {j}",
                             f"the normalised excess of p = {shown(p[j])} over q = {shown(q[j])}",
                             {name: rows[j] for name, rows in expected["replaced_if"].items()})
            else:
                self.follows([out[k] for _, out in reached], expected["target"][k],
                             f"{about}, the {len(reached)} bonus tokens after every guess was kept",
                             f"the target's next distribution p = {shown(p[k])}", expected["bonus_if"])
            if drawn and j < k:
                self.follows([out[j] for _, out in reached], expected["target"][j],
                             f"{about}, with the guesses drawn from q = {shown(q[j])}, the "
                             f"{len(reached)} tokens emitted at position {j}",
                             f"p = {shown(p[j])}, the target's own distribution there: that is the point of the rule")

    def follows(self, tokens, probs, what, should, mistakes=None):
        counts = {}
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
        p_value, n = p_value_chi2(counts, probs)
        if p_value < LEVEL:
            got = [round(counts.get(t, 0) / n, 3) for t in range(len(probs))]
            named = self.named(mistakes or {}, lambda row: p_value_chi2(counts, row)[0] >= LEVEL)
            raise AssertionError(f"{what} came out with frequencies {got}; they should follow {should} (χ² p-value "
                                 f"{p_value:.1e}).{named} Look at {self.where}.")


def counted(probs: list[float]) -> tuple[float, float]:
    """The mean and variance of how many of independent events with these probabilities happen."""
    return sum(probs), sum(r * (1 - r) for r in probs)


def fits_count(observed: int, probs: list[float]) -> bool:
    """Whether `observed` events are a plausible count for these probabilities (exactly their sum when sure)."""
    mean, var = counted(probs)
    return abs(observed - mean) < 1e-9 if var == 0 else p_value_normal(observed, mean, var) >= LEVEL


ACCEPT = Accept()
test_speculative_accept = ACCEPT.pytest_test()
