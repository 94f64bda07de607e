"""Lesson 02 exercises in minillm/kv_cache.py: writing a step's keys and values, and reading them back.

`KVCache.prepare` (given) turns a step's segments into its metadata; the
checks call it, then test `write` and `read` separately. The read check fills
the cache by hand and puts an independent attention in place of
`causal_attention`, so it passes or fails on `read` alone.

A case is a step: `lengths` (tokens each row holds before it), `rows` (the
rows in the step, in the step's order), and T new tokens for each of them.
"""
import torch

from exercise_checks import Check, assert_close, attend_one_query, attention_oracle, patched

CACHE_AXES = ("layer", "row", "head", "slot", "dim")
TINY = {"n_layer": 2, "n_head": 4, "head_dim": 16}    # the tiny preset's attention shapes
SMALL = {"n_layer": 2, "n_head": 2, "head_dim": 4}


def build_cache(inputs):
    """The cache of a case, prepared for its step."""
    from minillm.config import GPT2Config
    from minillm.kv_cache import KVCache, Segment
    shape = inputs["shape"]
    config = GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_head"] * shape["head_dim"],
                        n_ctx=64, vocab_size=16, eos_token_id=None)
    cache = KVCache(config, batch_size=len(inputs["lengths"]), max_seq_len=inputs["max_seq_len"])
    cache.prepare([Segment(row, inputs["lengths"][row], inputs["T"]) for row in inputs["rows"]])
    return cache


def step(lengths, rows, T, shape=TINY, max_seq_len=8, layer=1, seed=0) -> dict:
    """A step in which `rows`, holding lengths[row] tokens each, get T new tokens; with that step's new keys and
    values, q, and the cache's contents before `write` as `read` would find them after it: the new keys already in
    their slots, every slot past each sequence's end holding junk that must not be read."""
    g = torch.Generator().manual_seed(seed)
    cache_shape = (shape["n_layer"], len(lengths), shape["n_head"], max_seq_len, shape["head_dim"])
    cached_k, cached_v = torch.randn(cache_shape, generator=g), torch.randn(cache_shape, generator=g)
    return {"shape": shape, "max_seq_len": max_seq_len, "lengths": lengths, "rows": rows, "T": T, "layer": layer,
            "q": torch.randn(len(rows), shape["n_head"], T, shape["head_dim"], generator=g),
            "k": torch.stack([cached_k[layer, row, :, lengths[row]:lengths[row] + T] for row in rows]),
            "v": torch.stack([cached_v[layer, row, :, lengths[row]:lengths[row] + T] for row in rows]),
            "cached_k": cached_k, "cached_v": cached_v}


def handed_to_attention(q, k, v, mask=None):
    """Stands in for causal_attention: returns what it was given, as data."""
    return {"attention of": {"q": q, "k": k, "v": v, **({"mask": mask} if mask is not None else {})}}


def attended(output):
    """What read returned, with the attention it asked for computed here (in the grader) by the oracle."""
    if isinstance(output, dict) and isinstance(output.get("attention of"), dict):
        handed = output["attention of"]
        if all(isinstance(handed.get(x), torch.Tensor) for x in "qkv"):
            return attention_oracle(handed["q"], handed["k"], handed["v"], handed.get("mask"))
    return output


def describe(inputs) -> str:
    lengths, rows = inputs["lengths"], inputs["rows"]
    return (f"step: rows {rows} holding {[lengths[r] for r in rows]} tokens get {inputs['T']} new each, "
            f"layer {inputs['layer']}")


def random_step(d, ragged: bool, all_rows: bool, T: int | None = None) -> dict:
    """A step over a random batch: every row or a shuffled subset, equal or ragged lengths."""
    batch, max_seq_len = d.int(2, 4), d.int(6, 10)
    T = T or d.int(1, 3)
    rows = list(range(batch)) if all_rows else sorted(d.sample(range(batch), d.int(1, batch - 1)))
    if ragged:
        d.random.shuffle(rows)
    same = d.int(0, max_seq_len - T)
    lengths = [d.int(0, max_seq_len - T) if ragged else same for _ in range(batch)]
    if ragged and len({lengths[r] for r in rows}) == 1 and len(rows) > 1:
        lengths[rows[0]] = (lengths[rows[0]] + 1) % (max_seq_len - T + 1)
    return step(lengths, rows, T, SMALL, max_seq_len, layer=d.int(0, 1), seed=d.int(0, 10**9))


