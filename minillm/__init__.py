"""minillm: a teaching-grade LLM inference engine. One module per serving idea; see README.md."""
from .config import PRESETS, GPT2Config
from .model import GPT2
from .sampling_params import SamplingParams
from .checkpoints.load import load_model

__all__ = ["GPT2Config", "PRESETS", "GPT2", "SamplingParams", "load_model"]
