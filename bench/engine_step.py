"""Engine host time of one training step of a bench/models.py model, apart from capture, compile and the
Python around the engine (issue 17's step-time goals: the engine's share).

Trains the model one step, records the engine run of its next step (the tile arena before it and the
program's tables), then re-runs that run from the same arena ``--steps`` times for each thread count: the
CPU time (every thread's) and wall time of one run, medians. It also prints the run's simulated cycles and a
digest of the arena after one run from the recorded state: an engine change must leave both as they were.
To compare two builds, run this with each build's sources first on PYTHONPATH, alternating, and compare
medians of several processes.

    python bench/engine_step.py [--model bert-tiny] [--steps 10] [--threads 1 2]
"""

import argparse
import hashlib
import statistics
import sys
import time

import torch

import poptorch
from popsim import executable

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from models import COMPILE_MODELS, LR, _case  # noqa: E402


def record(name):
    """(executable, flattened program, stream table, host buffer, arena bytes) of the engine run with the
    most phases in one steady-state training step of model ``name``."""
    torch.manual_seed(0)
    case = _case(name)
    model = case.model.train()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    training(*case.args, **case.kwargs)
    runs, original = [], executable.Executable._run_phases

    def recording(self, flat, table, host):
        runs.append((self, flat, table.copy(), host.copy(), self.arena.buffer.copy()))
        return original(self, flat, table, host)

    executable.Executable._run_phases = recording
    try:
        training(*case.args, **case.kwargs)
    finally:
        executable.Executable._run_phases = original
    return max(runs, key=lambda run: run[1].phases.shape[0])


def replay(run, threads, steps):
    """(cycles, arena digest after one run, median CPU ms, median wall ms) of the recorded run."""
    exe, flat, table, host, arena = run
    exe.num_threads = threads
    exe.arena.buffer[:] = arena
    cycles = exe._run_phases(flat, table.copy(), host.copy())[1]
    digest = hashlib.sha1(exe.arena.buffer).hexdigest()[:16]
    cpu, wall = [], []
    for _ in range(steps):
        table_now, host_now = table.copy(), host.copy()
        start_cpu, start = time.process_time(), time.perf_counter()
        exe._run_phases(flat, table_now, host_now)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return cycles, digest, statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(COMPILE_MODELS), default="bert-tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    run = record(args.model)
    print(f"{'model':<13} {'threads':>7} {'cycles':>9} {'arena digest':>16} {'CPU ms':>8} {'wall ms':>8}")
    for threads in args.threads:
        cycles, digest, cpu, wall = replay(run, threads, args.steps)
        print(f"{args.model:<13} {threads:7d} {cycles:9d} {digest:>16} {cpu:8.2f} {wall:8.2f}", flush=True)


if __name__ == "__main__":
    main()
