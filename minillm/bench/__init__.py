"""The measuring wing: timers, analytic costs, the device's ceilings, verdicts, workloads and the benchmarks.

Nothing in the book (the concept files in `minillm/`) imports this folder.
"""
