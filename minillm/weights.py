"""Weights: the official GPT-2 checkpoints in, a ready model out, or a seeded random one.

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

What it costs
-------------
    weight bytes = num_params · bytes per element
    gpt2: 124M params → 498 MB fp32, 249 MB bf16;   gpt2-xl: 1.56B → 6.2 GB fp32, 3.1 GB bf16

The model is built on the meta device (shapes, no memory), and each tensor is
read from the file, cast and placed on the target device one at a time, so
loading gpt2-xl to a GPU in bf16 never holds a full fp32 copy anywhere.

Invariants held by the tests
----------------------------
    - logits match transformers' GPT2LMHeadModel on the same weights (≤ 1e-4, fp32);
    - save → load gives identical logits, and GPT2LMHeadModel reads what we save;
    - a missing, unexpected, misshapen or non-floating tensor, a truncated file,
      a config.json field the model does not implement or an explicit folder
      with missing files raises a CheckpointError naming it; no half-loaded
      model is ever returned, because every key, shape and dtype is checked
      before any tensor is read;
    - a preset whose folder lacks a file (an interrupted or failed download) is
      treated as absent: one warning line names the folder and the missing
      files, and the seeded random init is used.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import EOS_TOKEN_ID, HF_CHECKPOINTS, MAX_POSITIONS, MAX_VOCAB, PRESETS, GPT2Config, check_int
from .model import GPT2

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

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot become a model; the message says what to fix."""


# ---- where, and in what precision -------------------------------------------

def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" or None → CUDA when available, else CPU; anything else as torch spells it."""
    if isinstance(name, torch.device):
        return name
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # meta, mps, xla, ...: not devices minillm runs on
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use 'cpu' or 'auto'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" or None → bf16 on CUDA (half the bytes, fp32's range), fp32 on CPU
    (where half-precision matmuls are slow or emulated)."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


def default_weights_dir() -> Path:
    """$MINILLM_WEIGHTS_DIR if set; else `weights/` beside weights_download.py when
    running from a checkout (so lessons find it from any directory); else ./weights."""
    env = os.environ.get("MINILLM_WEIGHTS_DIR")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "weights_download.py").exists():
        return repo_root / "weights"
    return Path("weights")


def download_command(name: str) -> str:
    return f"python weights_download.py {name}"


# ---- reading a checkpoint ---------------------------------------------------

def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this shape must hold, in checkpoint layout (Conv1D = [in, out])."""
    with torch.device("meta"):
        model = GPT2(config, seed=None)
    shapes = {}
    for name, p in model.state_dict().items():
        shapes[name] = tuple(p.shape)
    return shapes


def check_folder(folder: Path, name: str | None = None) -> None:
    """Raise a CheckpointError listing the files a checkpoint folder lacks."""
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        fix = (f"download them with `{download_command(name)}`" if name in HF_CHECKPOINTS
               else "point at a folder written by save_pretrained or by a GPT-2 tool")
        partial = [p.name for p in folder.glob("*.part")]
        resume = f" (an interrupted download is there: {', '.join(partial)}; rerun to resume)" if partial else ""
        raise CheckpointError(f"the weights folder {folder} is missing {', '.join(missing)}{resume}; {fix}")


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


def _plan(file_keys: list[str], file_shapes: dict[str, tuple], config: GPT2Config, path: Path,
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


def _open(path: Path, device: torch.device):
    # safetensors wants an explicit CUDA index to place tensors straight on the GPU.
    where = str(device)
    if device.type == "cuda" and device.index is None:
        where = f"cuda:{torch.cuda.current_device()}"
    try:
        return safe_open(str(path), framework="pt", device=where)
    except Exception as e:  # safetensors raises its own error type for bad headers and short files
        raise CheckpointError(f"{path} is truncated or corrupt ({e}); delete it and re-download with "
                              f"`{download_command(path.parent.name if path.parent.name in HF_CHECKPOINTS else '<name>')}`") from e


def load_checkpoint(folder: str | Path, device: str | torch.device = "auto",
                    dtype: str | torch.dtype = "auto") -> GPT2:
    """Load a GPT-2 checkpoint folder onto `device` in `dtype`, or raise a CheckpointError."""
    folder = Path(folder)
    check_folder(folder, folder.name)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = read_config(folder)
    path = folder / WEIGHTS_FILE
    with _open(path, device) as f:
        keys = list(f.keys())
        slices = {k: f.get_slice(k) for k in keys}
        plan = _plan(keys, {k: tuple(s.get_shape()) for k, s in slices.items()}, config, path,
                     {k: s.get_dtype() for k, s in slices.items()})
        state = {}
        for name, key in plan.items():
            try:
                t = f.get_tensor(key)
            except Exception as e:
                raise CheckpointError(f"{path}: could not read {key} ({e}); the file is corrupt, "
                                      "delete it and re-download") from e
            # copy=True: on CPU safetensors hands back views of the memory-mapped file,
            # which would crash the model if the file were later truncated or rewritten.
            t = t.to(device=device, dtype=dtype, copy=True)
            state[name] = t
    with torch.device("meta"):
        model = GPT2(config, seed=None)
    model.load_state_dict(state, strict=True, assign=True)
    model.weights_source = str(folder)
    return model.eval()


def random_model(config: GPT2Config, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", seed: int = 0) -> GPT2:
    """GPT-2's seeded init, built straight on `device` in `dtype`.

    Same values as `GPT2(config, seed).to(device, dtype)`: the init draws every
    tensor from one CPU generator in fp32 and casts it into place.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = GPT2(config, seed=None)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(seed)
    model.weights_source = f"random-init (seed {seed})"
    return model.eval()


