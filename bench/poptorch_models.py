"""poptorch against eager PyTorch in one process: the tutorial CNN (batch 16) and an MLP.

For each model: compile time, simulated step wall time divided by the eager step time (training with
SGD + momentum, and inference), simulated IPU cycles per step and peak RSS.
"""

import copy
import resource
import sys
import time

import torch
import torch.nn as nn

import poptorch

sys.path.insert(0, "examples")
from train_digits import ClassificationModel, ModelWithLoss  # noqa: E402

STEPS = 30


def _time_per_call(fn, steps=STEPS):
    fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


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
    eager_train = _time_per_call(_eager_train_step(eager, eager_opt, x, y))
    eager.eval()
    with torch.no_grad():
        eager_infer = _time_per_call(lambda: eager(x))

    opts = poptorch.Options().logCycleCount(True)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    start = time.perf_counter()
    training.compile(x, y)
    compile_train = time.perf_counter() - start
    sim_train = _time_per_call(lambda: training(x, y))
    cycles = training.cycleCount()
    training.detachFromDevice()

    model.eval()
    inference = poptorch.inferenceModel(model, poptorch.Options())
    start = time.perf_counter()
    inference.compile(x)
    compile_infer = time.perf_counter() - start
    sim_infer = _time_per_call(lambda: inference(x))

    print(
        f"{name:>14}: train {sim_train * 1e3:7.2f} ms/step vs eager {eager_train * 1e3:6.2f} ms "
        f"(ratio {sim_train / eager_train:5.2f}); infer {sim_infer * 1e3:7.2f} ms vs eager "
        f"{eager_infer * 1e3:6.2f} ms (ratio {sim_infer / eager_infer:5.2f}); compile train "
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
