"""Compile time against model depth: a stack of 1, 2, 4 and 8 nn.TransformerEncoderLayer(128, 4, 256)
trained at batch 8 x 64 tokens (issue 17's depth-scaling table).

For each depth: the first-call compile time, its ratio to the 1-layer compile (linear growth would give
the depth itself), the compile's CPU time and its ratio (steadier than wall time on a shared machine), and
the eager PyTorch training step time for scale. Run: python bench/compile_scaling.py
[--depths 1 2 4 8 12]
"""

import argparse
import time

import torch
import torch.nn as nn

import poptorch

D_MODEL, HEADS, FFN = 128, 4, 256
BATCH, TOKENS = 8, 64


class Encoder(nn.Module):
    """``depth`` encoder layers of identical shapes with an MSE loss."""

    def __init__(self, depth):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, batch_first=True)
        self.stack = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

    def forward(self, x, target):
        out = self.stack(x)
        return out, nn.functional.mse_loss(out, target)


def _eager_step_ms(model, x, y, steps=5):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()

    step()  # warm-up: the first step allocates
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    args = parser.parse_args()
    x, y = torch.randn(BATCH, TOKENS, D_MODEL), torch.randn(BATCH, TOKENS, D_MODEL)
    print(f"{'layers':>6} {'compile s':>10} {'x 1-layer':>10} {'CPU s':>8} {'x 1-layer':>10} {'eager step ms':>14}")
    first = first_cpu = None
    for depth in args.depths:
        torch.manual_seed(0)
        model = Encoder(depth)
        eager_ms = _eager_step_ms(Encoder(depth), x, y)
        opts = poptorch.Options().showCompilationProgressBar(False)
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.01))
        start, start_cpu = time.perf_counter(), time.process_time()
        training.compile(x, y)
        seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        training.detachFromDevice()
        first, first_cpu = first or seconds, first_cpu or cpu
        wall = f"{seconds:>10.2f} {seconds / first:>10.2f}"
        print(f"{depth:>6} {wall} {cpu:>8.2f} {cpu / first_cpu:>10.2f} {eager_ms:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
