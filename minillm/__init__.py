"""minillm: a teaching-grade LLM inference engine. One module per serving idea; see README.md."""
import os
import sys

if "torch" not in sys.modules:  # OpenMP reads its policy once, as torch loads it: threads sleep at a barrier,
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # never spin for a core another process holds (bench/threads.py)
if "numpy" not in sys.modules:  # numpy's OpenBLAS reads its own, as numpy loads it: an idle thread sleeps at once
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # (weight_layout.py), never spins beside torch's threads
from .config import PRESETS, GPT2Config
from .model import GPT2
from .sampling_params import SamplingParams
from .checkpoints.load import load_model

__all__ = ["GPT2Config", "PRESETS", "GPT2", "SamplingParams", "load_model"]
