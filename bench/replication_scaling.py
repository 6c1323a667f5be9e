"""Data-parallel scaling on the simulated IPU-POD: the tutorial CNN and a small encoder at replication
1, 2, 4, 16 and 64.

Each row trains one step of ``replicationFactor(R)`` (micro-batch per replica fixed) and reads the
simulated cycles of the step: the replicas compute in parallel, then all-reduce their gradients over the
IPU-Links of an IPU-M2000 (up to 4 replicas) and between machines (beyond 4); see popsim.collectives.
Printed: cycles per step, samples per simulated second, speed-up over one replica, parallel efficiency and
the share of the step spent in the all-reduce.
"""

import argparse
import pathlib
import sys

import torch
from torch import nn

import poptorch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from train_digits import ClassificationModel, ModelWithLoss  # noqa: E402

REPLICAS = (1, 2, 4, 16, 64)
MICRO_BATCH = 16


class Encoder(nn.Module):
    """Two pre-norm transformer encoder layers over token embeddings, mean-pooled into a classifier."""

    def __init__(self, vocab=128, width=64, heads=4, layers=2, classes=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        logits = self.head(self.encoder(self.embed(ids)).mean(dim=1))
        return logits, self.loss(logits, labels)


def _cnn(samples):
    model = ModelWithLoss(ClassificationModel(), nn.NLLLoss())
    return model, (torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,)))


def _encoder(samples, sequence=32):
    return Encoder(), (torch.randint(0, 128, (samples, sequence)), torch.randint(0, 8, (samples,)))


MODELS = {"tutorial CNN": _cnn, "encoder": _encoder}


def step(make, replicas):
    """(cycles per step, clock Hz, all-reduce share, gradient bytes) of one training step on ``replicas``."""
    torch.manual_seed(0)
    model, inputs = make(MICRO_BATCH * replicas)
    opts = poptorch.Options().replicationFactor(replicas).logCycleCount(True).showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    training(*inputs)
    profile = training.profile
    replication = profile.replication or {"all_reduce_share": 0.0, "all_reduce": {"bytes": 0}}
    cycles = training.cycleCount()
    training.destroy()
    return cycles, profile.target.clock_hz, replication["all_reduce_share"], replication["all_reduce"]["bytes"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=list(REPLICAS))
    args, _ = parser.parse_known_args(argv)
    print(f"micro-batch {MICRO_BATCH} per replica, one IPU per replica, Mk2 GC200 at 1.325 GHz")
    columns = ("cycles/step", 12), ("samples/s", 12), ("speed-up", 9), ("efficiency", 10), ("all-reduce", 10)
    print(f"{'model':<13} {'R':>3} " + " ".join(f"{title:>{width}}" for title, width in columns))
    for name, make in MODELS.items():
        base = None
        for replicas in args.replicas:
            cycles, clock, share, nbytes = step(make, replicas)
            rate = MICRO_BATCH * replicas * clock / cycles
            base = base or rate / replicas
            print(
                f"{name:<13} {replicas:>3} {cycles:>12,} {rate:>12,.0f} {rate / base:>9.2f} "
                f"{rate / base / replicas:>10.0%} {share:>10.1%}"
                + (f"   ({nbytes:,} gradient bytes)" if replicas > 1 and replicas == args.replicas[-1] else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
