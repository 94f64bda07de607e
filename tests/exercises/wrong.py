"""Plausible wrong versions of exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves this file out of every copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
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
        "applies the sorted order's mask to the unsorted logits": """
sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
probs = sorted_logits.softmax(dim=-1)
return logits.masked_fill(probs.cumsum(dim=-1) - probs >= p, float("-inf"))
""",
    },
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
    "prefix-match": {
        "reuses the block that holds the last token": """
blocks, parent = [], ROOT
for start in range(0, len(token_ids) - block_size + 1, block_size):
    parent = hash_block(parent, token_ids[start:start + block_size])
    if parent not in cached:
        break
    blocks.append(cached[parent])
return blocks
""",
        "hashes each block on its own, not chained to the blocks before": """
blocks = []
for start in range(0, len(token_ids) - block_size, block_size):
    key = hash_block(ROOT, token_ids[start:start + block_size])
    if key not in cached:
        break
    blocks.append(cached[key])
return blocks
""",
        "walks on past a miss": """
blocks, parent = [], ROOT
for start in range(0, len(token_ids) - block_size, block_size):
    parent = hash_block(parent, token_ids[start:start + block_size])
    if parent in cached:
        blocks.append(cached[parent])
return blocks
""",
    },
    "model-causal-attention": {
        "aligns the causal triangle top-left, ignoring the L - T cached keys": """
T = q.shape[-2]
return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1)
""",
        "lets each query see one key too many": """
T, L = q.shape[-2], k.shape[-2]
if mask is None and T > 1:
    mask = causal_mask(torch.arange(L - T, L, device=q.device) + 1, L)
return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
""",
        "forgets to scale the scores by 1/sqrt(D)": """
T, L = q.shape[-2], k.shape[-2]
if mask is None:
    mask = causal_mask(torch.arange(L - T, L, device=q.device), L)
scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
return scores.softmax(dim=-1) @ v
""",
    },
}
