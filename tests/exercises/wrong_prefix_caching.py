"""Plausible wrong versions of the minillm/prefix_caching.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
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
        "stops a block short when the prompt is one token past a block edge": """
blocks, parent = [], ROOT
for start in range(0, len(token_ids) - block_size - 1, block_size):
    parent = hash_block(parent, token_ids[start:start + block_size])
    if parent not in cached:
        break
    blocks.append(cached[parent])
return blocks
""",
    },
}
