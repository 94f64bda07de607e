"""Lesson 02 exercises in minillm/model.py: causal self-attention written out, and splitting q, k, v into heads.

Each check calls the one function its exercise lives in, with crafted inputs;
the answers, and those of the classic mistakes that a message names, come from
the answer key (key_model.py, the instructor's), worked out from the
definitions in float64.
"""
import torch

from exercise_checks import Check, assert_close, kind

BHTD = ("batch", "head", "token", "dim")


def qkv(B, H, T, D, seed, L=None):
    g = torch.Generator().manual_seed(seed)
    L = T if L is None else L
    return {"q": torch.randn(B, H, T, D, generator=g), "k": torch.randn(B, H, L, D, generator=g),
            "v": torch.randn(B, H, L, D, generator=g)}


def ragged_mask(positions: list[list[int]], num_keys: int) -> torch.Tensor:
    """(B, 1, T, L), True where a query may look: the query at position p of a row sees keys 0..p."""
    return torch.tensor([[[[s <= p for s in range(num_keys)] for p in row]] for row in positions])


def named_mistake(output, expected: dict, what: str, where: str) -> None:
    """Fail naming the mistake when `output` is not the answer but is what a known mistake returns."""
    if isinstance(output, torch.Tensor) and output.shape == expected["want"].shape and not close(output, expected["want"]):
        for mistake, answer in expected["mistakes"].items():
            if close(output, answer):
                raise AssertionError(f"{what}: {mistake}. Look at {where}.")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.isclose(a.double(), b.double(), atol=1e-5, rtol=1e-4).all())


class CausalAttention(Check):
    exercise = "model-causal-attention"
    where = "minillm/model.py, attention_by_hand"
    off_limits = ("decode_attention",)   # attention written out already, for any number of queries with a mask

    def visible(self):
        mask_case = {**qkv(2, 2, 1, 8, seed=7, L=6), "mask": ragged_mask([[2], [5]], 6)}
        return {
            "keeps the shape of q (B=2, H=3, T=5, D=8)": qkv(2, 3, 5, 8, seed=0),
            "matches attention one position at a time (T=6, D=16)": qkv(2, 3, 6, 16, seed=1),
            "token 0 sees only itself, token t sees tokens 0..t": qkv(1, 2, 4, 8, seed=2),
            "a single token returns its value": qkv(3, 2, 1, 4, seed=4),
            "3 queries at the end of 7 keys: query t sits at position 4 + t": qkv(1, 2, 3, 8, seed=6, L=7),
            "1 query over 7 keys (a decode step sees every key)": qkv(1, 2, 1, 8, seed=6, L=7),
            "a mask hides the padding of a ragged batch's shorter row": mask_case,
        }

    def edges(self):
        """The shapes and the mask are the situation, fixed; q, k and v are drawn from the seed."""
        def case(B, H, T, D, L=None, mask=None):
            return lambda d: {**qkv(B, H, T, D, seed=d.int(0, 10**9), L=L), **({"mask": mask} if mask is not None else {})}

        return {
            "several heads and several tokens at once (B=2, H=4, T=L=6, D=16)": case(2, 4, 6, 16),
            "more keys than queries: 3 queries at the end of 9 keys": case(2, 3, 3, 8, L=9),
            "a decode step: 1 query over 9 keys, in each of 3 rows": case(3, 2, 1, 8, L=9),
            "a ragged chunk: 2 queries per row, rows ending at 3, 8 and 5 of 9 keys":
                case(3, 2, 2, 8, L=9, mask=ragged_mask([[2, 3], [7, 8], [4, 5]], 9)),
            # The mask is the whole truth: row 1 has one real query, at the last key, and a padding slot after it,
            # so its first query sees all 9 keys, more than the triangle of 2 queries at the end would let it.
            "a given mask is used as it is: a padded row's one query sees every key":
                case(3, 2, 2, 8, L=9, mask=ragged_mask([[2, 3], [8, 8], [4, 5]], 9)),
        }

    def situations(self):
        def prefill(d):
            return qkv(d.int(1, 3), d.int(1, 3), d.int(2, 6), d.choice([4, 8, 16]), seed=d.int(0, 10**9))

        def queries_at_the_end(d):
            T = d.int(2, 4)
            return qkv(d.int(1, 2), d.int(1, 3), T, d.choice([4, 8]), seed=d.int(0, 10**9), L=T + d.int(1, 5))

        def decode(d):
            return qkv(d.int(1, 3), d.int(1, 3), 1, d.choice([4, 8]), seed=d.int(0, 10**9), L=d.int(2, 9))

        def ragged(d):
            B, T, L = d.int(2, 3), d.int(1, 2), d.int(4, 8)
            positions = [[p + t for t in range(T)] for p in (d.int(0, L - T) for _ in range(B))]
            return {**qkv(B, d.int(1, 2), T, d.choice([4, 8]), seed=d.int(0, 10**9), L=L),
                    "mask": ragged_mask(positions, L)}

        return {"a prompt attends over itself": prefill, "queries at the end of a longer context": queries_at_the_end,
                "a decode step": decode, "a ragged batch with a mask": ragged}

    def run(self, inputs):
        from minillm.model import attention_by_hand
        if "mask" in inputs:
            return attention_by_hand(inputs["q"], inputs["k"], inputs["v"], inputs["mask"])
        return attention_by_hand(inputs["q"], inputs["k"], inputs["v"])

    def expect(self, inputs):
        from key_model import causal_attention_key
        return causal_attention_key(inputs)

    def judge(self, inputs, output, expected):
        q, k, mask = inputs["q"], inputs["k"], inputs.get("mask")
        shape = f"q {tuple(q.shape)} over keys {tuple(k.shape)}" + (" with a mask" if mask is not None else "")
        what = f"attention_by_hand(q, k, v{', mask' if mask is not None else ''}) with {shape}"
        if not isinstance(output, torch.Tensor) or output.shape != q.shape:
            raise AssertionError(f"{what} must return q's shape (B, H, T, D) = {tuple(q.shape)}, "
                                 f"got {kind(output)}. Look at {self.where}.")
        named_mistake(output, expected, what, self.where)
        assert_close(output, expected["want"], what, self.where, BHTD)


