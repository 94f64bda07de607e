"""Plausible wrong versions of the minillm/kv_cache.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "kv-cache-write": {
        "writes every row's tokens from slot 0, ignoring what the row has cached": """
self.k[layer_idx, m.rows, :, :k.shape[2]] = k
self.v[layer_idx, m.rows, :, :k.shape[2]] = v
""",
        "writes every row after the first row's length, even in a ragged step": """
start = m.segments[0].start
self.k[layer_idx, m.rows, :, start:start + k.shape[2]] = k
self.v[layer_idx, m.rows, :, start:start + k.shape[2]] = v
""",
        "writes one slot late (after slot n, where a row holding n tokens puts its next)": """
if isinstance(m.rows, slice):
    start = m.segments[0].start + 1
    self.k[layer_idx, m.rows, :, start:start + k.shape[2]] = k
    self.v[layer_idx, m.rows, :, start:start + k.shape[2]] = v
else:
    self.k[layer_idx, m.rows[:, None], :, m.positions + 1] = k.transpose(1, 2)
    self.v[layer_idx, m.rows[:, None], :, m.positions + 1] = v.transpose(1, 2)
""",
        "writes the step's i-th row into cache row i, not into m.rows[i]": """
rows = torch.arange(k.shape[0], device=k.device)
self.k[layer_idx, rows[:, None], :, m.positions] = k.transpose(1, 2)
self.v[layer_idx, rows[:, None], :, m.positions] = v.transpose(1, 2)
""",
        "writes the keys into every layer": """
for layer in range(self.k.shape[0]):
    if isinstance(m.rows, slice):
        start = m.segments[0].start
        self.k[layer, m.rows, :, start:start + k.shape[2]] = k
        self.v[layer, m.rows, :, start:start + k.shape[2]] = v
    else:
        self.k[layer, m.rows[:, None], :, m.positions] = k.transpose(1, 2)
        self.v[layer, m.rows[:, None], :, m.positions] = v.transpose(1, 2)
""",
    },
    "kv-cache-read": {
        "attends over the step's new keys only, as if every step were a fresh prefill": """
return causal_attention(q, k, v)
""",
        "drops the ragged batch's mask": """
if m.is_fresh_prefill:
    return causal_attention(q, k, v)
keys = self.k[layer_idx, m.rows, :, :m.max_context_len]
values = self.v[layer_idx, m.rows, :, :m.max_context_len]
return causal_attention(q, keys, values)
""",
        "reads all max_seq_len reserved slots, junk past the context included": """
if m.is_fresh_prefill:
    return causal_attention(q, k, v)
keys, values = self.k[layer_idx, m.rows], self.v[layer_idx, m.rows]
mask = None if m.mask is None else causal_mask(m.positions, keys.shape[2])
return causal_attention(q, keys, values, mask)
""",
        "reads the keys only up to the old length, without this step's own": """
if m.is_fresh_prefill:
    return causal_attention(q, k, v)
L = m.max_context_len - q.shape[2]
keys = self.k[layer_idx, m.rows, :, :L]
values = self.v[layer_idx, m.rows, :, :L]
mask = None if m.mask is None else m.mask[..., :L]
return causal_attention(q, keys, values, mask)
""",
        "reads cache rows 0..B-1 instead of the step's rows": """
if m.is_fresh_prefill:
    return causal_attention(q, k, v)
keys = self.k[layer_idx, :q.shape[0], :, :m.max_context_len]
values = self.v[layer_idx, :q.shape[0], :, :m.max_context_len]
return causal_attention(q, keys, values, m.mask)
""",
        "reads layer 0's keys in every layer": """
if m.is_fresh_prefill:
    return causal_attention(q, k, v)
keys = self.k[0, m.rows, :, :m.max_context_len]
values = self.v[0, m.rows, :, :m.max_context_len]
return causal_attention(q, keys, values, m.mask)
""",
    },
}
