"""One process of a distributed training run started by test_distributed_training.py.

Usage: distributed_worker.py OUT_FILE MODE [REDUCTION]. Process id and count come from torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by the test. MODE "train" trains STEPS steps and saves
every step's losses and the final weights to OUT_FILE; MODE "die" makes process 1 exit after the first
step, and "stall" makes it stop answering for STALL_SECONDS. REDUCTION is a key of REDUCTIONS (default "post").
"""

import os
import sys
import time

import torch

import poptorch

REPLICAS = 2
MICRO_BATCH = 2
STEPS = 3
FEATURES = 4
STALL_SECONDS = 90  # "stall": process 1 stops answering for this long (well past the test's timeout)


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.net(x)
        return out, self.loss(out, labels)


def global_batches(processes):
    """Every step's inputs for all processes together: [STEPS, processes * REPLICAS * MICRO_BATCH, ...]."""
    generator = torch.Generator().manual_seed(1)
    samples = processes * REPLICAS * MICRO_BATCH
    x = torch.randn(STEPS, samples, FEATURES, generator=generator)
    labels = torch.randint(0, 3, (STEPS, samples), generator=generator)
    return x, labels


def make_model(seed):
    torch.manual_seed(seed)
    model = Classifier()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# How replicas' gradients are reduced: (ReductionType, MeanReductionStrategy).
REDUCTIONS = {
    "post": (poptorch.ReductionType.Mean, poptorch.MeanReductionStrategy.Post),
    "running": (poptorch.ReductionType.Mean, poptorch.MeanReductionStrategy.Running),
    "sum": (poptorch.ReductionType.Sum, poptorch.MeanReductionStrategy.Post),
}


def main(out_file, mode, reduction="post"):
    opts = poptorch.Options().replicationFactor(REPLICAS).showCompilationProgressBar(False)
    reduction_type, strategy = REDUCTIONS[reduction]
    opts.Training.accumulationAndReplicationReductionType(reduction_type)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    process, processes = opts.Distributed.processId, opts.Distributed.numProcesses
    # Each process starts from different weights: the broadcast from process 0 must make them alike.
    model, optimizer = make_model(seed=process)
    training = poptorch.trainingModel(model, opts, optimizer)
    x, labels = global_batches(processes)
    share = slice(process * REPLICAS * MICRO_BATCH, (process + 1) * REPLICAS * MICRO_BATCH)
    losses = []
    for step in range(STEPS):
        if mode == "die" and process == 1 and step == 1:
            os._exit(3)
        if mode == "stall" and process == 1 and step == 1:
            time.sleep(STALL_SECONDS)
            os._exit(4)
        _, loss = training(x[step, share], labels[step, share])
        losses.append(loss.clone())
    state = {name: value.clone() for name, value in model.state_dict().items()}
    torch.save({"losses": torch.stack(losses), "state": state}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
