"""The model zoo (tests/models/zoo.py) on the simulated IPU against eager PyTorch, one model per process.

For every zoo model: compile time of the training model (first call), its step time, the ratio to eager's
training step (SGD) measured interleaved in one process (median of the per-round ratios), and the peak RSS
of the process that ran both. Eager torch gets as many threads as the simulator (POPSIM_NUM_THREADS, default
every core): on a busy machine torch's spinning worker threads otherwise slow eager's small ops 50-fold.
``--model NAME`` runs one model and prints its row; without it every model
runs in a fresh process of its own, so each peak RSS is that model's.
"""

import argparse
import copy
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import torch

import poptorch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "models"))
from zoo import ZOO, build  # noqa: E402

ROUNDS = 7
STEPS_PER_ROUND = 3
LR = 0.01
HEADER = f"{'model':<10} {'compile s':>9} {'step ms':>9} {'eager ms':>9} {'ratio':>7} {'peak RSS MiB':>12}"


def _timed(fn):
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        fn()
    return (time.perf_counter() - start) / STEPS_PER_ROUND


def row(name):
    """Compile and time zoo model ``name``; its table row."""
    case = build(name)
    model = case.model.train()
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=LR)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))

    def sim_step():
        training(*case.args, **case.kwargs)

    def eager_step():
        eager_optimizer.zero_grad()
        case.loss_of(eager(*case.args, **case.kwargs)).backward()
        eager_optimizer.step()

    start = time.perf_counter()
    sim_step()
    compile_s = time.perf_counter() - start
    eager_step()
    sim, eager_times = [], []
    for _ in range(ROUNDS):  # alternating rounds: a slow spell of the machine hits both sides alike
        eager_times.append(_timed(eager_step))
        sim.append(_timed(sim_step))
    ratio = statistics.median(s / e for s, e in zip(sim, eager_times))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (
        f"{name:<10} {compile_s:9.2f} {statistics.median(sim) * 1e3:9.2f} "
        f"{statistics.median(eager_times) * 1e3:9.2f} {ratio:7.2f} {rss:12.0f}"
    )


def main():
    torch.set_num_threads(int(os.environ.get("POPSIM_NUM_THREADS", os.cpu_count())))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(ZOO), help="run this model only, in this process")
    args, _ = parser.parse_known_args()
    if args.model:
        print(row(args.model), flush=True)
        return 0
    print(HEADER, flush=True)
    failed = []
    for name in ZOO:
        if subprocess.run([sys.executable, __file__, "--model", name]).returncode:
            failed.append(name)
    return f"failed: {', '.join(failed)}" if failed else 0


if __name__ == "__main__":
    sys.exit(main())
