"""Lesson 01 exercises in minillm/model.py: causal self-attention, and splitting q, k, v into heads.

Each test calls the one function its exercise lives in, with crafted inputs,
and compares against an oracle written one position at a time.
"""
import pytest
import torch

from exercise_checks import assert_close, attend_one_query
from minillm.config import PRESETS
from minillm.model import CausalSelfAttention, causal_attention, causal_mask

ATTENTION = "minillm/model.py, causal_attention"
HEADS = "minillm/model.py, CausalSelfAttention.forward"
BHTD = ("batch", "head", "token", "dim")


def qkv(B=2, H=3, T=5, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)]


def attention_one_position_at_a_time(q, k, v, causal=True):
    """Oracle: query t of each (batch, head) attends over keys 0..t (or all keys when causal=False)."""
    B, H, T, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                seen = t + 1 if causal else T
                out[b, h, t] = attend_one_query(q[b, h, t], k[b, h, :seen], v[b, h, :seen])
    return out


@pytest.mark.exercise("model-causal-attention")
def test_causal_attention_keeps_the_shape_of_q():
    q, k, v = qkv(B=2, H=3, T=5, D=8)
    out = causal_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape, (
        f"causal_attention(q, k, v) with q, k, v of shape {tuple(q.shape)} = (B, H, T, D) must return that shape, "
        f"got {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}. Look at {ATTENTION}.")


@pytest.mark.exercise("model-causal-attention")
def test_causal_attention_matches_one_position_at_a_time():
    q, k, v = qkv(B=2, H=3, T=6, D=16, seed=1)
    out = causal_attention(q, k, v)
    expected = attention_one_position_at_a_time(q, k, v)
    if isinstance(out, torch.Tensor) and out.shape == q.shape and not torch.allclose(out.double(), expected, atol=1e-5):
        if torch.allclose(out.double(), attention_one_position_at_a_time(q, k, v, causal=False), atol=1e-5):
            raise AssertionError("causal_attention lets every token see the tokens after it: "
                                 f"mask the scores above the diagonal with -inf before the softmax. Look at {ATTENTION}.")
        if torch.allclose(out.double(), attention_one_position_at_a_time(q * 4, k, v), atol=1e-5):
            raise AssertionError("causal_attention's scores are not scaled: divide q·kᵀ by √head_dim "
                                 f"(here √16 = 4). Look at {ATTENTION}.")
    assert_close(out, expected, "causal_attention(q, k, v)", ATTENTION, BHTD)


@pytest.mark.exercise("model-causal-attention")
def test_first_token_sees_only_itself():
    q, k, v = qkv(B=1, H=2, T=4, D=8, seed=2)
    out = causal_attention(q, k, v)
    assert_close(out[:, :, 0], v[:, :, 0], "the output at token 0 (it may attend to token 0 only, so it must equal v[..., 0, :])",
                 ATTENTION, ("batch", "head", "dim"))


@pytest.mark.exercise("model-causal-attention")
def test_later_tokens_do_not_change_earlier_outputs():
    q, k, v = qkv(B=1, H=2, T=5, D=8, seed=3)
    before = causal_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0   # token 4 gets a different key and value
    v2[:, :, -1] -= 5.0
    after = causal_attention(q, k2, v2)
    assert_close(after[:, :, :-1], before[:, :, :-1],
                 "outputs at tokens 0..3 after changing only token 4's key and value (token 4 is in their future)",
                 ATTENTION, BHTD)
    assert not torch.allclose(after[:, :, -1], before[:, :, -1]), (
        f"changing token 4's key and value did not change token 4's own output: it must attend to itself. Look at {ATTENTION}.")


@pytest.mark.exercise("model-causal-attention")
def test_a_single_token_returns_its_value():
    q, k, v = qkv(B=3, H=2, T=1, D=4, seed=4)
    assert_close(causal_attention(q, k, v), v, "causal_attention over one token (its only key is itself)", ATTENTION, BHTD)


