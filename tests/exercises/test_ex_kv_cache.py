"""Lesson 01 exercises in minillm/kv_cache.py: writing a step's keys and values, and reading them back.

`KVCache.prepare` (given) turns a step's segments into its metadata; the
checks call it, then test `write` and `read` separately. The read check fills
the cache by hand, junk past each row's end included, so it passes or fails
on `read` alone; the attention it ends in, `model.causal_attention`, is the
engine's own. The answers, and those of the classic mistakes that a message
names, come from the answer key (key_kv_cache.py, the instructor's).

A case is a step: `lengths` (tokens each row holds before it), `rows` (the
rows in the step, in the step's order), and T new tokens for each of them.
"""
import torch

from exercise_checks import Check, assert_close

CACHE_AXES = ("layer", "row", "head", "slot", "dim")
TINY = {"n_layer": 2, "n_head": 4, "head_dim": 16}    # the tiny preset's attention shapes
SMALL = {"n_layer": 2, "n_head": 2, "head_dim": 4}
THREE_LAYERS = {"n_layer": 3, "n_head": 2, "head_dim": 4}


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


def edge(lengths, rows, T, shape=TINY, max_seq_len=8, layer=1):
    """An edge step, name -> function(draw) -> inputs: its lengths, rows, T, shape and layer are the situation,
    fixed; the cache's contents, q and the new keys and values are drawn from the seed, so that a table of
    answers built for one seed answers no edge of another."""
    return lambda d: step(lengths, rows, T, shape, max_seq_len, layer, seed=d.int(0, 10**9))


def named_mistake(output, expected: dict, what: str, where: str, same) -> None:
    """Fail naming the mistake when `output` is not the answer but is what a known mistake gives (`same`
    compares an output with an answer)."""
    if same(output, expected["want"]) is False:
        for mistake, answer in expected["mistakes"].items():
            if same(output, answer):
                raise AssertionError(f"{what}: {mistake}. Look at {where}.")


def same_tensor(a, b: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> bool | None:
    """Whether `a` is `b` within tolerance; None when `a` is not even a tensor of b's shape."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return None
    return bool(torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol).all())


def same_caches(a, b) -> bool | None:
    """Whether the caches `a` returned are `b`: both (a dict of k and v), or the key cache alone (a tensor)."""
    if not isinstance(a, dict):
        return None
    found = [same_tensor(a.get(name), want, atol=0, rtol=0)
             for name, want in (b.items() if isinstance(b, dict) else [("k", b)])]
    return None if None in found else all(found)


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
            "prefill of every row": step([0, 0, 0], [0, 1, 2], 3, SMALL),
            "prefill of rows 0 and 2 only": step([0, 0, 0], [0, 2], 4, SMALL),
            "decode with equal lengths": step([3, 3, 3], [0, 1, 2], 1, SMALL),
            "decode of rows 1 and 2 with equal lengths": step([3, 3, 3], [1, 2], 1, SMALL),
            "decode with ragged lengths": step([2, 5, 1], [0, 1, 2], 1, SMALL),
            "two-token chunk with ragged lengths, rows out of order": step([1, 4, 0], [1, 0], 2, SMALL),
        }

    def edges(self):
        return {
            "a write that ends exactly at the reserved length: 3 new tokens after 5 of 8":
                edge([5, 5], [0, 1], 3, max_seq_len=8),
            "a ragged decode, rows out of order, the longest row filling its last reserved slot":
                edge([7, 2, 4], [2, 0, 1], 1, SMALL, max_seq_len=8, layer=0),
            "several layers: the middle one of three": edge([2, 2, 2], [0, 1, 2], 2, THREE_LAYERS, 6),
            "several sequences: 3 of 4 rows, out of order, ragged, 2 tokens each":
                edge([1, 4, 0, 2], [3, 0, 2], 2, SMALL, max_seq_len=7, layer=0),
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

    def expect(self, inputs):
        from key_kv_cache import write_key
        return write_key(inputs)

    def judge(self, inputs, output, expected):
        where = f"{self.where} ({describe(inputs)})"
        named_mistake(output, expected, "cache.k and cache.v after write", where, same_caches)
        for name in ("k", "v"):
            got = output.get(name) if isinstance(output, dict) else None
            assert_close(got, expected["want"][name], f"cache.{name} after write (every slot the step does not "
                         "write keeps the zeros a new cache starts with)", where, CACHE_AXES, atol=0, rtol=0)


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

    def edges(self):
        return {
            "a fresh prefill of three rows (T == L)": edge([0, 0, 0], [0, 1, 2], 4, SMALL, 6, layer=0),
            "a chunk that ends exactly at the reserved length: 3 new tokens after 5 of 8":
                edge([5, 5], [0, 1], 3, max_seq_len=8),
            "a ragged decode, rows out of order, the longest row at its last reserved slot":
                edge([7, 2, 4], [2, 0, 1], 1, SMALL, max_seq_len=8, layer=0),
            "several layers: the middle one of three": edge([2, 2, 2], [0, 1, 2], 2, THREE_LAYERS, 6),
            "several sequences: 3 of 4 rows, out of order, ragged, 2 tokens each":
                edge([1, 4, 0, 2], [3, 0, 2], 2, SMALL, max_seq_len=7, layer=0),
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
        cache = build_cache(inputs)
        cache.k.copy_(inputs["cached_k"])
        cache.v.copy_(inputs["cached_v"])
        return cache.read(inputs["layer"], inputs["q"], inputs["k"], inputs["v"])

    def expect(self, inputs):
        from key_kv_cache import read_key
        return read_key(inputs)

    def judge(self, inputs, output, expected):
        where = f"{self.where} ({describe(inputs)})"
        what = "read(layer, q, k, v)"
        named_mistake(output, expected, what, where, same_tensor)
        assert_close(output, expected["want"], f"{what} (each query attends over its own row's slots up to its "
                     "position, in this layer)", where, ("step row", "head", "query", "dim"))


WRITE, READ = Write(), Read()
test_write = WRITE.pytest_test()
test_read = READ.pytest_test()
