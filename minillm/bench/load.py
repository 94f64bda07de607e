"""The machine's load while a lesson measured: what other processes took of the CPU, printed beside a verdict.

Two snapshots (`read_load`, before and after) make a `MachineLoad`: the share of the machine's CPU time that
other processes used over the window, from /proc/stat on Linux (busy time of all cores, less this process's
own), estimated from the load average elsewhere, unknown where neither exists. The load is reported and
widens nothing: a verdict's interval comes from the rounds the lesson measured (`verdict.py`).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass


@dataclass
class LoadReading:  # a snapshot; two of them make a `MachineLoad`
    wall: float                   # time.perf_counter()
    own_cpu_s: float              # CPU seconds this process (and its finished children) used so far
    machine_busy_s: float | None  # CPU seconds all cores spent busy since boot (/proc/stat), None off Linux
    loadavg: float | None         # 1-minute load average


def read_load() -> LoadReading:
    t, busy, loadavg = os.times(), None, None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait; steal counts as busy: not ours
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        loadavg = os.getloadavg()[0]
    return LoadReading(time.perf_counter(), t.user + t.system + t.children_user + t.children_system, busy, loadavg)


@dataclass
class MachineLoad:
    cores: int
    seconds: float
    loadavg_before: float | None
    loadavg_after: float | None
    share: float | None  # fraction of the machine's CPU time other processes took over the window; None: unknown
    estimated: bool = False  # share estimated from the load average (no /proc/stat: macOS, Windows)

    @classmethod
    def between(cls, before: LoadReading, after: LoadReading) -> "MachineLoad":
        cores, seconds = os.cpu_count() or 1, max(after.wall - before.wall, 1e-9)
        own = after.own_cpu_s - before.own_cpu_s
        if before.machine_busy_s is not None and after.machine_busy_s is not None:
            others = after.machine_busy_s - before.machine_busy_s - own
            return cls(cores, seconds, before.loadavg, after.loadavg, min(1.0, max(0.0, others / (seconds * cores))))
        if after.loadavg is not None:  # runnable threads on average, less the cores this process kept busy
            others = max(before.loadavg or 0.0, after.loadavg) - own / seconds
            return cls(cores, seconds, before.loadavg, after.loadavg, min(1.0, max(0.0, others / cores)), True)
        return cls(cores, seconds, before.loadavg, after.loadavg, None)

    def describe(self) -> str:
        avg = (f"load average {self.loadavg_before:.2f} → {self.loadavg_after:.2f} on {self.cores} cores"
               if self.loadavg_before is not None else f"{self.cores} cores")
        if self.share is None:
            return f"{avg}; what other processes used is unknown on this system"
        how = " (estimated from the load average)" if self.estimated else ""
        return f"{avg}; other processes took {self.share:.0%} of the CPU{how} while this lesson measured"
