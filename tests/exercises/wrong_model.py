"""Plausible wrong versions of the minillm/model.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "model-heads": {
        "reshapes straight to (B, H, T, D)": """
q, k, v = self.c_attn(x).split(C, dim=2)
q = q.reshape(B, self.n_head, T, C // self.n_head)
k = k.reshape(B, self.n_head, T, C // self.n_head)
v = v.reshape(B, self.n_head, T, C // self.n_head)
""",
        "interleaves the heads' columns": """
q, k, v = self.c_attn(x).split(C, dim=2)
q = q.view(B, T, C // self.n_head, self.n_head).permute(0, 3, 1, 2)
k = k.view(B, T, C // self.n_head, self.n_head).permute(0, 3, 1, 2)
v = v.view(B, T, C // self.n_head, self.n_head).permute(0, 3, 1, 2)
""",
        "takes q and k in the wrong order": """
k, q, v = self.c_attn(x).split(C, dim=2)
q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
""",
    },
    "model-causal-attention": {
        "aligns the causal triangle top-left, ignoring the L - T cached keys": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(T, device=q.device), L)
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
""",
        "ANDs a given mask with the causal triangle, instead of using it as it is": """
T, L = q.shape[-2], k.shape[-2]
causal = causal_mask(torch.arange(L - T, L, device=q.device), L)
mask = causal if mask is None else mask & causal
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
""",
        "lets each query see one key too many": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device) + 1, L)
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
""",
        "forgets to scale the scores by 1/sqrt(D)": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
return scores.softmax(dim=-1) @ v
""",
        "scales the scores by 1/D instead of 1/sqrt(D)": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)) / q.shape[-1]
return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
""",
        "takes the softmax over the queries instead of the keys": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return torch.nan_to_num(scores.masked_fill(~mask, float("-inf")).softmax(dim=-2)) @ v
""",
        "ignores the given mask and always builds the causal one": """
T, L = q.shape[-2], k.shape[-2]
mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
""",
        "zeroes the hidden keys' weights after the softmax instead of their scores before it": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
return scores.softmax(dim=-1).masked_fill(~mask, 0.0) @ v
""",
    },
}
