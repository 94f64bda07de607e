"""Lesson 07 exercises in minillm/paged_attention.py: the slot mapping and the ragged gather.

The answer key walks the blocks one slot at a time and says where every token lives, so that a message can
point at the first token that went astray, and name the mistake when the answer is a known one.
"""
import torch

from exercise_checks import Check, as_int_list, kind


def random_table(d, length: int, num_blocks: int = 1024) -> list[int]:
    """`length` different block ids of a pool of `num_blocks`: a pool this large, so that two seeds (a grade's
    and one a table of answers was built for) about never draw the same table."""
    return d.sample(range(num_blocks), length)


def known_mistake(mistakes: dict, matches) -> str:
    """The sentence naming the key's mistakes whose answer `matches` the output ("" if none does): a case
    may not tell two mistakes apart, and then it names both."""
    names = [name for name, answer in mistakes.items() if matches(answer)]
    if len(names) > 1:
        return f" This is the answer of more than one known mistake: {'; or '.join(names)}."
    return f" This is a known mistake: {names[0]}." if names else ""


# The edge situations of the slot mapping, one case each on every seed: (table length, start, num_tokens,
# block_size) fixed, the table's block ids drawn (from 4096 blocks: a decode edge's table is only 2 long).
# Drawn, not fixed: a table of answers built offline for one seed (the README warns of MINILLM_GRADE_SEED)
# must pass none of the held-out cases, and it would pass a fixed one.
EDGE_SHAPES = {"a prompt ending exactly on a block boundary, block_size 8": (3, 0, 16, 8),
               "a prompt one token past a block boundary, block_size 3": (4, 0, 7, 3),
               "a decode token in the last slot of a block, block_size 32": (2, 31, 1, 32),
               "a chunk from mid-block across two boundaries, block_size 3": (4, 4, 6, 3),
               "a chunk after the first token, block_size 1": (4, 1, 3, 1)}


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

    def edges(self):
        def edge(blocks, start, num_tokens, block_size):
            return lambda d: {"table": random_table(d, blocks, num_blocks=4096), "start": start,
                              "num_tokens": num_tokens, "block_size": block_size}

        return {name: edge(*shape) for name, shape in EDGE_SHAPES.items()}

    def run(self, inputs):
        from minillm.paged_attention import slot_mapping
        return slot_mapping(list(inputs["table"]), inputs["start"], inputs["num_tokens"], inputs["block_size"])

    def expect(self, inputs):
        from key_paged_attention import slot_key
        return slot_key(inputs)

    def judge(self, inputs, output, expected):
        table, start, n, bs = inputs["table"], inputs["start"], inputs["num_tokens"], inputs["block_size"]
        call = f"slot_mapping(block_table={table}, start={start}, num_tokens={n}, block_size={bs})"
        got, want = as_int_list(output, call, self.where), expected["want"]
        if got == want:
            return
        named = known_mistake(expected["mistakes"], lambda answer: answer == got)
        if len(got) != len(want):
            raise AssertionError(f"{call} should be {want}, one slot per token; got {len(got)} slots, {got}.{named} "
                                 f"Look at {self.where}.")
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        place = expected["places"][first]
        raise AssertionError(f"{call} should be {want}; got {got}. The first difference is for the token at "
                             f"position {place['position']}: the table's entry {place['entry']} covers it, naming "
                             f"block {place['block']}, and it is at offset {place['offset']} inside that block, so its "
                             f"slot is {want[first]}, not {got[first]} (a block's slots are numbered consecutively in "
                             f"the flattened pool).{named} Look at {self.where}.")


