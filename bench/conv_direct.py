"""Host step time of a small ResNet with direct-convolution (CONV) vertices against im2col matmul vertices.

Two training models of the same small ResNet (stages of 16 and 32 channels, BatchNorm, batch 8 of 32x32) are
compiled in one process: one as the planner chooses (CONV vertices where estimated faster), one with every
convolution forced onto the im2col matmul path. Their steps then run interleaved, round by round, and the
script prints the median step time of each, their ratio, each program's simulated cycles per step, and eager
PyTorch's training step (SGD) timed in the same rounds for scale, with as many threads as the simulator
(POPSIM_NUM_THREADS, default every core).
``--direct-only`` / ``--im2col-only`` run just one variant (e.g. under ``perf record``).
"""

import argparse
import statistics
from unittest import mock

import torch
from _timing import mean_seconds, popsim_threads  # bench/ is the script's directory
from torch import nn

import poptorch
from popsim import conv_plan

ROUNDS = 7
STEPS_PER_ROUND = 3
LR = 0.01
BATCH = 8


class Block(nn.Module):
    """A basic residual block; a strided 1x1 projection when the shape changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            Block(16, 16, 1),
            Block(16, 32, 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)


def compiled(direct, x, y):
    """A compiled training model; ``direct=False`` forces every convolution onto the im2col matmul path."""
    torch.manual_seed(0)
    model = SmallResNet().train()
    options = poptorch.Options().logCycleCount(True)
    training = poptorch.trainingModel(model, options, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    if direct:
        training.compile(x, y)
    else:
        with mock.patch.object(conv_plan, "direct_is_faster", return_value=False):
            training.compile(x, y)
    training(x, y)  # warm up
    return training


def _eager_step(x, y):
    torch.manual_seed(0)
    model = SmallResNet().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--direct-only", action="store_true")
    only.add_argument("--im2col-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    torch.set_num_threads(popsim_threads())
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    variants = {}
    if not args.im2col_only:
        variants["direct"] = compiled(True, x, y)
    if not args.direct_only:
        variants["im2col"] = compiled(False, x, y)
    steps = {name: (lambda t=training: t(x, y)) for name, training in variants.items()}
    steps["eager"] = _eager_step(x, y)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(mean_seconds(step, STEPS_PER_ROUND))
    for name, training in variants.items():
        print(f"{name:<7} step {statistics.median(times[name]) * 1e3:8.1f} ms  cycles/step {training.cycleCount():>10}")
    print(f"eager   step {statistics.median(times['eager']) * 1e3:8.1f} ms")
    if len(variants) == 2:
        ratios = [d / m for d, m in zip(times["direct"], times["im2col"])]
        print(f"direct / im2col step time: {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
