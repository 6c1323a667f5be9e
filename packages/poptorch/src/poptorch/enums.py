"""PopTorch's public enums (the values mirror PopTorch 3.x)."""

import enum


class OutputMode(enum.IntEnum):
    """Which per-micro-batch outputs a call returns (see the batching table in the docs)."""

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ReductionType(enum.IntEnum):
    """How gradients are reduced over accumulated micro-batches and replicas."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When a Mean reduction divides: every micro-batch (Running) or once at the end (Post)."""

    Running = 0
    Post = 1
    PostAndLoss = 2


class SyncPattern(enum.IntEnum):
    """IPU sync patterns, accepted for API compatibility (one simulated device needs no choice)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2
