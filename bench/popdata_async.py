"""popdata: Async versus Sync DataLoader throughput.

The dataset's ``__getitem__`` sleeps 1 ms (an I/O-bound dataset) and every loader uses 2 torch workers.
Each step the training loop "runs the device" for as long as one worker needs to load a combined batch
(a sleep, as an IPU step would not use the host CPU). Printed: samples per second of each mode and the
ratio Async / Sync, measured side by side in this process.

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


def throughput(mode, steps, device_seconds, num_workers=WORKERS):
    """Samples per second over ``steps`` steps (after one warm-up epoch start), and the samples seen."""
    opts = popdata.BatchingOptions(device_iterations=DEVICE_ITERATIONS)
    combined = BATCH_SIZE * DEVICE_ITERATIONS
    loader = popdata.DataLoader(
        opts, SleepyDataset(combined * (steps + 1)), batch_size=BATCH_SIZE, num_workers=num_workers, mode=mode
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
    device_seconds = combined * LOAD_SECONDS / 1
    print(
        f"combined batch {combined} samples, __getitem__ sleeps {LOAD_SECONDS * 1e3:.0f} ms, "
        f"device step {device_seconds * 1e3:.0f} ms, {args.steps} steps"
    )
    rows = [
        ("Sync, num_workers=0", DataLoaderMode.Sync, 0),
        ("Sync, num_workers=2", DataLoaderMode.Sync, WORKERS),
        ("Async, num_workers=2", DataLoaderMode.Async, WORKERS),
        ("AsyncRebatched, num_workers=2", DataLoaderMode.AsyncRebatched, WORKERS),
    ]
    rates = {}
    for name, mode, workers in rows:
        rates[name] = throughput(mode, args.steps, device_seconds, workers)
        print(f"  {name:32s} {rates[name]:8.0f} samples/s")
    print(f"Async / Sync (num_workers=0): {rates['Async, num_workers=2'] / rates['Sync, num_workers=0']:.2f}x")
    print(f"Async / Sync (num_workers=2): {rates['Async, num_workers=2'] / rates['Sync, num_workers=2']:.2f}x")


if __name__ == "__main__":
    main()
