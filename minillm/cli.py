"""The flags every command and lesson that loads a model takes, defined once.

`python -m minillm generate|bench|...` and `python lessons/NN_name.py` all read
`--model`, `--device` and `--dtype` (and the commands `--weights-dir`); their
values go to `weights.load_model`, `resolve_device` and `resolve_dtype`.
"""
from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser, weights_dir: bool = True) -> None:
    """--model, --device, --dtype, and unless told otherwise --weights-dir."""
    parser.add_argument("--model", default="gpt2",
                        help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny, mini) or a checkpoint folder")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, fp16, bf16")
    if weights_dir:
        parser.add_argument("--weights-dir", default=None,
                            help="where preset folders live (default: $MINILLM_WEIGHTS_DIR or the repo's weights/)")
