"""A Hugging Face GPT-2 checkpoint: its files, its config.json, and the tensors it must hold.

What a checkpoint is
--------------------
A Hugging Face GPT-2 checkpoint is a folder with `config.json` (the five
shape numbers) and `model.safetensors` (a JSON header naming every tensor, its
dtype, shape and byte range, then the raw bytes). Our module names and layouts
are the checkpoint's, so loading is reading tensors by name:

    wte.weight, wpe.weight, h.{i}.ln_1.*, h.{i}.attn.c_attn.*, h.{i}.attn.c_proj.*,
    h.{i}.ln_2.*, h.{i}.mlp.c_fc.*, h.{i}.mlp.c_proj.*, ln_f.*

Layout variants that all load:
    - every key prefixed with `transformer.` (what GPT2LMHeadModel writes);
    - `lm_head.weight` present: the head is tied to `wte`, so it must have
      wte's shape and is otherwise ignored;
    - `h.{i}.attn.bias` / `h.{i}.attn.masked_bias`: causal-mask buffers that
      old GPT-2 code saved with the weights; not parameters, ignored.

The four projections are stored as Conv1D, [in_features, out_features], and
the model keeps that layout (model.Conv1D says why), so nothing is transposed.

`config.json` is read by `config_from_hf` and written by `config_to_hf`. A
field the model does not implement (another `activation_function`, unscaled
attention, untied embeddings, another `model_type`) is refused, not ignored:
the model would run, and silently compute something else.

Invariants held by the tests: every key, shape and dtype of a file is checked
against the model's before any tensor is read, and a problem is a
CheckpointError naming the file, the key or field, and the value.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import EOS_TOKEN_ID, MAX_POSITIONS, MAX_VOCAB, GPT2Config, check_int
from ..model import GPT2

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
TOKENIZER_FILE = "tokenizer.json"
_FLOATING = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # safetensors' names for floating dtypes
# The fields of a GPT-2 config.json that change what the model computes, and the one value this model implements.
_IMPLEMENTED = {"model_type": "gpt2", "activation_function": "gelu_new", "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True, "add_cross_attention": False}

_PREFIX = "transformer."
_MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot become a model; the message says what to fix."""


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this shape must hold, in checkpoint layout (Conv1D = [in, out])."""
    with torch.device("meta"):
        model = GPT2(config, seed=None)
    shapes = {}
    for name, p in model.state_dict().items():
        shapes[name] = tuple(p.shape)
    return shapes


def config_from_hf(d: dict) -> GPT2Config:
    """Read a Hugging Face GPT-2 `config.json` (its keys are n_layer, n_head, n_embd, n_positions, ...).

    Every field is checked (type, range, n_embd divisible by n_head), and so is every field in _IMPLEMENTED
    that is present; a ValueError names the field and the value.
    """
    if not isinstance(d, dict):
        raise ValueError(f"the top level is a JSON {type(d).__name__}, not an object with fields such as n_layer")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k not in d]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}; a GPT-2 config.json has n_layer, n_head, "
                         "n_embd, n_positions and vocab_size")
    for field, want in _IMPLEMENTED.items():
        if field in d and d[field] != want:
            raise ValueError(f"{field}={d[field]!r} is not implemented: minillm's GPT-2 computes only "
                             f"{field}={want!r}, so this checkpoint would run and give wrong logits")
    ctx_key = "n_positions" if "n_positions" in d else "n_ctx"
    n_ctx = check_int(ctx_key, d.get(ctx_key, 1024), 1, MAX_POSITIONS + 1)
    vocab_size = check_int("vocab_size", d["vocab_size"], 1, MAX_VOCAB + 1)
    config = GPT2Config(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], n_ctx=n_ctx,
                        vocab_size=vocab_size, layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
                        eos_token_id=d.get("eos_token_id", EOS_TOKEN_ID if vocab_size > EOS_TOKEN_ID else None))
    if d.get("n_inner") not in (None, 4 * config.n_embd):
        raise ValueError(f"n_inner={d['n_inner']!r} is not implemented: minillm's MLP is 4 · n_embd = "
                         f"{4 * config.n_embd} wide (n_inner null)")
    return config


def config_to_hf(config: GPT2Config) -> dict:
    """The `config.json` another GPT-2 tool (transformers' GPT2Config) expects for these shapes."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
            "n_positions": config.n_ctx, "n_ctx": config.n_ctx, "vocab_size": config.vocab_size,
            "layer_norm_epsilon": config.layer_norm_epsilon, "activation_function": "gelu_new",
            "bos_token_id": config.eos_token_id, "eos_token_id": config.eos_token_id,
            "n_inner": None, "scale_attn_weights": True, "tie_word_embeddings": True}


def read_config(folder: Path) -> GPT2Config:
    """The config.json of a checkpoint folder, every field checked; a CheckpointError names the file and field."""
    path = folder / CONFIG_FILE
    fix = "re-download it or rewrite it with save_pretrained"
    try:
        return config_from_hf(json.loads(path.read_text(encoding="utf-8")))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                              f"{fix}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {fix}") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests its JSON deeper than the parser can follow, which no GPT-2 "
                              f"config.json does; {fix}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def plan_tensors(file_keys: list[str], file_shapes: dict[str, tuple], config: GPT2Config, path: Path,
          file_dtypes: dict[str, str]) -> dict[str, str]:
    """Match the file's keys to the model's parameters, or raise naming every problem.

    Returns {model parameter name: key in the file}. Runs before any tensor is read.
    """
    expected = expected_shapes(config)
    plan: dict[str, str] = {}
    unexpected = []
    for key in file_keys:
        name = key.removeprefix(_PREFIX)
        if _MASK_BUFFER.match(name):
            continue
        if name == "lm_head.weight":  # tied to wte: same matrix, so it only has to fit
            if file_shapes[key] != expected["wte.weight"]:
                raise CheckpointError(f"{path}: {key} must be tied to wte.weight and have its shape "
                                      f"{expected['wte.weight']}, but has {file_shapes[key]}")
            continue
        if name not in expected:
            unexpected.append(key)
            continue
        if name in plan:
            raise CheckpointError(f"{path}: {plan[name]!r} and {key!r} both hold {name}")
        if file_shapes[key] != expected[name]:
            layout = " (Conv1D layout [in, out])" if _CONV1D.match(name) else ""
            raise CheckpointError(f"{path}: {key} has shape {file_shapes[key]} but a model with "
                                  f"n_layer={config.n_layer}, n_embd={config.n_embd}, n_ctx={config.n_ctx}, "
                                  f"vocab_size={config.vocab_size} expects {expected[name]}{layout}; "
                                  "does config.json belong to this model.safetensors?")
        if file_dtypes[key] not in _FLOATING:  # cast to float, an integer or bool tensor would run as weights
            raise CheckpointError(f"{path}: {key} holds {file_dtypes[key]} values, but a weight must be floating "
                                  f"point ({', '.join(_FLOATING)}); is this a GPT-2 checkpoint?")
        plan[name] = key
    if unexpected:
        raise CheckpointError(f"{path}: unexpected keys {', '.join(unexpected[:8])}"
                              f"{' …' if len(unexpected) > 8 else ''} for a {config.n_layer}-layer GPT-2; "
                              "is this a GPT-2 checkpoint, and does config.json match it?")
    missing = [n for n in expected if n not in plan]
    if missing:
        raise CheckpointError(f"{path}: missing keys {', '.join(f'{n} (expected shape {expected[n]})' for n in missing[:8])}"
                              f"{' …' if len(missing) > 8 else ''}; the file is incomplete or for another model")
    return plan