class Write(Check):
    exercise = "kv-cache-write"
    where = "minillm/kv_cache.py, KVCache.write"

    def visible(self):
        return {
            "prefill of every row": step([0, 0, 0], [0, 1, 2], 3),
            "prefill of rows 0 and 2 only": step([0, 0, 0], [0, 2], 4),
            "decode with equal lengths": step([3, 3, 3], [0, 1, 2], 1),
            "decode of rows 1 and 2 with equal lengths": step([3, 3, 3], [1, 2], 1),
            "decode with ragged lengths": step([2, 5, 1], [0, 1, 2], 1),
            "two-token chunk with ragged lengths, rows out of order": step([1, 4, 0], [1, 0], 2),
        }

    def situations(self):
        return {"prefill or chunk of consecutive rows with equal lengths": lambda d: random_step(d, False, True),
                "equal lengths in some of the rows": lambda d: random_step(d, False, False),
                "decode with ragged lengths": lambda d: random_step(d, True, True, T=1),
                "chunk with ragged lengths, rows out of order": lambda d: random_step(d, True, False)}

    def run(self, inputs):
        cache = build_cache(inputs)
        cache.write(inputs["layer"], inputs["k"], inputs["v"])
        return {"k": cache.k, "v": cache.v}

    def verify(self, inputs, output):
        lengths, rows, T, layer = inputs["lengths"], inputs["rows"], inputs["T"], inputs["layer"]
        # Oracle: token t of the i-th row in the step lands in slot lengths[row] + t of that row, in this layer only;
        # every other slot keeps the zeros a new cache starts with.
        want = {"k": torch.zeros(inputs["cached_k"].shape), "v": torch.zeros(inputs["cached_v"].shape)}
        for i, row in enumerate(rows):
            for t in range(T):
                want["k"][layer, row, :, lengths[row] + t] = inputs["k"][i, :, t]
                want["v"][layer, row, :, lengths[row] + t] = inputs["v"][i, :, t]
        for name in ("k", "v"):
            got = output.get(name) if isinstance(output, dict) else None
            assert_close(got, want[name], f"cache.{name} after write", f"{self.where} ({describe(inputs)})",
                         CACHE_AXES, atol=0, rtol=0)


class Read(Check):
    exercise = "kv-cache-read"
    where = "minillm/kv_cache.py, KVCache.read"

    def visible(self):
        return {
            "fresh prefill": step([0, 0], [0, 1], 4),
            "decode with equal lengths": step([3, 3, 3], [0, 1, 2], 1),
            "decode with ragged lengths": step([2, 5, 1], [0, 1, 2], 1),
            "chunk after a cached prefix": step([3, 3], [0, 1], 2),
            "ragged chunk, rows out of order": step([1, 4, 2], [2, 0], 3),
            "one row of three": step([2, 4, 3], [1], 1),
            "layer 0, while layer 1 holds other keys": step([2, 2], [0, 1], 1, layer=0),
        }

    def situations(self):
        def fresh(d):
            batch, T = d.int(1, 3), d.int(1, 4)
            return step([0] * batch, list(range(batch)), T, SMALL, T + d.int(0, 3), layer=d.int(0, 1), seed=d.int(0, 10**9))

        return {"fresh prefill": fresh,
                "chunk after a cached prefix, equal lengths": lambda d: random_step(d, False, True),
                "decode with ragged lengths": lambda d: random_step(d, True, True, T=1),
                "ragged chunk, rows out of order": lambda d: random_step(d, True, False)}

    def run(self, inputs):
        import minillm.kv_cache
        cache = build_cache(inputs)
        cache.k.copy_(inputs["cached_k"])
        cache.v.copy_(inputs["cached_v"])
        # `read` ends in model.causal_attention (exercise model-causal-attention): a recorder stands in, and the
        # grader attends over what it was handed: this check needs no attention of the student's, and sends none.
        with patched(minillm.kv_cache, "causal_attention", handed_to_attention):
            return cache.read(inputs["layer"], inputs["q"], inputs["k"], inputs["v"])

    def verify(self, inputs, output):
        lengths, rows, T, layer, q = inputs["lengths"], inputs["rows"], inputs["T"], inputs["layer"], inputs["q"]
        # Oracle: the query for token t of row i sits at position lengths[row] + t and sees slots 0 .. that position.
        want = torch.zeros(q.shape, dtype=torch.float64)
        for i, row in enumerate(rows):
            for h in range(q.shape[1]):
                for t in range(T):
                    seen = lengths[row] + t + 1
                    want[i, h, t] = attend_one_query(q[i, h, t], inputs["cached_k"][layer, row, h, :seen],
                                                     inputs["cached_v"][layer, row, h, :seen])
        assert_close(attended(output), want, "read(layer, q, k, v) (each query attends over its own row's slots up to its "
                     "position, in this layer)", f"{self.where} ({describe(inputs)})", ("step row", "head", "query", "dim"))


WRITE, READ = Write(), Read()
test_write = WRITE.pytest_test()
test_read = READ.pytest_test()
