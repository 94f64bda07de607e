"""Our GPT-2 against the ecosystem's reference (transformers' GPT2LMHeadModel), and the checkpoint layouts.

Same random weights in both, logits within fp32 rounding (≤ 1e-4). The
weights travel through files in both directions: what transformers saves we
load, and what we save transformers loads. Then every key-layout variant of
the GPT-2 checkpoints, and every way a checkpoint can be broken.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from minillm import PRESETS, GPT2
from minillm.checkpoints.load import CheckpointError, config_to_hf, load_checkpoint, random_model, save_pretrained

import transformers  # noqa: E402
TOL = 1e-4  # fp32


def hf_model(config, seed=0):
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(**config_to_hf(config))
    return transformers.GPT2LMHeadModel(hf_config).eval()


def batch(config, B=2, T=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, T), generator=g)


@torch.no_grad()
def max_diff(ours, hf, ids):
    return (ours(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_logits_match_the_reference_on_weights_it_saved(preset, tmp_path):
    config = PRESETS[preset]
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)  # transformers' own layout, whatever this version writes
    ours = load_checkpoint(tmp_path, "cpu", "fp32")
    assert max_diff(ours, hf, batch(config)) <= TOL


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_the_reference_reads_what_we_save(preset, tmp_path):
    config = PRESETS[preset]
    ours = random_model(config, "cpu", "fp32", seed=3)
    save_pretrained(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert max_diff(ours, hf, batch(config, T=config.n_ctx)) <= TOL  # the whole context, all positions


@pytest.mark.slow
def test_gpt2_shape_matches_the_reference(tmp_path):
    config = PRESETS["gpt2"]
    ours = random_model(config, "cpu", "fp32", seed=0)
    save_pretrained(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert max_diff(ours, hf, batch(config, B=1, T=64)) <= TOL


def test_save_then_load_gives_identical_logits(tmp_path):
    config = PRESETS["mini"]
    model = random_model(config, "cpu", "fp32", seed=7)
    loaded = load_checkpoint(save_pretrained(model, tmp_path), "cpu", "fp32")
    ids = batch(config)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


# ---- layout variants --------------------------------------------------------

def checkpoint_tensors(model: GPT2) -> dict[str, torch.Tensor]:
    """The official layout: unprefixed keys, Conv1D projections as [in, out]."""
    return {name: p.contiguous().clone() for name, p in model.state_dict().items()}


def write(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(config)))
    return folder


def with_prefix(t):
    return {"transformer." + k: v for k, v in t.items()}


def with_lm_head(t):
    wte = t.get("wte.weight", t.get("transformer.wte.weight"))
    return {**t, "lm_head.weight": wte.clone()}


def with_mask_buffers(t, n_layer, n_ctx):
    extra = {}
    for i in range(n_layer):  # what old GPT-2 code saved beside the weights
        extra[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx)
        extra[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return {**t, **extra}


@pytest.mark.parametrize("variant", ["plain", "prefixed", "lm_head", "mask_buffers", "all"])
def test_every_key_layout_loads(variant, tmp_path):
    config = PRESETS["tiny"]
    model = random_model(config, "cpu", "fp32", seed=1)
    t = checkpoint_tensors(model)
    if variant in ("mask_buffers", "all"):
        t = with_mask_buffers(t, config.n_layer, config.n_ctx)
    if variant in ("prefixed", "all"):
        t = with_prefix(t)
    if variant in ("lm_head", "all"):
        t = with_lm_head(t)
    loaded = load_checkpoint(write(tmp_path, config, t), "cpu", "fp32")
    ids = batch(config)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loads_straight_into_a_half_dtype(dtype, tmp_path):
    model = random_model(PRESETS["tiny"], "cpu", "fp32")
    loaded = load_checkpoint(save_pretrained(model, tmp_path), "cpu", dtype)
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    assert torch.equal(loaded.h[1].mlp.c_fc.weight, model.h[1].mlp.c_fc.weight.to(dtype))


# ---- broken checkpoints -----------------------------------------------------

@pytest.fixture
def good(tmp_path):
    config = PRESETS["tiny"]
    return config, checkpoint_tensors(random_model(config, "cpu", "fp32"))


def test_missing_key_is_named_with_its_shape(good, tmp_path):
    config, t = good
    del t["h.1.mlp.c_fc.bias"]
    with pytest.raises(CheckpointError, match=r"missing keys h\.1\.mlp\.c_fc\.bias \(expected shape \(256,\)\)"):
        load_checkpoint(write(tmp_path, config, t), "cpu")


def test_unexpected_key_is_named(good, tmp_path):
    config, t = good
    t["h.0.attn.rotary.inv_freq"] = torch.ones(8)
    with pytest.raises(CheckpointError, match=r"unexpected keys h\.0\.attn\.rotary\.inv_freq"):
        load_checkpoint(write(tmp_path, config, t), "cpu")


def test_wrong_shape_names_the_key_and_both_shapes(good, tmp_path):
    config, t = good
    t["h.0.attn.c_attn.weight"] = t["h.0.attn.c_attn.weight"].t().contiguous()  # nn.Linear layout by mistake
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(write(tmp_path, config, t), "cpu")
    msg = str(e.value)
    assert "h.0.attn.c_attn.weight" in msg and "(192, 64)" in msg and "(64, 192)" in msg


def test_untied_lm_head_of_the_wrong_shape_is_rejected(good, tmp_path):
    config, t = good
    t["lm_head.weight"] = torch.zeros(config.vocab_size + 1, config.n_embd)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(write(tmp_path, config, t), "cpu")


def test_config_that_does_not_match_the_weights(good, tmp_path):
    config, t = good
    write(tmp_path, config, t)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config.with_(n_layer=3))))
    with pytest.raises(CheckpointError, match=r"missing keys h\.2\."):
        load_checkpoint(tmp_path, "cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_file_is_a_clear_error(damage, good, tmp_path):
    config, t = good
    folder = write(tmp_path / "gpt2", config, t)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x10\x00" + data[2:])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder, "cpu")
    assert str(path) in str(e.value) and "python weights_download.py gpt2" in str(e.value)