@pytest.mark.exercise("model-causal-attention")
def test_queries_at_the_end_of_a_longer_context():
    """Three queries after four cached tokens: the queries are the last 3 of the 7 keys, so query t sits at
    position 4 + t and sees keys 0 .. 4 + t (a decode step is the case T = 1: it sees every key)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    out = causal_attention(q, k, v)
    want = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(2):
        for t in range(3):
            want[0, h, t] = attend_one_query(q[0, h, t], k[0, h, :5 + t], v[0, h, :5 + t])
    assert_close(out, want, "causal_attention(q, k, v) with 3 queries over 7 keys (no mask)", ATTENTION, BHTD)
    one = causal_attention(q[:, :, :1], k, v)
    assert_close(one[0, :, 0], torch.stack([attend_one_query(q[0, h, 0], k[0, h], v[0, h]) for h in range(2)]),
                 "causal_attention with one query over 7 keys (a decode: it sees all of them)", ATTENTION,
                 ("head", "dim"))


@pytest.mark.exercise("model-causal-attention")
def test_a_mask_hides_each_rows_padding():
    """A ragged batch: row 0's query is at position 2, row 1's at position 5, over 6 keys. The mask (True where
    a query may look) hides row 0's keys 3..5, which are padding."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = causal_mask(torch.tensor([[2], [5]]), 6)   # (2, 1, 1, 6)
    out = causal_attention(q, k, v, mask)
    want = torch.zeros(q.shape, dtype=torch.float64)
    for b, seen in ((0, 3), (1, 6)):
        for h in range(2):
            want[b, h, 0] = attend_one_query(q[b, h, 0], k[b, h, :seen], v[b, h, :seen])
    assert_close(out, want, "causal_attention(q, k, v, mask) for a ragged batch of two decodes", ATTENTION, BHTD)


class RecordingCache:
    """Stands in for a KV cache: records the q, k, v that attention hands it and returns zeros of the right
    shape, so these tests never touch causal_attention or a real cache."""

    def __init__(self, out_shape):
        self.out_shape = out_shape
        self.calls = []

    def attend(self, layer_idx, q, k, v):
        self.calls.append((q, k, v))
        return torch.zeros(self.out_shape)


def run_heads(B=2, T=3, seed=0):
    cfg = PRESETS["tiny"]
    torch.manual_seed(seed)
    attn = CausalSelfAttention(cfg, layer_idx=0)
    x = torch.randn(B, T, cfg.n_embd, generator=torch.Generator().manual_seed(seed + 1))
    cache = RecordingCache((B, cfg.n_head, T, cfg.head_dim))
    with torch.no_grad():
        attn(x, cache)
        fused = x @ attn.c_attn.weight + attn.c_attn.bias   # (B, T, 3C): q | k | v
    assert len(cache.calls) == 1, f"CausalSelfAttention.forward called cache.attend {len(cache.calls)} times, expected once"
    return cfg, fused, cache.calls[0]


@pytest.mark.exercise("model-heads")
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_heads_hand_the_cache_b_h_t_d(name):
    cfg, _, recorded = run_heads(B=2, T=3)
    got = recorded["qkv".index(name)]
    want = (2, cfg.n_head, 3, cfg.head_dim)
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == want, (
        f"{name} handed to the cache should have shape (B, n_head, T, head_dim) = {want} for x of shape (2, 3, {cfg.n_embd}), "
        f"got {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}. Look at {HEADS}.")


@pytest.mark.exercise("model-heads")
def test_each_head_takes_its_slice_of_the_fused_projection():
    cfg, fused, recorded = run_heads(B=2, T=4, seed=5)
    C, D = cfg.n_embd, cfg.head_dim
    for which, name in enumerate("qkv"):
        # Oracle: head h of q is columns h·D .. (h+1)·D of the first C columns; k and v follow after C and 2C.
        expected = torch.stack([fused[:, :, which * C + h * D: which * C + (h + 1) * D] for h in range(cfg.n_head)], dim=1)
        assert_close(recorded[which], expected, f"{name} handed to the cache (head h = columns "
                     f"{which * C}+h·{D} .. {which * C}+(h+1)·{D} of c_attn(x))", HEADS, BHTD)
