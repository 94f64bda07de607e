"""Plausible wrong versions of the minillm/block_manager.py exercise regions: the grade must catch each of them on every draw.

Instructor only: `make` leaves every wrong_*.py out of a copy (copies.INSTRUCTOR_ONLY), since a wrong
version is one step from a right one. tests/test_exercise_catalogue.py splices each into the reference
module, grades it on 200 seeds of held-out inputs, and requires less than full marks on every seed.
Each entry is the region's code, unindented.
"""

WRONG = {
    "paged-allocate": {
        "takes the newest block on the free list (its tail), not its head": """
if not self.free_blocks:
    raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use")
block = self.free_blocks.pop()
self.ref_counts[block] = 1
return block
""",
        "forgets to set the block's reference count": """
if not self.free_blocks:
    raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use")
return self.free_blocks.popleft()
""",
        "leaves the block on the free list": """
if not self.free_blocks:
    raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use")
block = self.free_blocks[0]
self.ref_counts[block] = 1
return block
""",
        "refuses the last free block": """
if len(self.free_blocks) <= 1:
    raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use")
block = self.free_blocks.popleft()
self.ref_counts[block] = 1
return block
""",
        "lets an empty deque raise IndexError": """
block = self.free_blocks.popleft()
self.ref_counts[block] = 1
return block
""",
        "names the free count, not the pool size, when the pool is empty": """
if not self.free_blocks:
    raise RuntimeError(f"out of KV blocks: {len(self.free_blocks)} free")
block = self.free_blocks.popleft()
self.ref_counts[block] = 1
return block
""",
    },
    "paged-free": {
        "returns a block to the free list while another sequence still references it": """
if self.ref_counts[block] < 1:
    raise RuntimeError(f"double free: block {block} has no references left")
self.ref_counts[block] -= 1
self.free_blocks.append(block)
""",
        "never recycles a block at zero references": """
if self.ref_counts[block] < 1:
    raise RuntimeError(f"double free: block {block} has no references left")
self.ref_counts[block] -= 1
""",
        "drops every reference of a shared block at once": """
if self.ref_counts[block] < 1:
    raise RuntimeError(f"double free: block {block} has no references left")
self.ref_counts[block] = 0
self.free_blocks.append(block)
""",
        "recycles the block to the head of the free list": """
if self.ref_counts[block] < 1:
    raise RuntimeError(f"double free: block {block} has no references left")
self.ref_counts[block] -= 1
if self.ref_counts[block] == 0:
    self.free_blocks.appendleft(block)
""",
        "counts the reference down before checking for a double free": """
self.ref_counts[block] -= 1
if self.ref_counts[block] < 0:
    raise RuntimeError(f"double free: block {block} has no references left")
if self.ref_counts[block] == 0:
    self.free_blocks.append(block)
""",
        "frees twice: a double free puts the block on the free list again": """
if self.ref_counts[block] > 0:
    self.ref_counts[block] -= 1
if self.ref_counts[block] == 0:
    self.free_blocks.append(block)
""",
    },
}
