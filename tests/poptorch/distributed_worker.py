"""One process of a distributed training run started by test_distributed_training.py.

Usage: distributed_worker.py OUT_FILE MODE [REDUCTION]. Process id and count come from torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by the test. MODE "train" trains STEPS steps and saves
every step's losses and the final weights to OUT_FILE; MODE "die" makes process 1 exit after the first
step, and "stall" makes it stop answering for STALL_SECONDS. REDUCTION is a key of REDUCTIONS (default "post").
MODE "grouped" trains GroupedModel (weights grouped over the replicas of both processes) from a different
optimizer state on each process, then runs an inference model built differently on each process.
MODE "loss_scaling" trains a float16 model with automatic loss scaling where only process 1's last replica
overflows, and saves every step's loss scale and the final weights.
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
    if mode == "grouped":
        grouped_main(out_file, opts)
        return
    if mode == "loss_scaling":
        loss_scaling_main(out_file, opts)
        return
    if mode == "sharded":  # every parameter's optimizer state sharded over the replicas of both processes
        rts = poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
        opts.TensorLocations.setOptimizerLocation(rts.minElementsForReplicatedTensorSharding(1))
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


class GroupedModel(torch.nn.Module):
    """One weight per Orthogonal group (replicas r, r + 2: one on each process), one per Consecutive group
    (replicas 0-1 on process 0, 2-3 on process 1), and a bias every replica shares."""

    GROUPS = 2

    def __init__(self):
        super().__init__()
        self.across = torch.nn.Parameter(torch.randn(self.GROUPS, FEATURES))
        self.within = torch.nn.Parameter(torch.randn(self.GROUPS, FEATURES))
        self.bias = torch.nn.Parameter(torch.randn(()))

    def forward(self, x, y):
        out = x @ self.across + x @ self.within + self.bias
        return out, torch.nn.functional.mse_loss(out, y)


def grouped_inputs(processes):
    """Every step's samples and targets for all processes: [STEPS, processes * REPLICAS * MICRO_BATCH, ...]."""
    generator = torch.Generator().manual_seed(2)
    samples = processes * REPLICAS * MICRO_BATCH
    return torch.randn(STEPS, samples, FEATURES, generator=generator), torch.randn(STEPS, samples, generator=generator)


def make_grouped(seed):
    """The model and an SGD optimizer whose momentum differs with ``seed`` (as if loaded from a checkpoint)."""
    torch.manual_seed(seed)
    model = GroupedModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        optimizer.state[param]["momentum_buffer"] = torch.randn(param.shape)
    return model, optimizer


def grouped_main(out_file, opts):
    process, processes = opts.Distributed.processId, opts.Distributed.numProcesses
    model, optimizer = make_grouped(seed=process)
    training = poptorch.trainingModel(model, opts, optimizer)
    training.across.replicaGrouping(poptorch.CommGroupType.Orthogonal, 2, poptorch.VariableRetrievalMode.OnePerGroup)
    training.within.replicaGrouping(poptorch.CommGroupType.Consecutive, 2, poptorch.VariableRetrievalMode.OnePerGroup)
    x, y = grouped_inputs(processes)
    share = slice(process * REPLICAS * MICRO_BATCH, (process + 1) * REPLICAS * MICRO_BATCH)
    losses = [training(x[step, share], y[step, share])[1].clone() for step in range(STEPS)]
    state = {name: value.clone() for name, value in model.state_dict().items()}
    momentum = {name: optimizer.state[param]["momentum_buffer"].clone() for name, param in model.named_parameters()}
    # Inference from weights that differ per process: process 0's reach every process.
    torch.manual_seed(10 + process)
    inference = poptorch.inferenceModel(torch.nn.Linear(FEATURES, 3), poptorch.Options().replicationFactor(REPLICAS))
    outputs = inference(x[0, share]).as_subclass(torch.Tensor)
    torch.save({"losses": torch.stack(losses), "state": state, "momentum": momentum, "outputs": outputs}, out_file)


# Automatic loss scaling: the float16 model's gain, starting scale and inputs, in that test's units.
ALS_GAIN = 4.0
ALS_SCALE = 4096.0
ALS_LR = 0.01
ALS_ROWS = 3


def loss_scaling_chunks(processes):
    """Each replica's float16 micro-batch, in global replica order: all small (alone they double the scale)
    except the last, whose large inputs push its gradients past the bin edge (alone it halves the scale)."""
    generator = torch.Generator().manual_seed(3)
    replicas = processes * REPLICAS
    spreads = [0.1] * (replicas - 1) + [10.0]
    return [(torch.randn(ALS_ROWS, FEATURES, generator=generator) * s).half() for s in spreads]


def loss_scaling_main(out_file, opts):
    from test_automatic_loss_scaling import HalfNet

    process, processes = opts.Distributed.processId, opts.Distributed.numProcesses
    torch.manual_seed(0)
    model = HalfNet(ALS_GAIN)
    opts.Training.setAutomaticLossScaling(True)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=ALS_LR, loss_scaling=ALS_SCALE)
    training = poptorch.trainingModel(model, opts, optimizer)
    x = torch.cat(loss_scaling_chunks(processes)[process * REPLICAS : (process + 1) * REPLICAS])
    scales = []
    for _ in range(STEPS):
        training(x)
        scales.append(ALS_SCALE * float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]))
    training.copyWeightsToHost()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    torch.save({"scales": scales, "state": state}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
