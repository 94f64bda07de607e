"""Lesson 05 exercises in minillm/paged_attention.py: the slot mapping and the ragged gather.

The oracles walk blocks one slot at a time.
"""
import torch

from exercise_checks import Check, as_int_list, assert_close, kind


def slots_owned(table: list[int], block_size: int) -> list[int]:
    """Every slot a sequence owns, in position order: its blocks one after the other, each slot by slot."""
    return [block * block_size + offset for block in table for offset in range(block_size)]


def random_table(d, length: int, num_blocks: int = 64) -> list[int]:
    return d.sample(range(num_blocks), length)


class SlotMapping(Check):
    exercise = "paged-slot-mapping"
    where = "minillm/paged_attention.py, slot_mapping"

    def visible(self):
        case = lambda table, start, n, bs: {"table": table, "start": start, "num_tokens": n, "block_size": bs}
        return {"prompt in the first block": case([7, 2], 0, 3, 4),
                "prompt across blocks": case([7, 2, 5], 0, 10, 4),
                "chunk starting mid-block": case([7, 2, 5], 3, 6, 4),
                "one decode token at a block edge": case([7, 2, 5], 8, 1, 4),
                "block_size 1": case([3, 0, 2], 1, 2, 1)}

    def situations(self):
        def from_zero(d):
            bs, blocks = d.choice([2, 4, 8, 16]), d.int(2, 5)
            return {"table": random_table(d, blocks), "start": 0, "num_tokens": d.int(bs + 1, bs * blocks), "block_size": bs}

        def mid_block(d):
            bs, blocks = d.choice([3, 4, 8]), d.int(3, 6)
            start = d.int(1, bs - 1) + bs * d.int(0, 1)
            return {"table": random_table(d, blocks), "start": start, "num_tokens": d.int(2, bs * blocks - start),
                    "block_size": bs}

        def decode_at_edge(d):
            bs, blocks = d.choice([2, 4, 16]), d.int(2, 6)
            return {"table": random_table(d, blocks), "start": bs * d.int(1, blocks - 1), "num_tokens": 1, "block_size": bs}

        def block_size_1(d):
            blocks = d.int(3, 8)
            start = d.int(0, blocks - 2)
            return {"table": random_table(d, blocks), "start": start, "num_tokens": d.int(1, blocks - start), "block_size": 1}

        return {"a prompt from position 0": from_zero, "a chunk starting mid-block": mid_block,
                "one decode token at a block edge": decode_at_edge, "block_size 1": block_size_1}

    def run(self, inputs):
        from minillm.paged_attention import slot_mapping
        return slot_mapping(list(inputs["table"]), inputs["start"], inputs["num_tokens"], inputs["block_size"])

    def verify(self, inputs, output):
        table, start, n, bs = inputs["table"], inputs["start"], inputs["num_tokens"], inputs["block_size"]
        call = f"slot_mapping(block_table={table}, start={start}, num_tokens={n}, block_size={bs})"
        got = as_int_list(output, call, self.where)
        # Oracle: list every slot the sequence owns, block after block, and take the wanted positions.
        want = slots_owned(table, bs)[start:start + n]
        if got != want:
            wrong = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"{call} should be {want}; got {got}. The first difference is for the token at "
                                 f"position {start + wrong}: it is in the block the table lists for that position, "
                                 f"at its offset inside the block, and a block's slots are numbered consecutively "
                                 f"in the flattened pool. Look at {self.where}.")


def gather_case(tables, context_len, num_blocks=6, block_size=4, H=2, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"pool": torch.randn(num_blocks, block_size, 2, H, D, generator=g), "tables": torch.tensor(tables),
            "context_len": context_len}


class Gather(Check):
    exercise = "paged-gather"
    where = "minillm/paged_attention.py, gather_kv"

    def visible(self):
        return {"ragged batch ending mid-block": gather_case([[4, 1, 5], [2, 0, 2]], 10),
                "one row, one token": gather_case([[3]], 1),
                "whole blocks, a block shared by two rows": gather_case([[0, 3], [5, 3], [1, 1]], 8)}

    def situations(self):
        def batch(d, block_size, width, ending):
            num_blocks, rows = d.int(width, 10), d.int(1, 3)
            tables = [[d.int(0, num_blocks - 1) for _ in range(width)] for _ in range(rows)]
            context_len = width * block_size - (d.int(1, block_size - 1) if ending == "mid-block" else 0)
            return gather_case(tables, context_len, num_blocks, block_size, d.int(1, 3), d.int(2, 4), seed=d.int(0, 10**9))

        return {"a ragged batch ending mid-block": lambda d: batch(d, d.int(2, 5), d.int(1, 4), "mid-block"),
                "whole blocks": lambda d: batch(d, d.int(1, 4), d.int(1, 4), "whole"),
                "block_size 1": lambda d: batch(d, 1, d.int(2, 6), "whole")}

    def run(self, inputs):
        from minillm.paged_attention import gather_kv
        return gather_kv(inputs["pool"], inputs["tables"], inputs["context_len"])

    def verify(self, inputs, output):
        pool, tables, context_len = inputs["pool"], inputs["tables"].tolist(), inputs["context_len"]
        num_blocks, bs, _, H, D = pool.shape
        where = f"{self.where} (block_size {bs}, tables {tables}, context_len {context_len})"
        if not isinstance(output, tuple) or len(output) != 2:
            raise AssertionError(f"gather_kv should return the pair (k, v); got {kind(output)}. Look at {where}.")
        # Oracle: token p of row r is in block tables[r][p // block_size], slot p % block_size; K at 0, V at 1.
        want = torch.zeros(2, len(tables), H, context_len, D)
        for r, table in enumerate(tables):
            for p in range(context_len):
                want[:, r, :, p] = pool[table[p // bs], p % bs]
        for i, name in enumerate("kv"):
            assert_close(output[i], want[i], f"{name} from gather_kv, (rows, H, context_len, D)", where,
                         ("row", "head", "token", "dim"), atol=0, rtol=0)


SLOT_MAPPING, GATHER = SlotMapping(), Gather()
test_slot_mapping = SLOT_MAPPING.pytest_test()
test_gather = GATHER.pytest_test()