def gather_case(tables, context_len, num_blocks=6, block_size=4, H=2, D=3, seed=0):
    """A pool whose values are all different (quarters, exact in float32), so that each value says where it
    was read from and no wrong read can hit a right value by chance."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, 2, H, D)
    pool = torch.randperm(num_blocks * block_size * 2 * H * D, generator=g).float().div(4).view(shape)
    return {"pool": pool, "tables": torch.tensor(tables), "context_len": context_len}


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

    def edges(self):
        def ragged(d):
            # Rows of 1 token, of exactly one block and of 9 tokens, in a drawn order, as a decode step holds
            # them: the shorter rows' tables padded with the pad block (the pool's last), the step's context
            # that of its longest row.
            num_blocks = d.int(6, 10)
            pad = num_blocks - 1
            one, block, *long = d.sample(range(pad), 5)
            rows = [[one, pad, pad], [block, pad, pad], long]
            tables = [rows[i] for i in d.randperm(3).tolist()]
            return gather_case(tables, 9, num_blocks, block_size=4, H=2, D=3, seed=d.int(0, 10**9))

        def one_block(d):
            num_blocks = d.int(3, 8)
            return gather_case([[d.int(0, num_blocks - 1)]], 8, num_blocks, block_size=8, seed=d.int(0, 10**9))

        def block_size_1(d):
            # one row's blocks all different, the other's with a block it holds twice
            num_blocks = d.int(6, 10)
            first, (a, b, c) = d.sample(range(num_blocks), 4), d.sample(range(num_blocks), 3)
            second = [a, a, b, c] if d.int(0, 1) else [a, b, b, c]
            return gather_case([first, second], 4, num_blocks, block_size=1, H=3, D=2, seed=d.int(0, 10**9))

        def wider(d):
            # a context of 7 at block_size 3 fills 3 blocks: the table's 4th entry is padding, never read
            num_blocks = d.int(6, 10)
            tables = [d.sample(range(num_blocks), 4), [d.int(0, num_blocks - 1) for _ in range(4)]]
            return gather_case(tables, 7, num_blocks, block_size=3, seed=d.int(0, 10**9))

        return {"a ragged batch: rows of one token, one block and more, tables padded": ragged,
                "one row of exactly one block, block_size 8": one_block,
                "block_size 1, three heads": block_size_1,
                "a table wider than the context, block_size 3": wider}

    def run(self, inputs):
        from minillm.paged_attention import gather_kv
        return gather_kv(inputs["pool"], inputs["tables"], inputs["context_len"])

    def expect(self, inputs):
        from key_paged_attention import gather_key
        return gather_key(inputs)

    def judge(self, inputs, output, expected):
        tables, context_len = inputs["tables"].tolist(), inputs["context_len"]
        where = (f"{self.where} (block_size {inputs['pool'].shape[1]}, tables {tables}, context_len {context_len})")
        if not isinstance(output, tuple) or len(output) != 2:
            raise AssertionError(f"gather_kv should return the pair (k, v); got {kind(output)}. Look at {where}.")
        for got, name in zip(output, "kv"):
            want = expected[name]
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"{name} from gather_kv: expected a tensor of shape {tuple(want.shape)} = "
                                     f"(rows, H, context_len, D), got {kind(got)}. Look at {where}.")
            if got.dtype != want.dtype:
                raise AssertionError(f"{name} from gather_kv: expected {want.dtype}, the pool's dtype (a gather copies "
                                     f"values, it does not convert them), got {got.dtype}. Look at {where}.")
            if got.shape != want.shape:
                padded = (got.dim() == 4 and got.shape[2] == expected["all_slots"] != context_len)
                why = (f" All {expected['all_slots']} slots of the tables' blocks came back: only the first "
                       f"context_len = {context_len} are the context." if padded else "")
                raise AssertionError(f"{name} from gather_kv: expected shape {tuple(want.shape)} = (rows, H, "
                                     f"context_len, D), got shape {tuple(got.shape)}.{why} Look at {where}.")
        same = lambda a, b: bool((a.double() == b.double()).all())   # noqa: E731
        if same(output[0], expected["k"]) and same(output[1], expected["v"]):
            return
        named = known_mistake(expected["mistakes"], lambda m: same(output[0], m["k"]) and same(output[1], m["v"]))
        name, got = ("k", output[0]) if not same(output[0], expected["k"]) else ("v", output[1])
        want = expected[name]
        bad = (got.double() != want.double()).nonzero()
        r, h, p, i = bad[0].tolist()
        block, slot = expected["places"][r][p]
        raise AssertionError(f"{name} from gather_kv, (rows, H, context_len, D): {len(bad)} of {want.numel()} values "
                             f"are wrong. The first is at (row {r}, head {h}, token {p}, dim {i}): expected "
                             f"{want[r, h, p, i].item():.6g}, got {got[r, h, p, i].item():.6g}; that token's "
                             f"{name.upper()} is in block {block}, slot {slot} of the pool.{named} Look at {where}.")


SLOT_MAPPING, GATHER = SlotMapping(), Gather()
test_slot_mapping = SLOT_MAPPING.pytest_test()
test_gather = GATHER.pytest_test()
