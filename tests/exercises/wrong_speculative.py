"""Plausible wrong versions of the minillm/speculative.py exercise region: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "speculative-accept": {
        "accepts with probability min(1, q/p), the ratio inverted": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k, generator=generator)
accepted = u < draft_probs[rows, guesses] / target_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "accepts when u > p/q instead of u < p/q": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k, generator=generator)
accepted = u > target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "resamples a rejected guess from p, not from the residual max(0, p - q)": """
out = []
for i, token in enumerate(draft_token_ids):
    ratio = float(target_probs[i, token] / draft_probs[i, token])
    if float(torch.rand(1, generator=generator)) < min(1.0, ratio):
        out.append(token)
    else:
        return out + [int(torch.multinomial(target_probs[i], 1, generator=generator))]
return out + [int(torch.multinomial(target_probs[len(out)], 1, generator=generator))]
""",
        "forgets the bonus token when every guess is accepted": """
out = []
for i, token in enumerate(draft_token_ids):
    ratio = float(target_probs[i, token] / draft_probs[i, token])
    if float(torch.rand(1, generator=generator)) < min(1.0, ratio):
        out.append(token)
    else:
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
return out if out else [int(torch.multinomial(target_probs[0], 1, generator=generator))]
""",
        "goes on judging the guesses after a rejection": """
out = []
for i, token in enumerate(draft_token_ids):
    ratio = float(target_probs[i, token] / draft_probs[i, token])
    if float(torch.rand(1, generator=generator)) < min(1.0, ratio):
        out.append(token)
    else:
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
return out + [int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator))]
""",
        "counts every accepted guess, not only those before the first rejection": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k, generator=generator)
accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "one uniform draw shared by every guess of the round": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(1, generator=generator)
accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "draws from torch's global random stream, not from generator": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k)
accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1))]
""",
        "draws the bonus token from the last guess's row of p": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k, generator=generator)
accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[n - 1] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "accepts a guess only where p >= q, as greedy verification would": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
accepted = target_probs[rows, guesses] >= draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).clamp(min=0)
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
        "samples the replacement from |p - q|, not from max(0, p - q)": """
k = len(draft_token_ids)
rows = torch.arange(k)
guesses = torch.tensor(draft_token_ids, dtype=torch.long)
u = torch.rand(k, generator=generator)
accepted = u < target_probs[rows, guesses] / draft_probs[rows, guesses]
n = int(accepted.long().cumprod(dim=0).sum())
last = target_probs[k] if n == k else (target_probs[n] - draft_probs[n]).abs()
return draft_token_ids[:n] + [int(torch.multinomial(last, 1, generator=generator))]
""",
    },
}
