"""The from-scratch GPT-2, sampling, naive decode and the contiguous KV cache, on random weights."""
import numpy as np
import pytest
import torch

from minillm import GPT2, GPT2Config, PRESETS, SamplingParams
from minillm import kv_cache, naive_decode
from minillm.kv_cache import KVCache, Segment
from minillm.cpu_layout import (CPUConv1D, CPULMHead, attention_layout, choose_layout, decode_attention, lay_out,
                                 layout_of, linears_layout, lm_head_layout)
from minillm.model import Conv1D, LMHead, attention_by_hand, causal_attention, causal_mask
from minillm.sampling import NonFiniteLogitsError, apply_top_k, apply_top_p, sample
from minillm.sampling_params import finish_reason
from models import context_model

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    return context_model()


def ids(*shape, seed=0):
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# ---- config ------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, heads, width, params", [
    ("gpt2", 12, 12, 768, 124_439_808), ("gpt2-medium", 24, 16, 1024, 354_823_168),
    ("gpt2-large", 36, 20, 1280, 774_030_080), ("gpt2-xl", 48, 25, 1600, 1_557_611_200)])
def test_presets_match_the_checkpoints(name, layers, heads, width, params):
    c = GPT2Config.from_preset(name)
    assert (c.n_layer, c.n_head, c.n_embd, c.n_ctx, c.vocab_size) == (layers, heads, width, 1024, 50257)
    assert c.num_params() == params  # the published parameter counts of the four checkpoints


def test_derived_figures(model):
    assert CFG.num_params() == sum(p.numel() for p in model.parameters())
    gpt2 = PRESETS["gpt2"]
    assert gpt2.kv_bytes_per_token(torch.float16) == 2 * 12 * 768 * 2 == 36_864
    assert gpt2.weight_bytes(torch.bfloat16) == 2 * gpt2.num_params()
    assert gpt2.flops_per_token(context_len=100) - gpt2.flops_per_token(0) == 4 * 12 * 768 * 100


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'gpt3'.*gpt2-xl"):
        GPT2Config.from_preset("gpt3")


