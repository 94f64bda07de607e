"""minillm: a teaching-grade LLM inference engine. One module per serving idea; see README.md."""
from .config import GPT2Config, PRESETS
from .model import GPT2
from .sampling import SamplingParams

__all__ = ["GPT2Config", "PRESETS", "GPT2", "SamplingParams"]
