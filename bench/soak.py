"""Soak: many training steps, then many wrap / run / destroy cycles, watching the process's resources.

Printed at intervals: resident memory (RSS, MB), OS threads, open file descriptors and child processes.
Flat figures are the goal: the first interval pays for imports and the first compile, and later ones
should not grow. The training phase runs ``--steps`` optimizer steps of a small MLP (``--device-iterations``
steps per call); the cycle phase wraps a fresh model, runs one call and destroys it ``--cycles`` times, with
the executable cache on so each cycle pays for capture and loading rather than lowering.

Usage: python bench/soak.py [--steps 10000] [--cycles 500] [--device-iterations 10] [--report-every 10]
"""

import argparse
import os
import resource
import tempfile
import time

import torch

import poptorch

FEATURES, HIDDEN, CLASSES, BATCH = 16, 32, 4, 8


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)
        )
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.net(x)
        return out, self.loss(out, labels)


def resources():
    """(RSS MB, OS threads, open fds, live child processes) of this process, from /proc."""
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    children = sum(len(open(f"/proc/self/task/{t}/children").read().split()) for t in os.listdir("/proc/self/task"))
    return rss, threads, fds, children


def report(phase, done, started):
    rss, threads, fds, children = resources()
    print(
        f"{phase:9s} {done:>6d}  {time.perf_counter() - started:8.1f} s  RSS {rss:8.1f} MB  threads {threads:3d}  "
        f"fds {fds:4d}  children {children:2d}",
        flush=True,
    )
    return rss, threads, fds, children


def training(steps, device_iterations, report_every):
    opts = poptorch.Options().showCompilationProgressBar(False).deviceIterations(device_iterations)
    model = Mlp()
    wrapped = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * device_iterations, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH * device_iterations,), generator=generator)
    calls = steps // device_iterations
    started, figures = time.perf_counter(), []
    for call in range(1, calls + 1):
        wrapped(x, labels)
        if call % max(1, calls // report_every) == 0 or call == calls:
            figures.append(report("training", call * device_iterations, started))
    wrapped.destroy()
    return figures


def cycles(count, report_every, cache_dir):
    opts = poptorch.Options().showCompilationProgressBar(False).enableExecutableCaching(cache_dir)
    x = torch.randn(BATCH, FEATURES)
    labels = torch.zeros(BATCH, dtype=torch.int64)
    started, figures = time.perf_counter(), []
    for cycle in range(1, count + 1):
        model = Mlp()
        wrapped = poptorch.trainingModel(model, opts.clone(), poptorch.optim.SGD(model.parameters(), lr=0.01))
        wrapped(x, labels)
        wrapped.destroy()
        if cycle % max(1, count // report_every) == 0 or cycle == count:
            figures.append(report("cycles", cycle, started))
    return figures


def growth(figures):
    """Change of each figure from the second report to the last (the first includes warm-up)."""
    first, last = figures[min(1, len(figures) - 1)], figures[-1]
    return ", ".join(
        f"{name} {b - a:+.1f}" for name, a, b in zip(("RSS MB", "threads", "fds", "children"), first, last)
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--device-iterations", type=int, default=10)
    parser.add_argument("--report-every", type=int, default=10, help="reports per phase")
    args = parser.parse_args()
    report("start", 0, time.perf_counter())
    train = training(args.steps, args.device_iterations, args.report_every)
    with tempfile.TemporaryDirectory() as cache_dir:
        cycle = cycles(args.cycles, args.report_every, cache_dir)
    print(f"growth after warm-up: training {growth(train)}; cycles {growth(cycle)}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MB")


if __name__ == "__main__":
    main()