class RecordingCache:
    """Stands in for a KV cache: records the q, k, v that attention hands it and returns zeros of the right
    shape, so this check never touches causal_attention or a real cache."""

    def __init__(self, out_shape):
        self.out_shape = out_shape
        self.calls = []

    def attend(self, layer_idx, q, k, v):
        self.calls.append((q, k, v))
        return torch.zeros(self.out_shape)


def heads_case(B, T, n_head, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    C = n_head * head_dim
    return {"n_head": n_head, "x": torch.randn(B, T, C, generator=g),
            "weight": torch.randn(C, 3 * C, generator=g) * 0.3, "bias": torch.randn(3 * C, generator=g) * 0.3}


class Heads(Check):
    exercise = "model-heads"
    where = "minillm/model.py, CausalSelfAttention.forward"

    def visible(self):
        return {"tiny's shapes: 4 heads of 16, B=2, T=3": heads_case(2, 3, 4, 16, seed=0),
                "each head takes its slice of the fused projection: 4 heads of 16, B=2, T=4": heads_case(2, 4, 4, 16, seed=5),
                "one head, one token": heads_case(1, 1, 1, 8, seed=3)}

    def edges(self):
        """The shapes are the situation, fixed; x and c_attn's weights are drawn from the seed."""
        def case(B, T, n_head, head_dim):
            return lambda d: heads_case(B, T, n_head, head_dim, seed=d.int(0, 10**9))

        return {"several heads and several tokens at once: 4 heads of 8, B=2, T=5": case(2, 5, 4, 8),
                "more heads than tokens: 6 heads of 2, B=1, T=3": case(1, 3, 6, 2)}

    def situations(self):
        def several(d):
            return heads_case(d.int(1, 3), d.int(1, 5), d.int(2, 4), d.choice([2, 4, 8]), seed=d.int(0, 10**9))

        def one_head(d):
            return heads_case(d.int(1, 3), d.int(2, 4), 1, d.choice([4, 8]), seed=d.int(0, 10**9))

        def heads_and_tokens(d):   # T, H ≥ 2 at once: a reshape straight to (B, H, T, D) mixes them up
            return heads_case(d.int(1, 3), d.int(2, 5), d.int(2, 4), d.choice([2, 4, 8]), seed=d.int(0, 10**9))

        return {"several heads": several, "several heads and several tokens at once": heads_and_tokens,
                "a single head": one_head}

    def run(self, inputs):
        from minillm.config import GPT2Config
        from minillm.model import CausalSelfAttention
        x = inputs["x"]
        B, T, C = x.shape
        config = GPT2Config(n_layer=1, n_head=inputs["n_head"], n_embd=C, n_ctx=64, vocab_size=16, eos_token_id=None)
        attn = CausalSelfAttention(config, layer_idx=0)
        cache = RecordingCache((B, inputs["n_head"], T, C // inputs["n_head"]))
        with torch.no_grad():
            attn.c_attn.weight.copy_(inputs["weight"])
            attn.c_attn.bias.copy_(inputs["bias"])
            attn(x, cache)
        return {"calls": len(cache.calls), **({"q": cache.calls[0][0], "k": cache.calls[0][1], "v": cache.calls[0][2]}
                                              if cache.calls else {})}

    def expect(self, inputs):
        from key_model import heads_key
        return heads_key(inputs)

    def judge(self, inputs, output, expected):
        x, H = inputs["x"], inputs["n_head"]
        B, T, C = x.shape
        D = C // H
        if not isinstance(output, dict) or output.get("calls") != 1:
            raise AssertionError(f"CausalSelfAttention.forward should hand q, k, v to cache.attend once, it did "
                                 f"{output.get('calls') if isinstance(output, dict) else kind(output)} times. "
                                 f"Look at {self.where}.")
        for name in "qkv":
            what = (f"{name} handed to the cache for x of shape {(B, T, C)} with {H} heads of {D} "
                    f"(expected (B, n_head, T, head_dim); head h of {name} is its h-th block of {D} columns "
                    f"of c_attn(x)'s {name} third)")
            named_mistake(output.get(name), {"want": expected["want"][name],
                                             "mistakes": {m: answer[name] for m, answer in expected["mistakes"].items()
                                                          if name in answer}},
                          f"{name} handed to the cache for x of shape {(B, T, C)} with {H} heads of {D}", self.where)
            assert_close(output.get(name), expected["want"][name], what, self.where, BHTD)


CAUSAL_ATTENTION, HEADS = CausalAttention(), Heads()
test_causal_attention = CAUSAL_ATTENTION.pytest_test()
test_heads = HEADS.pytest_test()


def test_the_grader_refuses_an_attention_that_calls_a_fused_kernel():
    """The attention exercise is the math itself: its hint puts torch's fused kernel, and the engine's
    causal_attention that calls it, off limits, and the grader finds them in a region's code."""
    from minillm.classroom.off_limits import forbidden_calls
    from minillm.classroom.regions import ROOT, find_exercises
    (ex,) = [e for e in find_exercises(ROOT) if e.id == CAUSAL_ATTENTION.exercise]
    assert {"scaled_dot_product_attention", "causal_attention", "transformers"} <= set(ex.off_limits)
    fused = ["import torch.nn.functional as F", "return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"]
    assert forbidden_calls(ex, fused) == ["scaled_dot_product_attention"]
    assert forbidden_calls(ex, ["from minillm.model import causal_attention", "return causal_attention(q, k, v)"]) \
        == ["causal_attention"]
    assert forbidden_calls(ex, list(ex.body)) == []