def test_naive_decode_rejects_bad_prompts_before_running(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        naive_decode.generate(model, [], SamplingParams(temperature=0, max_tokens=1))


# ---- the test model ----------------------------------------------------------

def test_the_test_model_depends_on_its_context(model):
    """GPT-2's own init repeats the last prompt token whatever came before; the tests' model must not, or two
    decoding paths could agree while one of them reads the wrong keys."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = naive_decode.generate(model, [5, 6, 7, 8], greedy)
    assert len(set(out)) >= 8, f"only {len(set(out))} distinct tokens in {out}"
    assert naive_decode.generate(model, [9, 10, 11, 5, 6, 7, 8], greedy) != out, "a longer prefix changed nothing"
    gpt2_init = GPT2(CFG, seed=0).eval()
    repeats = naive_decode.generate(gpt2_init, [5, 6, 7, 8], greedy)
    assert len(set(repeats)) <= 2, "GPT-2's own init was expected to ignore the context (why the tests avoid it)"


# ---- the model -----------------------------------------------------------------

def test_a_batch_gives_each_row_its_own_logits(model):
    x = ids(3, 17)
    with torch.no_grad():
        batched = model(x)
        rows = torch.cat([model(x[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, rows, atol=1e-5, rtol=1e-5)


def test_later_tokens_never_change_earlier_logits(model):
    a, b = ids(1, 20, seed=1), ids(1, 20, seed=1)
    b[0, 12:] = (b[0, 12:] + 1) % CFG.vocab_size
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :12], lb[:, :12])
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_logits_only_at_chosen_positions(model):
    x = ids(2, 9)
    with torch.no_grad():
        full = model(x)
        chosen = model(x, logits_indices=torch.tensor([8, 17]))  # each row's last token in the (B·T) batch
    assert chosen.shape == (2, CFG.vocab_size)
    torch.testing.assert_close(chosen, full[:, -1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_the_lm_head_copy_scores_as_the_tied_weight_does(dtype, tol):
    """The [C, V] copy the loader keeps on a CPU gives wte's logits, at every row and at chosen rows, in fp32
    (rounding only: the same products, summed in another order) and in bf16 (its 8-bit mantissa)."""
    tied, copied = context_model().to(dtype), lay_out(context_model().to(dtype), head_copy=True)
    assert copied.lm_head.wte_t.shape == (CFG.n_embd, CFG.vocab_size) and copied.lm_head.wte_t.is_contiguous()
    assert lm_head_layout(tied) != lm_head_layout(copied)
    x = ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(copied(x), tied(x), atol=tol, rtol=tol)
        rows = torch.tensor([3, 17])
        torch.testing.assert_close(copied(x, logits_indices=rows), tied(x, logits_indices=rows), atol=tol, rtol=tol)
    assert copied.state_dict().keys() == tied.state_dict().keys(), "the copy is derived from wte, never saved"


def test_packed_projections_give_the_same_logits_and_serve_only_steps_of_several_rows():
    """oneDNN-packed copies of the block projections (fp32, the loader's choice on a CPU) give the logits of W as
    stored, for prefills, ragged rows and single tokens; a packed copy that disagrees with W changes only what
    several rows compute, so the copy is what those steps read, and one row reads W."""
    plain, packed = context_model(), lay_out(context_model(), packed=True)
    assert linears_layout(packed) != linears_layout(plain)
    x, one = ids(2, 9), ids(1, 1, seed=1)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(one), plain(one), atol=1e-5, rtol=1e-5)
        fc = packed.h[0].mlp.c_fc
        fc.packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn_like(fc.weight.t()).contiguous(), 16)
        assert not torch.allclose(packed(x), plain(x), atol=1e-3)
        torch.testing.assert_close(packed(one), plain(one), atol=1e-5, rtol=1e-5)
        lay_out(packed, packed=True)  # the head's packed copy likewise serves several rows only
        packed.lm_head.packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn_like(packed.wte.weight), 16)
        assert not torch.allclose(packed(x), plain(x), atol=1e-3)
        torch.testing.assert_close(packed(one), plain(one), atol=1e-5, rtol=1e-5)
    lay_out(packed, packed=False)   # nothing left to swap in: model.py's own modules again
    assert type(packed.lm_head) is LMHead and all(type(m) is Conv1D for m in packed.modules() if isinstance(m, Conv1D))


def count_numpy_products(monkeypatch) -> list:
    """Record the row count of every product numpy's BLAS computes in the model."""
    from minillm import cpu_layout
    calls, real = [], cpu_layout.numpy_product
    monkeypatch.setattr(cpu_layout, "numpy_product", lambda x, *a: calls.append(x.numel() // x.shape[-1]) or
                        real(x, *a))
    return calls


@pytest.mark.parametrize("head_copy, packed", [(True, True), (False, False)])
def test_numpy_blas_gives_the_same_logits_for_one_row_and_leaves_several_rows_to_torch(head_copy, packed,
                                                                                       monkeypatch):
    """One-row products through numpy's BLAS (the loader's choice on an AMD CPU) give torch's logits (fp32 1e-5),
    over the tied head and its copy; numpy computes every one-row product and nothing else, not under autograd,
    not in bf16; and it reads the weights themselves: a change made in place is seen, with no layout to redo."""
    plain, fast = context_model(), context_model()
    for model in (plain, fast):   # biases that are not zero, as a trained checkpoint's are not
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    lay_out(fast, head_copy=head_copy, packed=packed, numpy_one_row=True)
    assert "numpy" in linears_layout(fast) and "numpy" in lm_head_layout(fast) and "numpy" not in linears_layout(plain)
    calls = count_numpy_products(monkeypatch)
    one, several = ids(1, 1, seed=1), ids(2, 9)
    with torch.inference_mode():
        torch.testing.assert_close(fast(one), plain(one), atol=1e-5, rtol=1e-5)
        assert calls == [1] * (4 * CFG.n_layer + 1), "every projection and the head, one row each"
        calls.clear()
        torch.testing.assert_close(fast(several), plain(several), atol=1e-5, rtol=1e-5)
        assert calls == []
        fast.h[0].mlp.c_fc.weight.mul_(2)
        plain.h[0].mlp.c_fc.weight.mul_(2)
        torch.testing.assert_close(fast(one), plain(one), atol=1e-5, rtol=1e-5)
    calls.clear()
    with torch.enable_grad():
        fast(one).sum().backward()   # autograd through torch's kernels: numpy's product has no gradient
    assert calls == [] and fast.h[0].mlp.c_fc.weight.grad is not None
    with torch.inference_mode():
        fast.to(torch.bfloat16)(one)
    assert calls == [], "numpy has no bf16 BLAS: torch computes it"
    lay_out(fast, numpy_one_row=False)
    assert linears_layout(fast) == linears_layout(plain) or packed


@pytest.mark.parametrize("dtype, tol, layout", [
    (torch.float32, 1e-5, {"head_copy": True, "packed": True, "numpy_one_row": False}),   # the loader's on a CPU
    (torch.float32, 1e-5, {"head_copy": True, "packed": True, "numpy_one_row": True}),    # ... on an AMD one
    (torch.float32, 1e-5, {"head_copy": False, "packed": False, "numpy_one_row": True}),
    (torch.bfloat16, 5e-2, {"head_copy": True, "packed": False, "numpy_one_row": False})])
def test_a_layout_swaps_modules_into_the_model_and_gives_its_logits(dtype, tol, layout):
    """A layout replaces modules, as gpt-fast's quantize.py does: every Conv1D that reads a copy or numpy becomes a
    CPUConv1D holding the same W and b, the head a CPULMHead; the logits are the plain model's (fp32: 1e-5; bf16:
    its 8-bit mantissa), prefill and one row; state_dict is unchanged; with nothing on, model.py's modules return."""
    plain, fast = context_model().to(dtype), lay_out(context_model().to(dtype), **layout)
    assert layout_of(fast) == layout
    convs = [m for m in fast.modules() if isinstance(m, Conv1D)]
    swapped = layout["packed"] or layout["numpy_one_row"]
    assert len(convs) == 4 * CFG.n_layer and {type(m) for m in convs} == {CPUConv1D if swapped else Conv1D}
    assert type(fast.lm_head) is CPULMHead and type(plain.lm_head) is LMHead
    assert fast.h[0].mlp.c_fc.weight is dict(fast.named_parameters())["h.0.mlp.c_fc.weight"]
    assert fast.state_dict().keys() == plain.state_dict().keys()
    with torch.inference_mode():
        for x in (ids(2, 9), ids(1, 1, seed=1)):
            torch.testing.assert_close(fast(x), plain(x), atol=tol, rtol=tol)
    lay_out(fast, head_copy=False, packed=False, numpy_one_row=False)
    assert type(fast.lm_head) is LMHead and {type(m) for m in fast.modules() if isinstance(m, Conv1D)} == {Conv1D}


def test_the_loader_swaps_the_cpu_modules_in_and_the_model_file_knows_none_of_them():
    """After loading on a CPU the projections and the head are the layout's modules; model.py's GPT2 built alone
    holds its own, and computes with F.linear whatever CPU it runs on."""
    from minillm.checkpoints.load import random_model
    loaded, built = random_model(CFG, "cpu", torch.float32), GPT2(CFG)
    assert type(loaded.lm_head) is CPULMHead and type(loaded.h[0].attn.c_attn) is CPUConv1D
    assert type(built.lm_head) is LMHead and type(built.h[0].attn.c_attn) is Conv1D


def test_in_tests_the_loader_takes_one_path_on_every_machine():
    """tests/conftest.py pins the loader's CPU-dependent defaults: torch's BLAS for one row, no bf16 packing,
    whatever this CPU is; without the pin an AMD CPU would take numpy's BLAS here, and an AVX-512 one bf16 copies."""
    fp32, bf16 = choose_layout(context_model()), choose_layout(context_model().to(torch.bfloat16))
    assert layout_of(fp32) == {"head_copy": True, "packed": True, "numpy_one_row": False}
    assert layout_of(bf16) == {"head_copy": True, "packed": False, "numpy_one_row": False}
    assert "written out" not in attention_layout(bf16)


def test_the_loader_chooses_numpy_blas_for_fp32_on_an_amd_cpu_whose_openblas_threads_sleep():
    """The choice is the device's, made at load: an AMD CPU whose numpy links OpenBLAS, with idle threads that
    sleep, computes one row with it; Intel's keeps torch's MKL, as does another BLAS, spinning threads, another
    dtype, or a GPU. This machine's own answers are named; numpy is expected to link OpenBLAS (PyPI's wheels
    do): the thread tests below depend on it."""
    from minillm.cpu_layout import numpy_blas_pays
    from minillm.device import cpu_vendor, numpy_blas
    cpu, gpu, fp32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    assert numpy_blas_pays(cpu, fp32, "AuthenticAMD", "openblas", True)
    assert not numpy_blas_pays(cpu, fp32, "GenuineIntel", "openblas", True)
    assert not numpy_blas_pays(cpu, fp32, "AuthenticAMD", "mkl", True)
    assert not numpy_blas_pays(cpu, fp32, "AuthenticAMD", "openblas", False)
    assert not numpy_blas_pays(cpu, torch.bfloat16, "AuthenticAMD", "openblas", True)
    assert not numpy_blas_pays(gpu, fp32, "AuthenticAMD", "openblas", True)
    assert layout_of(choose_layout(context_model(), numpy_one_row=True))["numpy_one_row"]
    assert not layout_of(choose_layout(context_model(), numpy_one_row=False))["numpy_one_row"]
    assert cpu_vendor(), "the CPU's vendor could not be read from /proc/cpuinfo"
    assert numpy_blas() == "openblas", f"numpy links {numpy_blas()!r}, not OpenBLAS: install numpy's PyPI wheel"


def test_packed_copies_are_kept_in_fp32_and_in_bf16_where_the_cpu_computes_it_natively():
    """oneDNN's packed copies pay in fp32 on a CPU, and in bf16 only where the CPU multiplies bf16 in hardware
    (AVX512_BF16 or AMX, read from /proc/cpuinfo's flags, as vLLM's CPU backend checks); in bf16 they then
    serve one row as well (oneDNN's bf16 kernel streams faster than MKL's), in fp32 several rows only. A bf16
    model without them (this test's: every CPU can run it) keeps the head's [C, V] copy."""
    from minillm.cpu_layout import native_bf16, packing_pays, serves_packed
    from minillm.device import cpuinfo
    cpu, gpu, bf16, fp32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    zen4, zen3, spr = "fpu avx2 avx512f avx512_bf16", "fpu avx2 fma", "avx512f amx_bf16 amx_tile"
    assert native_bf16(zen4) and native_bf16(spr) and not native_bf16(zen3) and not native_bf16("avx512_bf16x")
    assert packing_pays(cpu, fp32, zen3) and packing_pays(cpu, bf16, zen4) and not packing_pays(cpu, bf16, zen3)
    assert not packing_pays(cpu, torch.float16, zen4) and not packing_pays(gpu, fp32, zen4)
    one, two = torch.ones(1, 1, 8), torch.ones(2, 1, 8)
    with torch.inference_mode():
        assert serves_packed(one.bfloat16(), torch.ones(8, 8, dtype=bf16)) and serves_packed(two, torch.ones(8, 8))
        assert not serves_packed(one, torch.ones(8, 8)) and not serves_packed(two, torch.ones(8, 8, dtype=bf16))
    half = choose_layout(context_model().to(bf16), numpy_one_row=False, packed=False)
    assert layout_of(half) == {"head_copy": True, "packed": False, "numpy_one_row": False}
    assert "avx2" in cpuinfo("flags").split(), f"no avx2 among this CPU's flags: {cpuinfo('flags')!r}"


IDLE_CPU = """
import sys, time, resource
for name in sys.argv[1:]:
    __import__(name)
import numpy, threadpoolctl
from minillm.device import openblas_threads_sleep
threadpoolctl.threadpool_limits(2, user_api="blas")
a = numpy.ones((4096, 768), numpy.float32)
for _ in range(20):
    a @ numpy.ones(768, numpy.float32)          # big enough for OpenBLAS to use both threads
cpu = lambda: resource.getrusage(resource.RUSAGE_SELF)
before = cpu()
time.sleep(0.1)
after = cpu()
print(openblas_threads_sleep(), after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""


def test_importing_minillm_before_numpy_makes_openblas_threads_sleep_and_only_then_is_numpy_chosen():
    """OpenBLAS's idle threads spin ~0.1 s after each product by default, on the core torch's next kernel needs
    (a batch-4 step took 2× as long after a one-row product). Importing minillm first sets its timeout to the
    least: in the 0.1 s after a product the process then burns almost no CPU, where numpy imported first (the
    control, so that this test can fail) burns most of a core and the loader keeps torch's BLAS. Needs 2 CPUs,
    for OpenBLAS to start a second thread."""
    import os
    import subprocess
    import sys
    assert len(os.sched_getaffinity(0)) >= 2, "this test needs 2 CPUs: OpenBLAS starts no thread on one"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS")}
    runs = {}
    for first in ("minillm", "numpy"):
        out = subprocess.run([sys.executable, "-c", IDLE_CPU, first], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        sleeps, idle_cpu = out.stdout.split()
        runs[first] = (sleeps == "True", float(idle_cpu))
    assert runs["minillm"][0] and not runs["numpy"][0], runs
    assert runs["minillm"][1] < 0.03 and runs["numpy"][1] > 0.05, f"CPU seconds in 0.1 s idle: {runs}"


def test_set_num_threads_sizes_torch_and_numpys_blas_together():
    """A one-row product may run on numpy's BLAS, which keeps a thread pool of its own: counting free cores must
    size both, or OpenBLAS's threads fight torch's (and another process's) for the cores."""
    import threadpoolctl
    from minillm.device import set_num_threads
    blas_threads = lambda: [lib["num_threads"] for lib in threadpoolctl.threadpool_info()  # noqa: E731
                            if lib["user_api"] == "blas"]
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            set_num_threads(n)
            assert torch.get_num_threads() == n and blas_threads() and set(blas_threads()) == {n}
    finally:
        set_num_threads(before)


def test_a_deep_copy_of_a_packed_model_makes_its_own_copies_from_its_own_weights():
    import copy
    model = choose_layout(context_model())
    twin = copy.deepcopy(model)   # oneDNN's opaque copies have no storage to copy: the twin clones them whole
    assert twin.lm_head.packed is not model.lm_head.packed and twin.h[0].attn.c_attn.packed is not None
    x = ids(2, 9)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), model(x), atol=0, rtol=0)
        twin.h[0].mlp.c_fc.weight.mul_(2)
        lay_out(twin, packed=True)   # the twin's weights changed: its copies follow once made again
        assert not torch.allclose(twin(x), model(x), atol=1e-3)
        torch.testing.assert_close(model(x), context_model()(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-2), (torch.bfloat16, 5e-2)])
def test_half_precision_runs_and_agrees(model, dtype, tol):
    x = ids(1, 16)
    half = context_model().to(dtype)
    with torch.no_grad():
        ref, got = model(x), half(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().softmax(-1), ref.softmax(-1), atol=tol, rtol=0)


def test_a_new_cache_plugs_in_without_touching_the_model(model):
    """The seam: any object with attend(layer, q, k, v) can be the cache."""
    class Recording:
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def attend(self, layer, q, k, v):
            self.calls.append((layer, tuple(q.shape)))
            return self.inner.attend(layer, q, k, v)

    inner, x = KVCache(CFG, 2, 5), ids(2, 5)
    cache = Recording(inner)
    with torch.no_grad():
        meta = inner.prepare([Segment(0, 0, 5), Segment(1, 0, 5)])
        torch.testing.assert_close(model(x, meta.positions, cache=cache), model(x))
    H, D = CFG.n_head, CFG.head_dim
    assert cache.calls == [(0, (2, H, 5, D)), (1, (2, H, 5, D))]


def test_seeded_init_is_reproducible():
    a, b, c = GPT2(CFG, seed=1), GPT2(CFG, seed=1), GPT2(CFG, seed=2)
    assert torch.equal(a.h[0].attn.c_attn.weight, b.h[0].attn.c_attn.weight)
    assert not torch.equal(a.h[0].attn.c_attn.weight, c.h[0].attn.c_attn.weight)


# ---- sampling ------------------------------------------------------------------

def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    assert torch.isinf(apply_top_k(logits, 2)).tolist() == [[True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    kept = ~torch.isinf(apply_top_p(logits, 0.7))
    assert kept.tolist() == [[False, True, False, True]]  # 0.5 + 0.25 ≥ 0.7
    assert (~torch.isinf(apply_top_p(logits, 0.01))).sum() == 1  # the top token always survives


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    gen = lambda: [torch.Generator().manual_seed(7) for _ in range(4)]  # noqa: E731
    assert sample(logits, [sp] * 4, gen()) == sample(logits, [sp] * 4, gen())
    assert sample(logits, [SamplingParams(temperature=0)] * 4) == logits.argmax(-1).tolist()


def test_sample_needs_one_generator_per_row():
    sp = SamplingParams(temperature=1.0, seed=1)
    with pytest.raises(ValueError, match="2 SamplingParams but 1 generators"):
        sample(torch.zeros(2, 5), [sp, sp], [torch.Generator().manual_seed(1)])


def test_finish_reasons():
    sp = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert finish_reason(9, 1, 10, sp, eos_token_id=5, n_ctx=100) == "stop"
    assert finish_reason(5, 1, 10, sp, eos_token_id=5, n_ctx=100) == "stop"
    assert finish_reason(5, 1, 10, SamplingParams(ignore_eos=True), eos_token_id=5, n_ctx=100) is None
    assert finish_reason(1, 3, 10, sp, eos_token_id=5, n_ctx=100) == "length"
    assert finish_reason(1, 1, 100, sp, eos_token_id=5, n_ctx=100) is None  # its last token fits position 99
    assert finish_reason(1, 1, 101, sp, eos_token_id=5, n_ctx=100) == "length"  # the next would need position 100


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-1), "temperature=-1 must be 0"), (dict(top_p=0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k=-2 must be ≥ -1"), (dict(max_tokens=0), "max_tokens=0 must be ≥ 1"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
    (dict(temperature=1e-45), "temperature=1e-45 must be 0 .greedy. or at least 0.01"),
    (dict(temperature="hot"), "temperature='hot' is a str; it must be a number"),
    (dict(top_k=2.5), "top_k=2.5 is a float; it must be an integer"),
    (dict(top_p=float("inf")), "top_p=inf must be a finite number"),
    (dict(max_tokens=True), "max_tokens=True is a bool"),
    (dict(stop_token_ids=5), r"stop_token_ids=5 must be a list of token ids, e.g. \[5\]"),
    (dict(stop_token_ids="5"), "stop_token_ids='5' must be a list"),
    (dict(stop_token_ids=[1, -2]), "a stop token id=-2 must be ≥ 0"),
    (dict(seed="abc"), "seed='abc' is a str; it must be an integer, or None for an unseeded request"),
    (dict(seed=2**64), "seed=18446744073709551616 must be in"),
    (dict(ignore_eos="yes"), "ignore_eos='yes' must be True or False"),
])
def test_bad_sampling_params_are_refused_when_made(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


@pytest.mark.parametrize("bad, match", [
    (dict(n_head=0), "n_head=0 must be"), (dict(n_embd=64.0), "n_embd=64.0 is a float"),
    (dict(layer_norm_epsilon=-1), "layer_norm_epsilon=-1 must be in"),
    (dict(n_embd=100), "n_embd=100 is not divisible by n_head=12")])
def test_a_config_made_in_code_is_checked_too(bad, match):
    with pytest.raises(ValueError, match=match):
        GPT2Config(**bad)


def test_sampling_params_are_frozen_and_normalised():
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), seed=torch.tensor(3), stop_token_ids=[7, 9])
    assert (type(sp.temperature), type(sp.top_k), type(sp.seed), sp.stop_token_ids) == (float, int, int, (7, 9))
    with pytest.raises(AttributeError):
        sp.temperature = 0.0


