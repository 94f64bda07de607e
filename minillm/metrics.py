"""The measurement toolkit in one namespace, for a tool that takes it whole (`gpu_check.py`).

Each idea lives in its own module, and the lessons, `bench` and the tests
import from those: `timing.py` (timers, the environment, `si`), `cost.py`
(the analytic cost of a step), `roofline.py` (the device's ceilings),
`memory.py` (what a device holds and could give) and `steps.py` (timed and
counted steps on the contiguous KV cache).
"""
from .bench.cost import StepCost, decode_cost, prefill_cost, step_cost, weight_read_floor  # noqa: F401
from .bench.memory import accounted_memory, cuda_memory, memory_budget, reset_peak_memory, resident_bytes  # noqa: F401
from .bench.roofline import Ceilings, achieved, ceiling_kernels, measure_ceilings  # noqa: F401
from .bench.steps import count_ops, decode_step, prefill_step, time_decode, time_prefill  # noqa: F401
from .bench.timing import Stopwatch, Timing, environment, si, synchronize, time_fn  # noqa: F401
