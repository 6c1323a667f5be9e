"""A one-parameter model learns a decision threshold; a moving average of the loss lowers the learning rate.

The model's only parameter is a scalar bias: the score ``LeakyReLU(8 * (x + bias))`` is the logit of
class 1 against a fixed logit 0 for class 0, and the label is ``x > 0.3``, so the bias should settle near
-0.3. AdamW runs inside the compiled program; as in the PopTorch porting guide, once an exponential moving
average of the loss drops below a threshold a new optimizer with a lower learning rate is handed to
``setOptimizer``, which changes the hyper-parameter without recompiling.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

THRESHOLD = 0.3


class BiasModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, target):
        score = F.leaky_relu(8.0 * (x + self.bias), 0.2)
        logits = torch.stack([torch.zeros_like(score), score], dim=1)
        return logits, self.loss(logits, target)


def batches(steps, batch_size=16, seed=0):
    """Points uniform in [-1, 1) labelled by whether they lie above THRESHOLD."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.rand(batch_size, generator=generator) * 2 - 1
        yield x, (x > THRESHOLD).long()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lower-lr", type=float, default=0.005)
    parser.add_argument("--loss-average-below", type=float, default=0.35)
    args = parser.parse_args(argv)

    model = BiasModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    training_model = poptorch.trainingModel(model, optimizer=optimizer)

    momentum_loss, lowered_at = None, None
    for step, (x, target) in enumerate(batches(args.steps)):
        _, loss = training_model(x, target)
        momentum_loss = float(loss) if momentum_loss is None else 0.9 * momentum_loss + 0.1 * float(loss)
        if lowered_at is None and momentum_loss < args.loss_average_below:
            training_model.setOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lower_lr))
            lowered_at = step
            print(f"step {step}: loss average {momentum_loss:.3f}, learning rate lowered to {args.lower_lr}")
    bias = float(model.bias.detach())
    print(f"learned bias {bias:.3f} (ideal {-THRESHOLD}), loss average {momentum_loss:.3f}")
    return {"bias": bias, "loss_average": momentum_loss, "lowered_at": lowered_at}


if __name__ == "__main__":
    main()
