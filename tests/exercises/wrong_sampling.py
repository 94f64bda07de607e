"""Plausible wrong versions of the minillm/sampling.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "sampling-top-k": {
        "one threshold for the whole batch": """
kth = torch.topk(logits, k, dim=-1).values[..., -1:].min()
return logits.masked_fill(logits < kth, float("-inf"))
""",
        "keeps k - 1: the k-th largest logit itself is dropped": """
kth = torch.topk(logits, k, dim=-1).values[..., -1:]
return logits.masked_fill(logits <= kth, float("-inf"))
""",
        "keeps k + 1: the threshold is one place too far": """
kth = torch.topk(logits, k + 1, dim=-1).values[..., -1:]
return logits.masked_fill(logits < kth, float("-inf"))
""",
        "sorts ascending, so the threshold is the k-th smallest logit": """
kth = torch.sort(logits, dim=-1).values[..., k - 1:k]
return logits.masked_fill(logits < kth, float("-inf"))
""",
        "masks the caller's logits in place": """
kth = torch.topk(logits, k, dim=-1).values[..., -1:]
return logits.masked_fill_(logits < kth, float("-inf"))
""",
        "returns probabilities instead of logits": """
kth = torch.topk(logits, k, dim=-1).values[..., -1:]
return logits.softmax(dim=-1).masked_fill(logits < kth, float("-inf"))
""",
    },
    "sampling-top-p": {
        "drops the token whose probability makes the mass cross p": """
sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
probs = sorted_logits.softmax(dim=-1)
drop_sorted = probs.cumsum(dim=-1) > p
drop_sorted[..., 0] = False
drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
return logits.masked_fill(drop, float("-inf"))
""",
        "treats a per-row tensor p as one number": """
if isinstance(p, torch.Tensor):
    p = float(p.flatten()[0])
sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
probs = sorted_logits.softmax(dim=-1)
drop_sorted = probs.cumsum(dim=-1) - probs >= p
drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
return logits.masked_fill(drop, float("-inf"))
""",
        "masks the caller's logits in place": """
sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
probs = sorted_logits.softmax(dim=-1)
drop_sorted = probs.cumsum(dim=-1) - probs >= p
drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
return logits.masked_fill_(drop, float("-inf"))
""",
        "applies the sorted order's mask to the unsorted logits": """
sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
probs = sorted_logits.softmax(dim=-1)
return logits.masked_fill(probs.cumsum(dim=-1) - probs >= p, float("-inf"))
""",
    },
}