def save_pretrained(model: GPT2, folder: str | Path) -> Path:
    """Write `model.safetensors` + `config.json` in the official GPT-2 layout.

    Keys carry no prefix, projections are Conv1D [in, out], the tied head is not
    written: the layout of openai-community/gpt2, which transformers'
    GPT2LMHeadModel.from_pretrained and our loader both read.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.state_dict().items():
        tensors[name] = p.detach().to("cpu").contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    return folder


# ---- one call for the lessons -----------------------------------------------

def missing_files(folder: Path) -> list[str]:
    """The files of a full checkpoint (config, weights, tokenizer) that `folder` lacks; all of them if no folder."""
    return [f for f in (*REQUIRED_FILES, TOKENIZER_FILE) if not (folder / f).is_file()]


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds what load_checkpoint needs; a failed or interrupted download does not."""
    return not any(f in REQUIRED_FILES for f in missing_files(folder))


_warned: set[Path] = set()


def warn_once(folder: Path, message: str) -> None:
    """One warning line per folder per process, on stderr: the model and the tokenizer share it."""
    if folder not in _warned:
        _warned.add(folder)
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def warn_absent(preset: str, folder: Path) -> None:
    """The line for a preset run on a random init; silent for the made-up shapes, which have no files to miss."""
    if preset not in HF_CHECKPOINTS and not folder.is_dir():
        return
    missing = missing_files(folder)
    where = f"{folder} lacks {', '.join(missing)}" if folder.is_dir() else f"no weights in {folder}"
    tokenizer = " and the byte fallback tokenizer" if TOKENIZER_FILE in missing else ""
    fetch = f"; `{download_command(preset)}` fetches them" if preset in HF_CHECKPOINTS else ""
    warn_once(folder, f"{where}, so {preset} runs on a RANDOM init of its shape{tokenizer}: timing and memory "
                      f"hold, the text is gibberish{fetch}")


def locate(name_or_path: str | Path, weights_dir: str | Path | None = None) -> tuple[Path, str | None]:
    """Where a model's files live: (folder, preset name), or (folder, None) for a plain path.

    A preset name (`gpt2`) means `<weights_dir>/gpt2/`; anything that looks like
    a path (a Path, or a string with a slash or a leading dot) is that folder.
    """
    name = str(name_or_path)
    looks_like_path = isinstance(name_or_path, Path) or "/" in name or os.sep in name or name.startswith(".")
    if name in PRESETS and not looks_like_path:
        root = Path(weights_dir) if weights_dir is not None else default_weights_dir()
        return root / name, name
    path = Path(name_or_path)
    if not path.is_dir():
        hint = f"there is no folder {path}; " if looks_like_path else ""
        raise ValueError(f"{hint}unknown model {name!r}: give a preset ({', '.join(PRESETS)}) "
                         "or the path to a checkpoint folder (e.g. weights/gpt2)")
    return path, None


def load_model(name_or_path: str | Path, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", weights_dir: str | Path | None = None,
               seed: int = 0) -> GPT2:
    """A GPT-2 in eval mode, from a checkpoint folder, a downloaded preset, or a random init.

    - a path to a folder: load that checkpoint;
    - a preset name: load `<weights_dir>/<name>/` if it holds a complete
      checkpoint; if not, fall back to a seeded random init of that shape, with
      one warning line (none for `tiny` and `mini` without a folder: they have
      no real weights to miss).
    `weights_dir` defaults to `default_weights_dir()`. The model's
    `weights_source` says where its values came from, for lessons to record.
    """
    folder, preset = locate(name_or_path, weights_dir)
    if preset is None or is_complete(folder):
        return load_checkpoint(folder, device, dtype)  # an explicit folder that is incomplete: an error saying why
    warn_absent(preset, folder)
    return random_model(PRESETS[preset], device, dtype, seed)


__all__ = ["CheckpointError", "resolve_device", "resolve_dtype", "default_weights_dir", "load_checkpoint",
           "random_model", "save_pretrained", "load_model", "locate", "expected_shapes", "download_command",
           "config_from_hf", "config_to_hf", "is_complete", "missing_files", "warn_absent", "warn_once"]
