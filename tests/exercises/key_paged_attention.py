"""The answer key of the paged-attention exercises (paged-slot-mapping, paged-gather): block walks, one slot at a time.

Instructor only: `make` leaves every key_*.py out of a student copy, since an oracle is a solution.

Each key holds the right answer, where every token lives (so that a message can point at the first wrong
one), and the answers of plausible mistakes, each under the sentence a student reads when their output is
that mistake's. A mistake that gives the right answer on a case, or that could not run on it (an index past
the table), is left out of that case's key.
"""
from __future__ import annotations

import torch


# ---------------------------------------------------------------- slot mapping

def token_places(table: list[int], start: int, num_tokens: int, block_size: int) -> list[dict]:
    """For each token from `start` on: its position, the table entry that covers it, the block that entry
    names and its offset inside that block. Walks the blocks slot by slot: no division."""
    places, entry, offset = [], 0, 0
    for position in range(start + num_tokens):
        if position >= start:
            places.append({"position": position, "entry": entry, "block": table[entry], "offset": offset})
        offset += 1
        if offset == block_size:
            entry, offset = entry + 1, 0
    return places


SLOT_MISTAKES = {
    "the slot of the last token of a full block went into the next block: position // block_size is off by "
    "one at the boundary": lambda t, p, bs: t[(p + 1) // bs] * bs + p % bs,
    "the first token of a block went into the block before it: position // block_size is off by one at the "
    "boundary": lambda t, p, bs: t[(p - 1) // bs] * bs + p % bs,
    "the block's index in the sequence was used as the block: the table's entry at that index names the block "
    "in the pool": lambda t, p, bs: (p // bs) * bs + p % bs,
    "every token got its block's first slot: the token's offset inside the block is missing":
        lambda t, p, bs: t[p // bs] * bs,
    "the block id was used as a slot number: a block's first slot in the flattened pool is its id times "
    "block_size": lambda t, p, bs: t[p // bs] + p % bs,
    "the offset inside the block is the whole position, not what is left of it past the block's start":
        lambda t, p, bs: t[p // bs] * bs + p,
    "the block index was rounded up: the block that holds position p is the one covering it, rounded down":
        lambda t, p, bs: t[-(-p // bs)] * bs + p % bs,
}


def slot_key(inputs: dict) -> dict:
    table, start, n, bs = inputs["table"], inputs["start"], inputs["num_tokens"], inputs["block_size"]
    places = token_places(table, start, n, bs)
    want = [place["block"] * bs + place["offset"] for place in places]
    mistakes = {}
    for name, slot in SLOT_MISTAKES.items():
        try:
            answer = [slot(table, p, bs) for p in range(start, start + n)]
        except IndexError:
            continue
        if answer != want:
            mistakes[name] = answer
    from_zero = [place["block"] * bs + place["offset"] for place in token_places(table, 0, n, bs)]
    if from_zero != want:
        mistakes["the positions were counted from 0, not from start: the chunk's first token is at position "
                 "start"] = from_zero
    return {"want": want, "places": places, "mistakes": mistakes}


# ---------------------------------------------------------------- the gather

def gather_places(tables: list[list[int]], context_len: int, bs: int) -> list[list[list[int]]]:
    """[block, slot] of each of the first `context_len` tokens of every row, walking its table's blocks slot by slot."""
    places = []
    for table in tables:
        row, entry, offset = [], 0, 0
        for _ in range(context_len):
            row.append([table[entry], offset])
            offset += 1
            if offset == bs:
                entry, offset = entry + 1, 0
        places.append(row)
    return places


def read_through(pool: torch.Tensor, tables: list[list[int]], context_len: int, token_axis_first: bool = False):
    """K and V (rows, H, context_len, D) of rows whose blocks are `tables`, copied one token at a time.
    `token_axis_first` gives the layout (rows, context_len, H, D) instead."""
    _, bs, _, H, D = pool.shape
    out = torch.zeros(2, len(tables), context_len, H, D, dtype=pool.dtype)
    for r, row in enumerate(gather_places(tables, context_len, bs)):
        for p, (block, slot) in enumerate(row):
            out[:, r, p] = pool[block, slot]
    if token_axis_first:
        return out[0], out[1]
    return out[0].permute(0, 2, 1, 3).contiguous(), out[1].permute(0, 2, 1, 3).contiguous()


def gather_key(inputs: dict) -> dict:
    pool, tables, L = inputs["pool"], inputs["tables"].tolist(), inputs["context_len"]
    rows, width = len(tables), len(tables[0])
    _, bs, _, H, D = pool.shape
    k, v = read_through(pool, tables, L)
    mistakes = {}

    def add(name, pair):
        if not (torch.equal(pair[0], k) and torch.equal(pair[1], v)):
            mistakes[name] = {"k": pair[0], "v": pair[1]}

    add("K and V are swapped: a slot holds K at index 0 and V at index 1", (v, k))
    if pool.shape[0] >= width:   # else the pool has too few blocks for this mistake to read
        add("the blocks were read by their place in the sequence, not through the block table: entry j of a "
            "row's table names the pool block that holds its j-th block", read_through(pool, [list(range(width))] * rows, L))
    add("every row was read through the first row's table: each row has its own",
        read_through(pool, [tables[0]] * rows, L))
    by_column = [tables[r][j] for j in range(width) for r in range(rows)]
    add("the block tables were read column by column: row r's blocks are the r-th row of the table, in order",
        read_through(pool, [by_column[r * width:(r + 1) * width] for r in range(rows)], L))
    tk, tv = read_through(pool, tables, L, token_axis_first=True)
    add("heads and tokens are mixed up: (rows, tokens, H, D) was reshaped, not permuted, into (rows, H, tokens, D)",
        (tk.reshape(rows, H, L, D), tv.reshape(rows, H, L, D)))
    return {"k": k, "v": v, "places": gather_places(tables, L, bs), "all_slots": width * bs, "mistakes": mistakes}
