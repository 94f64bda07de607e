"""minillm: a teaching-grade LLM inference engine. One module per serving idea; see README.md."""
import os
import sys


def let_idle_threads_sleep() -> None:
    """Make idle worker threads sleep at once instead of spinning: OpenMP's (torch's kernels) and OpenBLAS's
    (numpy's, which computes some one-row products: cpu_layout.py).

    Why: a parallel kernel splits its work evenly and waits at a barrier for its slowest thread, and by default
    a waiting thread first busy-polls (GNU OpenMP, for a while; OpenBLAS, for 2²⁸ cycles after each product).
    On a core shared with another process, or with the other library's threads, that spinning takes the very
    time slices the slow thread needs. OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4 (its least: 2⁴
    cycles) make them sleep; the price is a wake-up at each barrier on a quiet machine. The measurements, with
    their commands, are in docs/cpu_kernels.md.

    Why here, first: each runtime reads its variable once, as it loads (with torch, with numpy), and neither
    has a setter. Every way in (`python -m minillm`, the lessons, the server, the tests) imports this package
    before torch, so this file is the one place early enough. A variable already set is kept, and so is a
    runtime already loaded (torch or numpy imported before minillm); `device.wait_policy()` says what this
    process runs under. Child processes inherit the variables.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


let_idle_threads_sleep()  # before the imports below load torch and numpy

from .config import PRESETS, GPT2Config  # noqa: E402
from .model import GPT2  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402
from .checkpoints.load import load_model  # noqa: E402

__all__ = ["GPT2Config", "PRESETS", "GPT2", "SamplingParams", "load_model", "let_idle_threads_sleep"]
