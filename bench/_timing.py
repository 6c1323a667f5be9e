"""Timing helpers shared by the benchmarks."""

import os
import time


def mean_seconds(fn, repeats):
    """Wall seconds per call of ``fn``, averaged over ``repeats`` calls in a row."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def popsim_threads():
    """The engine's thread count (POPSIM_NUM_THREADS, else every core): eager PyTorch gets as many, so a
    ratio compares like with like."""
    return int(os.environ.get("POPSIM_NUM_THREADS", os.cpu_count()))
