"""PopTorch's public enums (the values mirror PopTorch 3.x)."""

import enum


class OutputMode(enum.IntEnum):
    """Which per-micro-batch outputs a call returns (see the batching table in the docs)."""

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


# PopTorch's older name for OutputMode (``Options.anchorMode``).
AnchorMode = OutputMode


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
    """IPU sync patterns; one simulated device syncs all its tiles (Full)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class ConnectionType(enum.IntEnum):
    """When a wrapped model attaches to its device: at compile time, at its first run, or never."""

    Always = 0
    OnDemand = 1
    Never = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """What an op mixing float16 and float32 inputs computes in (torch's rule is HalfUpcastToFloat)."""

    FloatDowncastToHalf = 0  # PopTorch's values: code may pass them as integers
    HalfUpcastToFloat = 1
    Default = 2


class CommGroupType(enum.IntEnum):
    """How replicas form groups (of ``size``): All (one group of every replica), Consecutive (replicas
    0..size-1, size..2*size-1, ...), Orthogonal (replicas with the same index modulo R / size...: replica r
    joins group r % (R / size)), NoGrouping (each replica alone)."""

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """Which replicas' values of a grouped variable the host reads: the first of each group, or all."""

    OnePerGroup = 0
    AllReplicas = 2  # PopTorch's value: per_replica_params may hold it as an integer


class MatMulSerializationMode(enum.Enum):
    """Which dimension ``serializedMatMul`` splits, for lhs (m x n) @ rhs (n x p)."""

    InputChannels = "input_channels"  # m
    ReducingDim = "reducing_dim"  # n
    OutputChannels = "output_channels"  # p
    Disabled = "none"


class OverlapMode(enum.Enum):
    """How far host transfers of a tensor marked by ``set_overlap_for_input`` / ``_output`` overlap compute."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class MultiConvPlanType(enum.IntEnum):
    """How the convolutions of a ``MultiConv`` are planned together."""

    Parallel = 0
    Serial = 1


class Compiler(enum.IntEnum):
    """The backend ``poptorch.experimental.IPUContext`` / ``IPUScope`` compile with."""

    PopART = 0
    MLIR = 1
