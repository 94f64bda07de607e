"""How many threads torch should use: the cores that are free when a run starts.

torch starts one thread per core it can see. On a machine that other programs
share, that is the wrong number: a parallel kernel splits its work evenly and
then waits at a barrier for its slowest thread, so a thread that shares its
core with a busy process holds every other thread back. And a thread that
finishes its share early must not spin on the core the slow thread needs:
importing `minillm` makes idle threads sleep (`minillm.let_idle_threads_sleep`
says why and how), and `device.wait_policy()` says which policy this process
runs under; every report prints it with the thread count. Threads are not
pinned to cores: the kernel moves a thread off a core that another process
takes, which pinning would forbid. docs/cpu_kernels.md has the measurements.

So lessons and `bench` count the cores that are free before they start:

    free = (CPUs this process may run on) − (CPU time others used in a short window ÷ the window),   at least 1

read from /proc/stat (one line per CPU) over a window of a fifth of a second in
which this process sleeps, so every busy tick in it belongs to someone else.
Where /proc/stat is missing (macOS, Windows) the 1-minute load average stands in
for the busy count. `--threads N` overrides the choice, and the choice and its
reason are printed and saved with the results.

    choice = choose_threads(requested=None)    # ThreadChoice(threads, reason, cpus, busy, ...)
    apply_threads(choice)                      # device.set_num_threads(choice.threads): torch's and numpy's BLAS
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from ..device import set_num_threads, wait_policy

WINDOW_S = 0.2  # long enough to see a busy loop (20 clock ticks at 100 Hz), short enough to go unnoticed


@dataclass
class ThreadChoice:
    threads: int
    reason: str
    cpus: int                  # CPUs in this process's affinity
    busy: float | None         # cores' worth of CPU time other processes used in the window; None: not measured
    method: str                # "/proc/stat", "load average", "asked for" or "unknown"
    window_s: float
    wait_policy: str = ""      # OMP_WAIT_POLICY as the OpenMP runtime read it (`wait_policy()`)

    def __post_init__(self):
        self.wait_policy = self.wait_policy or wait_policy()
        self.reason = f"{self.reason}; OpenMP threads {self.wait_policy}, not pinned"

    def as_dict(self) -> dict:
        return asdict(self)


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _per_cpu_busy_s(path: str = "/proc/stat") -> dict[int, float] | None:
    """Busy CPU seconds since boot for each CPU line of /proc/stat (idle and iowait excluded)."""
    try:
        with open(path) as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = {}
    for fields in lines:
        try:
            values = [int(x) for x in fields[1:9]]
        except ValueError:
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        busy[int(fields[0][3:])] = (sum(values) - idle) / tick
    return busy or None


def busy_cores(cpus: list[int], window_s: float = WINDOW_S, path: str = "/proc/stat") -> float | None:
    """Cores' worth of CPU time that other processes used on `cpus` over `window_s` while this one slept."""
    before, t0 = _per_cpu_busy_s(path), time.perf_counter()
    if before is None:
        return None
    time.sleep(window_s)
    after, seconds = _per_cpu_busy_s(path), max(time.perf_counter() - t0, window_s)  # sleep lasts at least that
    if after is None:
        return None
    used = sum(after.get(c, 0.0) - before.get(c, 0.0) for c in cpus)
    return min(float(len(cpus)), max(0.0, used / seconds))


def free_cores(cpus: int, busy: float) -> int:
    """The CPUs less the cores others kept busy (rounded to the nearest core), never fewer than one."""
    return max(1, cpus - int(busy + 0.5))


def choose_threads(requested: int | None = None, window_s: float = WINDOW_S) -> ThreadChoice:
    """The thread count for this run and why: `requested` when given, else the free cores."""
    cpus = affinity_cpus()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads {requested} must be at least 1 (or leave it out to use the free cores)")
        return ThreadChoice(requested, f"{requested} thread{'s' * (requested > 1)}, as asked (--threads)",
                            len(cpus), None, "asked for", 0.0)
    busy, method = busy_cores(cpus, window_s), "/proc/stat"
    if busy is None:
        try:
            busy, method = min(float(len(cpus)), os.getloadavg()[0]), "load average"
        except (AttributeError, OSError):
            return ThreadChoice(len(cpus), f"{len(cpus)} threads: one per CPU (this system shows no load to read)",
                                len(cpus), None, "unknown", 0.0)
    n = free_cores(len(cpus), busy)
    over = f"over {window_s:.1f} s" if method == "/proc/stat" else "by the 1-minute load average"
    reason = (f"{n} thread{'s' * (n > 1)}: {len(cpus)} CPU{'s' * (len(cpus) > 1)} in this process's affinity, "
              f"other processes kept {busy:.1f} of them busy {over} (--threads N overrides)")
    return ThreadChoice(n, reason, len(cpus), busy, method, window_s if method == "/proc/stat" else 0.0)


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    """Give torch, and numpy's BLAS (which computes one-row products on some CPUs), the chosen threads."""
    set_num_threads(choice.threads)
    return choice
