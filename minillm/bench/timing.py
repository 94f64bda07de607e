"""Timing a step, and what a timed figure needs beside it to be reproduced.

`time_fn(fn, device)` runs warm-up calls, then repeats, and reports the
median. On a GPU work is queued asynchronously, so it times with CUDA events
(or a synchronize) around the work; on the CPU `time.perf_counter` suffices.
`Stopwatch` times the laps of a loop, such as the steps of one generation.

`environment` records the device, versions, threads and load a result was
measured under; `si` prints every figure's magnitude the same way (1.23e9 →
"1.23 G"), for the lessons and `bench` alike.

Invariant held by the tests: `time_fn` runs warm-up + repeats and reports
their median.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..device import synchronize
from ..device import cpuinfo


@dataclass
class Timing:
    """Seconds per call: the median of `times_s`, the list of every timed repeat."""
    median_s: float
    times_s: list[float]
    warmup: int
    method: str  # "cuda-events" or "perf_counter"


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu",
            warmup: int = 2, repeats: int = 5) -> Timing:
    """Call `fn` `warmup` times untimed, then `repeats` times timed; report the median.

    Warm-up matters: the first calls pay for allocation, kernel selection and
    cold caches. The median ignores the odd repeat disturbed by another process.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1; pass repeats=1 or more")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms → s
        method = "cuda-events"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        method = "perf_counter"
    return Timing(statistics.median(times), times, warmup, method)


class Stopwatch:
    """Lap times of a loop, device-aware: `start()` once, `lap()` after each step.

    On CUDA each lap records an event, and the durations are read out at the end
    with a single synchronize, so timing adds no stall inside the loop. The loop
    itself must consume its results (e.g. pick tokens on the host) for the laps
    to mean latency as a user sees it; generation loops do.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [self._mark()]

    def lap(self) -> None:
        if not self._marks:
            raise RuntimeError("Stopwatch.lap() before start(); call start() before the loop")
        self._marks.append(self._mark())

    def laps_s(self) -> list[float]:
        """Seconds between consecutive marks: lap i is the time of step i."""
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpuinfo("model name") or platform.processor() or platform.machine()


def environment(device: torch.device | str, dtype: torch.dtype) -> dict:
    """What a result needs beside it to be reproducible."""
    device = torch.device(device)
    env = {"device": str(device), "device_name": device_name(device), "dtype": str(dtype).replace("torch.", ""),
           "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    try:
        env["load_average"] = os.getloadavg()
    except OSError:
        pass
    return env


def si(x: float, unit: str = "") -> str:
    """1.23e9 → '1.23 G' + unit: readable magnitudes for printed figures."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g} {unit}".strip()
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()
