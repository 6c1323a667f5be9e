"""poptorch against eager PyTorch in one process: the tutorial CNN (batch 16) and an MLP.

For each model: compile time, simulated step wall time divided by the eager step time (training with
SGD + momentum, and inference; median over interleaved rounds), simulated IPU cycles per step and peak RSS.
"""

import copy
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn

import poptorch

sys.path.insert(0, "examples")
from train_digits import ClassificationModel, ModelWithLoss  # noqa: E402

ROUNDS = 15
STEPS_PER_ROUND = 8


def _interleaved(eager_fn, sim_fn):
    """Median step times of ``eager_fn`` and ``sim_fn``, the median of their per-round ratios and the ratio
    of their fastest rounds.

    The two alternate in short rounds, so a slow spell of this shared machine hits both alike instead of
    skewing the ratio. Slow spells still hit the simulator harder (its working set does not stay in cache),
    so the ratio of the fastest rounds, each side's speed without interference, is printed too."""
    eager_fn()
    sim_fn()
    eager, sim = [], []
    for _ in range(ROUNDS):
        for fn, times in ((eager_fn, eager), (sim_fn, sim)):
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                fn()
            times.append((time.perf_counter() - start) / STEPS_PER_ROUND)
    ratios = [s / e for s, e in zip(sim, eager)]
    return statistics.median(eager), statistics.median(sim), statistics.median(ratios), min(sim) / min(eager)


def _eager_train_step(model, optimizer, x, y):
    def step():
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()

    return step


def bench(name, make_model, x, y):
    torch.manual_seed(0)
    model = make_model()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)

    opts = poptorch.Options().logCycleCount(True)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    start = time.perf_counter()
    training.compile(x, y)
    compile_train = time.perf_counter() - start
    eager_train, sim_train, ratio_train, best_train = _interleaved(
        _eager_train_step(eager, eager_opt, x, y), lambda: training(x, y)
    )
    cycles = training.cycleCount()
    training.detachFromDevice()

    model.eval()
    eager.eval()
    inference = poptorch.inferenceModel(model, poptorch.Options())
    start = time.perf_counter()
    inference.compile(x)
    compile_infer = time.perf_counter() - start

    def eager_infer_step():
        with torch.no_grad():
            eager(x)

    eager_infer, sim_infer, ratio_infer, best_infer = _interleaved(eager_infer_step, lambda: inference(x))

    print(
        f"{name:>14}: train {sim_train * 1e3:7.2f} ms/step vs eager {eager_train * 1e3:6.2f} ms "
        f"(ratio {ratio_train:5.2f}, fastest rounds {best_train:5.2f}); infer {sim_infer * 1e3:7.2f} ms vs eager "
        f"{eager_infer * 1e3:6.2f} ms (ratio {ratio_infer:5.2f}, fastest rounds {best_infer:5.2f}); compile train "
        f"{compile_train:5.2f} s, infer {compile_infer:5.2f} s; {cycles} simulated cycles/step"
    )


class MLPWithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y=None):
        out = self.net(x)
        return out if y is None else (out, self.loss(out, y))


def main():
    y = torch.randint(0, 10, (16,))
    bench("tutorial CNN", lambda: ModelWithLoss(ClassificationModel(), nn.NLLLoss()), torch.randn(16, 1, 28, 28), y)
    bench("MLP 784-256-10", MLPWithLoss, torch.randn(16, 784), y)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
