"""popdata: Async versus Sync DataLoader throughput.

The dataset's ``__getitem__`` sleeps 1 ms (an I/O-bound dataset). Each step the training loop "runs the
device" for as long as one process needs to load a combined batch (a sleep: an IPU step does not use the
host CPU). Printed: samples per second of each mode, with 0 and with 2 torch workers, and the ratios,
measured side by side in this process.

The headline is Async with 2 workers against Sync loading in the training loop (num_workers=0): loading
then overlaps the device step and is spread over 2 workers. Sync with 2 torch workers already prefetches
in the background, so Async gains less over it; both ratios are printed.

Usage: python bench/popdata_async.py [--steps N]
"""

import argparse
import time

import torch
from torch.utils.data import Dataset

import popdata
from popdata import DataLoaderMode

BATCH_SIZE = 4
DEVICE_ITERATIONS = 4
WORKERS = 2
LOAD_SECONDS = 0.001


class SleepyDataset(Dataset):
    """``__getitem__`` sleeps 1 ms and returns a small sample."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        time.sleep(LOAD_SECONDS)
        return torch.full((16,), float(index)), index


def throughput(mode, steps, device_seconds, num_workers):
    """Samples per second over ``steps`` steps (after one warm-up epoch start), and the samples seen."""
    opts = popdata.BatchingOptions(device_iterations=DEVICE_ITERATIONS)
    combined = BATCH_SIZE * DEVICE_ITERATIONS
    # AsyncRebatched workers load micro-batches: single samples cost a torch IPC round trip each.
    rebatched = {"rebatched_worker_size": BATCH_SIZE} if mode == DataLoaderMode.AsyncRebatched else {}
    loader = popdata.DataLoader(
        opts,
        SleepyDataset(combined * (steps + 1)),
        batch_size=BATCH_SIZE,
        num_workers=num_workers,
        mode=mode,
        **rebatched,
    )
    try:
        iterator = iter(loader)
        next(iterator)  # process and worker start-up is not throughput
        seen = 0
        start = time.perf_counter()
        for batch in iterator:
            seen += len(batch[1])
            time.sleep(device_seconds)
        elapsed = time.perf_counter() - start
    finally:
        loader.terminate()
    assert seen == combined * steps, (seen, combined * steps)
    return seen / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    combined = BATCH_SIZE * DEVICE_ITERATIONS
    device_seconds = combined * LOAD_SECONDS
    print(
        f"combined batch {combined} samples, __getitem__ sleeps {LOAD_SECONDS * 1e3:.0f} ms, "
        f"device step {device_seconds * 1e3:.0f} ms, {args.steps} steps"
    )
    rates = {}
    for workers in (0, WORKERS):
        for mode in DataLoaderMode:
            rates[mode, workers] = throughput(mode, args.steps, device_seconds, workers)
            print(f"  {mode.name:15s} num_workers={workers}  {rates[mode, workers]:8.0f} samples/s")
    sync0, async0 = rates[DataLoaderMode.Sync, 0], rates[DataLoaderMode.Async, 0]
    sync2, async2 = rates[DataLoaderMode.Sync, WORKERS], rates[DataLoaderMode.Async, WORKERS]
    print(f"Async (2 workers) / Sync (num_workers=0): {async2 / sync0:.2f}x  (target >= 1.8x)")
    print(f"Async / Sync, both num_workers=0:          {async0 / sync0:.2f}x")
    print(f"Async / Sync, both num_workers=2:          {async2 / sync2:.2f}x")


if __name__ == "__main__":
    main()
