"""The answer key of lesson 01's KV-cache exercises (kv-cache-write, kv-cache-read), and the answers of their
classic mistakes, so that a message can name the one a student made.

Instructor only: `make` leaves every key_*.py out of a student copy. A case is a step (test_ex_kv_cache.py
builds it): `lengths` (tokens each row holds before it), `rows` (the rows in the step, in the step's order), T
new tokens for each, and the cache's contents. The keys below work the step out from its definition: token t
of the i-th row of the step lands in slot lengths[row] + t of that row, and its query sees that row's slots
0 .. lengths[row] + t, in the step's layer only (attention from key_model.py).
"""
from __future__ import annotations

import torch

from key_model import attention, key, visible_keys


# ---------------------------------------------------------------- write


def written(inputs: dict, slot=None, row_of=None, layers=None) -> dict:
    """The cache after the step's write, into a new (zero) cache: each token t of step row i goes to row
    row_of(i) (default: rows[i]), slot slot(i, t) (default: lengths[row] + t), in `layers` (default: the
    step's layer). The defaults are the answer; the others give the answers of mistakes."""
    lengths, rows, T, layer = inputs["lengths"], inputs["rows"], inputs["T"], inputs["layer"]
    row_of = row_of or (lambda i: rows[i])
    slot = slot or (lambda i, t: lengths[rows[i]] + t)
    layers = [layer] if layers is None else layers
    out = {"k": torch.zeros(inputs["cached_k"].shape), "v": torch.zeros(inputs["cached_v"].shape)}
    size = out["k"].shape[3]
    for i in range(len(rows)):
        for t in range(T):
            s = slot(i, t)
            if not 0 <= s < size:
                continue          # a mistake that writes past the reservation fails anyway
            for at in layers:
                out["k"][at, row_of(i), :, s] = inputs["k"][i, :, t]
                out["v"][at, row_of(i), :, s] = inputs["v"][i, :, t]
    return out


def write_key(inputs: dict) -> dict:
    """The key of one kv-cache-write case: both caches after the write, and the key cache after each classic
    mistake (each mistake puts the values where it puts the keys: the keys alone name it)."""
    lengths, rows = inputs["lengths"], inputs["rows"]
    first = lengths[rows[0]]
    mistakes = {
        "every row's tokens went to slot 0 on: a row's new tokens go right after what it has cached "
        "(m.positions says where)": written(inputs, slot=lambda i, t: t),
        "every row's tokens went after the first row's length: in a ragged step each row starts at its own "
        "length": written(inputs, slot=lambda i, t: first + t),
        "the tokens went one slot late: a row holding n tokens puts its next one in slot n "
        "(slots count from 0)": written(inputs, slot=lambda i, t: lengths[rows[i]] + t + 1),
        "the step's i-th row went to cache row i: it belongs in row m.rows[i]": written(inputs, row_of=lambda i: i),
        "every layer was written: each layer's attention writes its own keys, in its own layer":
            written(inputs, layers=range(inputs["cached_k"].shape[0])),
    }
    want = written(inputs)
    return {"want": want, "mistakes": key(want["k"], {name: cache["k"] for name, cache in mistakes.items()})["mistakes"]}


# ---------------------------------------------------------------- read


def each_row(inputs: dict, keys_of, allowed_of) -> torch.Tensor:
    """Attention of the step's queries, row by row: step row i attends over keys_of(i) = (k, v), each (H, L, D),
    with allowed_of(i, L) saying which keys (T, L) its queries may see."""
    q, out = inputs["q"], []
    for i in range(len(inputs["rows"])):
        k, v = keys_of(i)
        out.append(attention(q[i:i + 1], k[None], v[None], allowed_of(i, k.shape[-2])))
    return torch.cat(out)


def read_key(inputs: dict) -> dict:
    """The key of one kv-cache-read case: the step's attention, and what each classic mistake returns."""
    lengths, rows, T, layer = inputs["lengths"], inputs["rows"], inputs["T"], inputs["layer"]
    cached_k, cached_v = inputs["cached_k"], inputs["cached_v"]
    longest = max(lengths[r] for r in rows) + T
    n_layer, slots = cached_k.shape[0], cached_k.shape[3]

    def slots_of(row: int, upto: int, at: int = layer):
        return cached_k[at, row, :, :upto], cached_v[at, row, :, :upto]

    def own(i: int, L: int) -> torch.Tensor:   # the query for token t sees its own row's slots 0 .. lengths[row] + t
        return visible_keys(T, L, offset=lengths[rows[i]])

    def at_the_end(i: int, L: int) -> torch.Tensor:   # the queries taken as the last T of the L keys
        return visible_keys(T, L)

    want = each_row(inputs, lambda i: slots_of(rows[i], longest), own)
    mistakes = {
        "only the step's new keys and values were attended: the queries must also see what each row has "
        "cached (only a fresh prefill has nothing cached)":
            each_row(inputs, lambda i: (inputs["k"][i], inputs["v"][i]), at_the_end),
        "the ragged batch's mask was not used: a shorter row's queries saw the slots after its own tokens":
            each_row(inputs, lambda i: slots_of(rows[i], longest), at_the_end),
        f"all {slots} reserved slots were attended: only the first m.max_context_len hold keys, the rest are "
        "junk": each_row(inputs, lambda i: slots_of(rows[i], slots), at_the_end),
        "the step's i-th row read cache row i: its keys are in row m.rows[i]":
            each_row(inputs, lambda i: slots_of(i, longest), own),
    }
    old = longest - T
    if old > 0:   # what `write` stored this step left out: the keys up to the longest row's old length only
        ragged = len({lengths[r] for r in rows}) > 1
        mistakes["this step's own keys were not attended: write has stored them, in the slots right after "
                 "each row's cached ones, before read runs"] = \
            each_row(inputs, lambda i: slots_of(rows[i], old), own if ragged else at_the_end)
    for other in range(n_layer):
        if other != layer:
            mistakes[f"the keys of layer {other} were read: each layer attends over its own keys (layer "
                     f"{layer} here)"] = each_row(inputs, lambda i, at=other: slots_of(rows[i], longest, at), own)
    return key(want, mistakes)