def test_sample_refuses_rows_that_are_not_finite():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7], logits[3, 0] = float("nan"), float("inf")
    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2)):
        with pytest.raises(NonFiniteLogitsError, match="layer_norm_epsilon") as e:
            sample(logits, [sp] * 4, [torch.Generator().manual_seed(2) for _ in range(4)])
        assert e.value.rows == [1, 3]
    with pytest.raises(NonFiniteLogitsError):
        sample(logits[1:2].bfloat16(), [SamplingParams(temperature=0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_on_cuda_refuses_rows_that_are_not_finite():
    logits = torch.randn(4, 50, device="cuda")
    logits[2, 7] = float("inf")
    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, seed=2)):
        with pytest.raises(NonFiniteLogitsError) as e:
            sample(logits, [sp] * 4, [torch.Generator("cuda").manual_seed(2) for _ in range(4)])
        assert e.value.rows == [2]
    assert sample(logits[:2], [SamplingParams(temperature=0)] * 2) == logits[:2].argmax(-1).tolist()


def test_the_finite_check_changes_no_finite_row():
    """Greedy is the argmax, and a seeded draw is the same draw with or without a bad row beside it."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3
    assert sample(logits, [SamplingParams(temperature=0)] * 3) == logits.argmax(-1).tolist()
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=5)
    got = sample(logits, [sp] * 3, [torch.Generator().manual_seed(5 + i) for i in range(3)])
    alone = [sample(logits[i:i + 1], [sp], [torch.Generator().manual_seed(5 + i)])[0] for i in range(3)]
    assert got == alone


# ---- naive decode and the KV cache ----------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_greedy_naive_decode_is_deterministic(model):
    assert naive_decode.generate(model, [1, 2, 3], GREEDY) == naive_decode.generate(model, [1, 2, 3], GREEDY)


def test_kv_cache_matches_naive_decode_for_many_prompts_and_a_batch(model):
    prompts = [ids(n, seed=n)[:].tolist() for n in (1, 2, 7, 16, 33, 50)]
    naive = [naive_decode.generate(model, p, GREEDY) for p in prompts]
    for p, want in zip(prompts, naive):
        assert kv_cache.generate(model, [p], GREEDY) == [want]
    assert kv_cache.generate(model, prompts, GREEDY) == naive  # ragged batch
    same_len = [ids(12, seed=s).tolist() for s in range(3)]
    assert kv_cache.generate(model, same_len, GREEDY) == [naive_decode.generate(model, p, GREEDY) for p in same_len]


def test_kv_cache_logits_agree_with_full_recompute(model):
    x = ids(2, 24, seed=3)
    cache = KVCache(CFG, 2, 24)
    with torch.no_grad():
        full = model(x)
        steps = [model(x[:, :10], cache.prepare([Segment(0, 0, 10), Segment(1, 0, 10)]).positions, cache=cache)]
        for t in range(10, 24, 2):  # chunks of two after a cached prefix: queries at the end of a longer context
            meta = cache.prepare([Segment(0, t, 2), Segment(1, t, 2)])
            steps.append(model(x[:, t:t + 2], meta.positions, cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_ragged_rows_in_one_contiguous_step_agree_with_full_recompute(model):
    """Rows at different lengths in one pass: each row's mask hides the slots past its own length."""
    x = ids(3, 20, seed=4)
    cache = KVCache(CFG, 3, 20)
    with torch.no_grad():
        full = model(x)
        for row, n in enumerate((5, 11, 17)):
            cache.prepare([Segment(row, 0, n)])
            model(x[row:row + 1, :n], cache.metadata.positions, cache=cache)
        meta = cache.prepare([Segment(2, 17, 1, True), Segment(0, 5, 1, True), Segment(1, 11, 1, True)])
        step = model(torch.stack([x[2, 17:18], x[0, 5:6], x[1, 11:12]]), meta.positions, cache=cache)
    torch.testing.assert_close(step[:, 0], torch.stack([full[2, 17], full[0, 5], full[1, 11]]), atol=1e-4, rtol=1e-4)


def test_causal_attention_with_queries_at_the_end_of_the_keys():
    """Without a mask the T queries are the last T of the L keys: query t sees keys 0 .. L − T + t."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 7, 7))
    whole = causal_attention(torch.cat([torch.randn(1, 2, 4, 8, generator=g), q], dim=2), k, v)
    torch.testing.assert_close(causal_attention(q, k, v), whole[:, :, 4:])
    torch.testing.assert_close(causal_attention(q, k, v, causal_mask(torch.arange(4, 7), 7)), whole[:, :, 4:])


@pytest.mark.parametrize("B, H, T, L, D, ends", [
    (2, 3, 5, 5, 8, None),             # a prompt: T == L, the lower triangle
    (1, 4, 3, 9, 16, None),            # queries at the end of a longer context: the triangle starts at L − T
    (3, 2, 1, 7, 8, None),             # a decode step: the one query sees every key
    (3, 2, 2, 9, 8, [3, 8, 5]),        # a ragged chunk: each row's mask ends at its own last position
    (2, 2, 1, 6, 4, [2, 5]),           # a ragged decode
])
def test_the_fused_kernel_computes_attention_by_hand(B, H, T, L, D, ends):
    """causal_attention (the engine's, one fused call) and attention_by_hand (the math, scores in memory) are
    the same function: on a prompt, on queries at the end of more keys, on a decode step, and with a mask."""
    g = torch.Generator().manual_seed(B * 100 + T * 10 + L)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    mask = None if ends is None else causal_mask(torch.tensor([[e - T + 1 + t for t in range(T)] for e in ends]), L)
    torch.testing.assert_close(causal_attention(q, k, v, mask), attention_by_hand(q, k, v, mask), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("B, L, ends", [(3, 7, None), (2, 6, [2, 5]), (4, 129, [129, 40, 1, 77])])
def test_a_bf16_decode_on_the_cpu_is_written_out_and_errs_as_the_fused_kernel_does(B, L, ends, monkeypatch):
    """One query per row in bf16 on a CPU with AVX512_BF16 and no AMX (where `choose_layout` swaps
    `attention_with_decode_by_hand` in; swapped in here to take each path on every machine) goes through
    `decode_attention` (torch's fused kernel is slow there), which computes in fp32 like the fused kernel: against
    the math in fp64 on the same bf16 inputs it errs by the output's own rounding (bf16: 2⁻⁹ of a value, here of
    size ≤ 3), as the fused kernel does. Elsewhere the fused kernel computes it."""
    from minillm import cpu_layout
    from minillm.cpu_layout import bf16_decode_by_hand_pays, use_decode_attention_by_hand
    zen4, zen3, spr = "fpu avx2 avx512f avx512_bf16", "fpu avx2 fma", "avx512f avx512_bf16 amx_bf16 amx_tile"
    assert bf16_decode_by_hand_pays(zen4) and not bf16_decode_by_hand_pays(spr) and not bf16_decode_by_hand_pays(zen3)
    g = torch.Generator().manual_seed(B + L)
    q, k, v = (torch.randn(B, 12, n, 64, generator=g).bfloat16() for n in (1, L, L))
    mask = None if ends is None else causal_mask(torch.tensor(ends)[:, None] - 1, L)
    calls = []
    real = cpu_layout.decode_attention
    monkeypatch.setattr(cpu_layout, "decode_attention", lambda *a: calls.append(1) or real(*a))
    fused = causal_attention(q, k, v, mask)   # tests/conftest.py: torch's fused kernel, as model.py has it
    assert not calls
    use_decode_attention_by_hand(True)        # conftest puts model.py's kernel back after the test
    got = causal_attention(q, k, v, mask)
    assert calls
    calls.clear()
    causal_attention(q.expand(B, 12, 2, 64), k, v)  # several queries per row: the fused kernel's
    assert not calls
    exact = attention_by_hand(q.double(), k.double(), v.double(), mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, atol=8e-3, rtol=0)
    assert (got.double() - exact).abs().max() <= (fused.double() - exact).abs().max() + 1e-3


def test_decode_attention_refuses_an_additive_mask():
    """The caches build boolean masks (True: seen); an additive float mask, which the fused kernel also takes,
    would be read the other way round by `~mask`, so decode_attention names what it takes instead."""
    q, k = torch.ones(1, 1, 1, 4), torch.ones(1, 1, 3, 4)
    with pytest.raises(TypeError, match="boolean mask .* not torch.float32"):
        decode_attention(q, k, k, torch.zeros(1, 1, 1, 3))


def test_decode_attention_refuses_more_than_one_query_per_row():
    """It applies no causal triangle: given T > 1 queries per row it would let each see every key, later ones
    included, so it names the shape it got and the function that takes several queries instead."""
    q, k = torch.ones(2, 1, 3, 4), torch.ones(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"one query per row, q of shape \(B, H, 1, D\), not \(2, 1, 3, 4\); "
                                         r"use model.causal_attention"):
        decode_attention(q, k, k)


def test_seeded_generation_is_reproducible(model):
    sp = SamplingParams(temperature=0.8, top_k=40, max_tokens=15, seed=3, ignore_eos=True)
    assert naive_decode.generate(model, [4, 5], sp) == naive_decode.generate(model, [4, 5], sp)
    assert kv_cache.generate(model, [[4, 5]], sp) == kv_cache.generate(model, [[4, 5]], sp)


def test_kv_cache_accounts_its_bytes_and_refuses_overflow():
    cache = KVCache(CFG, 2, 64)
    assert cache.nbytes == 2 * 64 * CFG.kv_bytes_per_token(torch.float32)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        cache.prepare([Segment(0, 60, 5)])
    with pytest.raises(ValueError, match="same number of tokens to every row"):
        cache.prepare([Segment(0, 0, 5), Segment(1, 0, 4)])
    with pytest.raises(ValueError, match="exceeds the model's context n_ctx=128"):
        KVCache(CFG, 1, 129)
