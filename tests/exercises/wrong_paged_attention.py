"""Plausible wrong versions of the minillm/paged_attention.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "paged-slot-mapping": {
        "position // block_size off by one at the boundary: (p + 1) // block_size": """
return [block_table[min((p + 1) // block_size, len(block_table) - 1)] * block_size + p % block_size
        for p in range(start, start + num_tokens)]
""",
        "uses the block's index in the sequence instead of the table's entry": """
return [(p // block_size) * block_size + p % block_size for p in range(start, start + num_tokens)]
""",
        "slot = block * block_size, without the offset inside the block": """
return [block_table[p // block_size] * block_size for p in range(start, start + num_tokens)]
""",
        "adds the offset to the block id, not to the block's first slot": """
return [block_table[p // block_size] + p % block_size for p in range(start, start + num_tokens)]
""",
        "counts the positions from 0, not from start": """
return [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
""",
        "rounds the block index up": """
return [block_table[min(-(-p // block_size), len(block_table) - 1)] * block_size + p % block_size
        for p in range(start, start + num_tokens)]
""",
    },
    "paged-gather": {
        "gathers by logical block index, not through the block table": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool[:max_blocks].repeat(b, 1, 1, 1, 1)
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
return tokens.permute(2, 0, 3, 1, 4).unbind(0)
""",
        "ignores context_len: returns every slot of the tables' blocks": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool.index_select(0, block_tables.reshape(-1))
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)
return tokens.permute(2, 0, 3, 1, 4).unbind(0)
""",
        "swaps K and V": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool.index_select(0, block_tables.reshape(-1))
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
k, v = tokens.permute(2, 0, 3, 1, 4).unbind(0)
return v, k
""",
        "reshapes (rows, tokens, H, D) into (rows, H, tokens, D) instead of permuting": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool.index_select(0, block_tables.reshape(-1))
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
return tokens[:, :, 0].reshape(b, H, context_len, D), tokens[:, :, 1].reshape(b, H, context_len, D)
""",
        "reads every row through the first row's table": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool.index_select(0, block_tables[0]).repeat(b, 1, 1, 1, 1)
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
return tokens.permute(2, 0, 3, 1, 4).unbind(0)
""",
        "reads the block tables column by column": """
b, max_blocks = block_tables.shape
_, block_size, _, H, D = layer_pool.shape
blocks = layer_pool.index_select(0, block_tables.t().reshape(-1))
tokens = blocks.view(b, max_blocks * block_size, 2, H, D)[:, :context_len]
return tokens.permute(2, 0, 3, 1, 4).unbind(0)
""",
    },
}
