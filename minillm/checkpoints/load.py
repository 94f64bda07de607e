"""Weights: the official GPT-2 checkpoints in, a ready model out, or a seeded random one.

What a checkpoint folder holds, and what its config.json may say, is checkpoint.py's;
this file finds the folder (a path, or `<weights dir>/<preset>/`), checks it is
complete, places its tensors on a device in a dtype, quantizes its weights if asked
(`quantize.py`: `quantization="int8"` or `"w8a8"`, vLLM's `--quantization`), and hands the model to
`cpu_layout.choose_layout`, which lays out for this device's kernels what is still model.py's.

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

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .hf_format import (CONFIG_FILE, REQUIRED_FILES, TOKENIZER_FILE, WEIGHTS_FILE, CheckpointError,  # noqa: F401
                         config_from_hf, config_to_hf, expected_shapes, plan_tensors, read_config)
from ..device import resolve_device, resolve_dtype
from ..config import HF_CHECKPOINTS, PRESETS, GPT2Config
from ..model import GPT2
from ..cpu_layout import choose_layout
from ..quantize import QUANTIZATIONS, check_quantization, quantization_of, quantize

# ---- where, and in what precision -------------------------------------------

def default_weights_dir() -> Path:
    """$MINILLM_WEIGHTS_DIR if set; else `weights/` beside weights_download.py when
    running from a checkout (so lessons find it from any directory); else ./weights."""
    env = os.environ.get("MINILLM_WEIGHTS_DIR")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[2]
    if (repo_root / "weights_download.py").exists():
        return repo_root / "weights"
    return Path("weights")


def download_command(name: str) -> str:
    return f"python weights_download.py {name}"


# ---- reading a checkpoint ---------------------------------------------------

def check_folder(folder: Path, name: str | None = None) -> None:
    """Raise a CheckpointError listing the files a checkpoint folder lacks."""
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        fix = (f"download them with `{download_command(name)}`" if name in HF_CHECKPOINTS
               else "point at a folder written by save_pretrained or by a GPT-2 tool")
        partial = [p.name for p in folder.glob("*.part")]
        resume = f" (an interrupted download is there: {', '.join(partial)}; rerun to resume)" if partial else ""
        raise CheckpointError(f"the weights folder {folder} is missing {', '.join(missing)}{resume}; {fix}")


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
                    dtype: str | torch.dtype = "auto", quantization: str | None = None) -> GPT2:
    """Load a GPT-2 checkpoint folder onto `device` in `dtype` (its projections in int8 if `quantization` is a
    method of quantize.py), or raise a CheckpointError."""
    folder = Path(folder)
    check_folder(folder, folder.name)
    device = resolve_device(device)
    check_quantization(quantization, device)  # before a byte is read
    dtype = resolve_dtype(dtype, device)
    config = read_config(folder)
    path = folder / WEIGHTS_FILE
    with _open(path, device) as f:
        keys = list(f.keys())
        slices = {k: f.get_slice(k) for k in keys}
        plan = plan_tensors(keys, {k: tuple(s.get_shape()) for k, s in slices.items()}, config, path,
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
    quantize(model, quantization)  # after the weights are in, before the layout: int8 modules are not laid out
    choose_layout(model)  # after the weights are in: the copies a CPU's kernels read are made from them
    return model.eval()


def random_model(config: GPT2Config, device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", seed: int = 0, quantization: str | None = None) -> GPT2:
    """GPT-2's seeded init, built straight on `device` in `dtype`.

    Same values as `GPT2(config, seed).to(device, dtype)`: the init draws every
    tensor from one CPU generator in fp32 and casts it into place.
    """
    device = resolve_device(device)
    check_quantization(quantization, device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = GPT2(config, seed=None)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(seed)
    model.weights_source = f"random-init (seed {seed})"
    quantize(model, quantization)
    choose_layout(model)
    return model.eval()


def save_pretrained(model: GPT2, folder: str | Path) -> Path:
    """Write `model.safetensors` + `config.json` in the official GPT-2 layout.

    Keys carry no prefix, projections are Conv1D [in, out], the tied head is not
    written: the layout of openai-community/gpt2, which transformers'
    GPT2LMHeadModel.from_pretrained and our loader both read.
    """
    if quantization_of(model) is not None:
        raise ValueError(f"save_pretrained writes the plain checkpoint format, and this model's projections are "
                         f"{quantization_of(model)}; save the model before quantizing it, or torch.save its state_dict")
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


def add_model_arguments(parser: argparse.ArgumentParser, weights_dir: bool = True) -> None:
    """--model, --device, --dtype, and unless told otherwise --weights-dir: the flags every command and lesson
    that loads a model takes, whose values go to `load_model`, `resolve_device` and `resolve_dtype`."""
    parser.add_argument("--model", default="gpt2",
                        help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny, mini) or a checkpoint folder")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, fp16, bf16")
    if weights_dir:
        parser.add_argument("--weights-dir", default=None,
                            help="where preset folders live (default: $MINILLM_WEIGHTS_DIR or the repo's weights/)")


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """--quantization, vLLM's flag: the commands whose `load_model` call passes it on take it."""
    parser.add_argument("--quantization", default=None, metavar="METHOD",
                        help=f"weights in fewer bytes: {', '.join(QUANTIZATIONS)} (int8: weight-only, per-channel "
                             "scales; w8a8: the same weights, activations rounded to int8 per row and integer sums; "
                             "minillm/quantize.py); default: the weights stay in --dtype")


def load_model(name_or_path: str | Path, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", weights_dir: str | Path | None = None,
               seed: int = 0, quantization: str | None = None) -> GPT2:
    """A GPT-2 in eval mode, from a checkpoint folder, a downloaded preset, or a random init.

    - a path to a folder: load that checkpoint;
    - a preset name: load `<weights_dir>/<name>/` if it holds a complete
      checkpoint; if not, fall back to a seeded random init of that shape, with
      one warning line (none for `tiny` and `mini` without a folder: they have
      no real weights to miss).
    `weights_dir` defaults to `default_weights_dir()`. The model's
    `weights_source` says where its values came from, for lessons to record.
    `quantization` ("int8", "w8a8" or None) is checked before anything is read.
    """
    check_quantization(quantization)
    folder, preset = locate(name_or_path, weights_dir)
    if preset is None or is_complete(folder):  # an explicit folder that is incomplete: an error saying why
        return load_checkpoint(folder, device, dtype, quantization)
    warn_absent(preset, folder)
    return random_model(PRESETS[preset], device, dtype, seed, quantization)


__all__ = ["CheckpointError", "add_model_arguments", "add_quantization_argument", "default_weights_dir",
           "load_checkpoint", "random_model", "save_pretrained", "load_model", "locate", "expected_shapes", "download_command",
           "config_from_hf", "config_to_hf", "is_complete", "missing_files", "warn_absent", "warn_once"]
