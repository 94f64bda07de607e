"""weights.py: where a model comes from (folder, downloaded preset, random init), on which device, in which dtype."""
from __future__ import annotations

from pathlib import Path

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm import PRESETS, GPT2
from minillm.checkpoints import load as weights
from minillm.config import HF_CHECKPOINTS
from minillm.checkpoints.tokenizer import load_tokenizer
from minillm.checkpoints.load import (CheckpointError, config_from_hf, default_weights_dir, load_model, random_model,
                             resolve_device, resolve_dtype, save_pretrained)

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---- device and dtype -------------------------------------------------------

def test_auto_device_is_cuda_when_available_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want and resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")


def test_bad_device_names_the_value():
    with pytest.raises(ValueError, match="'tpu7'"):
        resolve_device("tpu7")


def test_cuda_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same path on a machine with CUDA
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.parametrize("name, want", [("fp32", torch.float32), ("float32", torch.float32),
                                        ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
                                        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16)])
def test_dtype_names(name, want):
    assert resolve_dtype(name, "cpu") == want


def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(ValueError, match=r"'int3'.*bf16"):
        resolve_dtype("int3", "cpu")


# ---- random init -------------------------------------------------------------

def test_random_model_is_gpt2_init_built_in_place():
    config = PRESETS["tiny"]
    model = random_model(config, "cpu", "fp32", seed=5)
    reference = GPT2(config, seed=5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name
    assert model.weights_source == "random-init (seed 5)" and not model.training


def test_loading_draws_nothing_on_the_meta_device():
    """The loader builds the model on the meta device; a draw there (nn.Embedding's own init did one) imports
    torch's compiler, 2 s of every process that loads a model. A fresh interpreter shows whether it was imported."""
    import subprocess
    import sys
    code = ("import sys, torch; from minillm.checkpoints.load import random_model; from minillm import PRESETS\n"
            "random_model(PRESETS['tiny'], 'cpu'); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "building or loading the model imported torch._dynamo: a draw on meta?"


def test_random_model_seeds_differ_and_dtype_is_cast_from_the_same_values():
    config = PRESETS["tiny"]
    a, b = random_model(config, "cpu", "fp32", seed=0), random_model(config, "cpu", "fp32", seed=1)
    assert not torch.equal(a.wte.weight, b.wte.weight)
    half = random_model(config, "cpu", "bf16", seed=0)
    assert half.dtype == torch.bfloat16 and torch.equal(half.wte.weight, a.wte.weight.to(torch.bfloat16))


# ---- load_model: by path, by preset, or random -------------------------------

def test_load_by_path_and_by_preset_name(tmp_path):
    model = random_model(PRESETS["tiny"], "cpu", "fp32", seed=2)
    save_pretrained(model, tmp_path / "tiny")
    ids = torch.randint(0, 512, (1, 9))
    by_path = load_model(tmp_path / "tiny", "cpu", "fp32")
    by_name = load_model("tiny", "cpu", "fp32", weights_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(by_path(ids), model(ids)) and torch.equal(by_name(ids), model(ids))
    assert by_name.weights_source == str(tmp_path / "tiny") and not by_name.training


def test_absent_checkpoint_falls_back_to_random_init_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(PRESETS, "gpt2", PRESETS["tiny"])  # the gpt2 code path, at a tiny cost
    model = load_model("gpt2", "cpu", "fp32", weights_dir=tmp_path, seed=4)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RANDOM" in err and str(tmp_path / "gpt2") in err
    assert "python weights_download.py gpt2" in err and "timing and memory hold" in err
    assert model.weights_source == "random-init (seed 4)" and model.config == PRESETS["tiny"]


def test_an_incomplete_preset_folder_is_absent_one_line_for_model_and_tokenizer(tmp_path, monkeypatch, capsys):
    """An interrupted download (config.json there, the weights still a .part) must not break every later run."""
    monkeypatch.setitem(PRESETS, "gpt2", PRESETS["tiny"])
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # not even read: the folder is not a checkpoint
    (folder / "model.safetensors.part").write_bytes(b"half")
    model = load_model("gpt2", "cpu", "fp32", weights_dir=tmp_path)
    tok = load_tokenizer("gpt2", weights_dir=tmp_path)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and str(folder) in lines[0] and "model.safetensors, tokenizer.json" in lines[0]
    assert model.weights_source.startswith("random-init") and tok.is_fallback


def test_made_up_shapes_init_randomly_without_a_warning(tmp_path, capsys):
    model = load_model("mini", "cpu", "fp32", weights_dir=tmp_path)
    assert model.config == PRESETS["mini"] and capsys.readouterr().err == ""


def test_an_explicit_incomplete_folder_lists_what_is_missing_and_what_to_do(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.part").write_bytes(b"half")
    with pytest.raises(CheckpointError) as e:
        load_model(folder, "cpu")
    msg = str(e.value)
    assert "missing model.safetensors" in msg and "python weights_download.py gpt2" in msg and "resume" in msg


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'.*gpt2-medium"):
        load_model("gpt5", "cpu")


def test_a_path_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(ValueError, match="there is no folder"):
        load_model(str(tmp_path / "nothing"), "cpu")


def test_weights_dir_is_the_repo_one_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("MINILLM_WEIGHTS_DIR", raising=False)
    assert default_weights_dir() == REPO_ROOT / "weights"
    monkeypatch.setenv("MINILLM_WEIGHTS_DIR", str(tmp_path))
    assert default_weights_dir() == tmp_path
    assert weights.locate("gpt2") == (tmp_path / "gpt2", "gpt2")


def test_saved_config_round_trips(tmp_path):
    config = PRESETS["mini"].with_(layer_norm_epsilon=1e-6)
    save_pretrained(random_model(config, "cpu"), tmp_path)
    assert load_model(tmp_path, "cpu").config == config


# ---- what the loader refuses: weights that are not floating point, fields the model does not compute ----

@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_a_non_floating_weight_is_refused_naming_tensor_and_dtype(tmp_path, dtype):
    save_pretrained(random_model(PRESETS["tiny"], "cpu"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["h.1.mlp.c_fc.weight"] = tensors["h.1.mlp.c_fc.weight"].to(dtype)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"h\.1\.mlp\.c_fc\.weight holds (I64|BOOL|C64|U8) values.*floating"):
        load_model(tmp_path, "cpu")


@pytest.mark.parametrize("field, value", [("activation_function", "relu"), ("scale_attn_weights", False),
                                          ("model_type", "gpt_neo"), ("tie_word_embeddings", False),
                                          ("scale_attn_by_inverse_layer_idx", True), ("n_inner", 100)])
def test_a_config_field_the_model_does_not_implement_is_refused(tmp_path, field, value):
    save_pretrained(random_model(PRESETS["tiny"], "cpu"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=f"{field}={value!r} is not implemented"):
        load_model(tmp_path, "cpu")


def test_a_deeply_nested_config_json_is_a_clear_error(tmp_path):
    save_pretrained(random_model(PRESETS["tiny"], "cpu"), tmp_path)
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nests its JSON deeper"):
        load_model(tmp_path, "cpu")


def test_distilgpt2_is_a_checkpoint_with_gpt2s_vocabulary():
    """The hub's distilbert/distilgpt2 config.json (its shape fields, as published) reads as the preset."""
    hub_config = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "bos_token_id": 50256,
                  "eos_token_id": 50256, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024,
                  "n_embd": 768, "n_head": 12, "n_layer": 6, "n_positions": 1024, "vocab_size": 50257}
    assert "distilgpt2" in HF_CHECKPOINTS and config_from_hf(hub_config) == PRESETS["distilgpt2"]
    assert PRESETS["distilgpt2"].num_params() == 81_912_576  # gpt2's 124.4M less six of its blocks
    assert PRESETS["distilgpt2"].vocab_size == PRESETS["gpt2"].vocab_size
