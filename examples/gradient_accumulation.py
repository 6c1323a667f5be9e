"""Gradient accumulation: 4 micro-batches per optimizer step equal one step on the 4x larger batch.

With ``Training.gradientAccumulation(4)`` (mean reduction, the default) the model's weights after one
call match plain PyTorch trained on the combined batch with a mean loss.
"""

import argparse
import copy

import torch
import torch.nn as nn

import poptorch


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    batch = args.micro_batch * args.accumulate
    x, y = torch.randn(batch, 8), torch.randn(batch, 1)

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(args.accumulate)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    training_model(x, y)

    cpu_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x, y)[1].backward()
    cpu_optimizer.step()

    max_diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    print(
        f"{args.accumulate} accumulated micro-batches of {args.micro_batch}: largest weight difference "
        f"from one CPU step on the batch of {batch}: {max_diff:.2e}"
    )
    return max_diff


if __name__ == "__main__":
    main()
