"""``poptorch.Options``: every knob of a wrapped model, grouped like PopTorch's (Training, Precision, ...).

Setters are camelCase, return ``self`` (so calls chain) and refuse to run once the options are frozen by
a wrapper or a DataLoader. Values live in one flat dict keyed by dotted names ("Training.gradientAccumulation");
the snake_case properties are the read side that PopTorch code (and popdata) use. Every setter either does
what PopTorch documents on the simulated IPU or raises, saying the simulator does not model it; assigning
to an option (``opts.deviceIterations = 4``) raises instead of silently shadowing the setter.
"""

import ast
import copy
import enum
import json
import os

import torch

from poptorch import _blocks, _device_ids, _distributed, _logging
from poptorch.enums import (
    CommGroupType,
    ConnectionType,
    HalfFloatCastingBehavior,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
    SyncPattern,
)
from poptorch.errors import Error

IPU_VERSIONS = {"ipu1": "ipu1", "ipu2": "ipu2", "ipu21": "ipu21", 1: "ipu1", 2: "ipu2", 21: "ipu21"}

_DEFAULTS = {
    "deviceIterations": 1,
    "replicationFactor": 1,
    "broadcastBuffers": True,
    "inputGroupSize": 1,
    "inputGroupType": CommGroupType.NoGrouping,
    "outputMode": OutputMode.Default,
    "outputReturnPeriod": 1,
    # (short name, PopART long name, OutputMode or None for the model's, return period) per anchorTensor call.
    "anchoredTensors": (),
    "randomSeed": None,
    "useIpuModel": False,
    # The gc-info id of the device useIpuId chose (None: the device of the model's IPUs).
    "ipuId": None,
    "executableCachePath": None,
    "ipuVersion": "ipu2",
    "logDir": None,
    "logCycleCount": False,
    "showCompilationProgressBar": True,
    "executionStrategy": None,
    "autoRoundNumIPUs": False,
    "autoRecomputation": 0,
    "enableSyntheticData": False,
    "maxRepeatLogs": 4,
    "modelName": None,
    "connectionType": ConnectionType.Always,
    "syncPattern": SyncPattern.Full,
    "enableStableNorm": False,
    "profileDir": None,
    "moduleNamescope": True,
    "updatableNamedBuffers": (),
    "relaxOptimizerAttributesChecks": False,
    "allowOutOfMemory": False,
    "sourceLocationExcludes": (),
    "Training.gradientAccumulation": 1,
    "Training.accumulationAndReplicationReductionType": ReductionType.Mean,
    "Training.meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy.Post,
    "Training.automaticLossScaling": False,
    # PopART's automaticLossScalingSettings the simulator models (set through _Popart.set), with PopART's defaults.
    "Training.automaticLossScalingSettings.binEdgeLocation": 0.0625,
    "Training.automaticLossScalingSettings.thresholdUpperCountProportion": 1e-7,
    "Training.automaticLossScalingSettings.updatePeriod": 1,
    "Training.convolutionDithering": False,
    "Precision.partialsType": "float32",
    "Precision.stochasticRounding": False,
    "Precision.floatingPointExceptions": False,
    "Precision.runningStatisticsAlwaysFloat": True,
    "Precision.halfFloatCasting": HalfFloatCastingBehavior.HalfUpcastToFloat,
    "Distributed.processId": 0,
    "Distributed.numProcesses": 1,
    "Distributed.localProcessId": 0,
    "TensorLocations.numIOTiles": 0,
    "TensorLocations.streamed": (),  # (kind, minElementsForOffChip) of each kind kept in streaming memory
    # minElementsForReplicatedTensorSharding of the optimizer state sharded over replicas (None: unsharded)
    "TensorLocations.shardedOptimizer": None,
    "availableMemoryProportion": (),  # (IPU index, proportion) pairs
}

# Options that change the compiled program; they (with the graphs) key the executable cache.
COMPILE_KEYS = (
    "replicationFactor",
    "autoRecomputation",
    "broadcastBuffers",
    "inputGroupSize",
    "inputGroupType",
    "allowOutOfMemory",
    "ipuVersion",
    "Training.gradientAccumulation",
    "Training.accumulationAndReplicationReductionType",
    "Training.meanAccumulationAndReplicationReductionStrategy",
    "Training.automaticLossScaling",
    "Training.automaticLossScalingSettings.binEdgeLocation",
    "Training.automaticLossScalingSettings.thresholdUpperCountProportion",
    "Training.automaticLossScalingSettings.updatePeriod",
    "Training.convolutionDithering",
    "Precision.partialsType",
    "Precision.stochasticRounding",
    "Precision.floatingPointExceptions",
    "TensorLocations.numIOTiles",
    "TensorLocations.streamed",
    "TensorLocations.shardedOptimizer",
    "Distributed.numProcesses",
    "availableMemoryProportion",
)

# popart.RecomputationType values the simulator models -> what they recompute.
RECOMPUTATION = {0: "none", 1: "standard", 2: "norm_only", 3: "pipeline", 4: "all"}
_PARTIALS = {torch.float32: "float32", torch.float16: "float16", "float": "float32", "half": "float16"}
# PopTorch's random seed is an unsigned 64-bit integer.
_SEED_LIMIT = 2**64
ENV_DEFAULTS = "POPTORCH_DEFAULT_OPTIONS"
ENV_IPU_MODEL = "POPTORCH_IPU_MODEL"
ENV_WAIT_FOR_IPU = "POPTORCH_WAIT_FOR_IPU"
_ENV_FLAGS = {"1": True, "true": True, "0": False, "false": False}
# The PopART session options ``_Popart.set`` maps onto an Options setter; any other is refused.
_POPART_OPTIONS = {
    "autoRecomputation": "_autoRecomputation",
    "enableStableNorm": "enableStableNorm",
    "instrumentWithHardwareCycleCounter": "logCycleCount",
}
# PopART's prefix of the automatic loss scaling settings in ``_Popart.set`` keys.
_ALS_PREFIX = "automaticLossScalingSettings."
# popart.GradientTensorTrackingMethod.ConvAndMatmulGradients, PopART's default and the one method modelled.
_ALS_CONV_AND_MATMUL = 1
# Poplar engine options (``_Popart.set("engineOptions", {...})``, string values) the simulator models.
_ENGINE_OPTIONS = {"debug.allowOutOfMemory": "allowOutOfMemory"}
_ENGINE_FLAGS = {"true": True, "false": False}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Error(f"{name} must be a positive integer, got {value!r}")
    return value


def _bool(name, value):
    """``value`` if it is a bool: ``bool("False")`` is True, so strings and numbers are refused."""
    if not isinstance(value, bool):
        raise Error(f"{name} takes True or False, got {value!r}")
    return value


def _enum(name, enum_type, value):
    """``value`` if it is a member of ``enum_type``; a name given as a string is refused with the member to pass."""
    if isinstance(value, enum_type):
        return value
    kind = enum_type.__name__
    if isinstance(value, str) and value in enum_type.__members__:
        raise Error(f"{name} takes a poptorch.{kind}, got the string {value!r}: pass poptorch.{kind}.{value}")
    members = ", ".join(f"{kind}.{m}" for m in enum_type.__members__)
    raise Error(f"{name} takes a poptorch.{kind} ({members}), got {value!r}")


def _path(name, value):
    """A directory argument: a non-empty str or os.PathLike, never a number or None made into a string."""
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise Error(f"{name} takes a directory path (str or os.PathLike), got {value!r}")
    return os.fspath(value)


def check_proportion(proportion, what):
    """Raise unless ``proportion`` is a number from 0 to 1, as Poplar's availableMemoryProportion must be."""
    if isinstance(proportion, bool) or not isinstance(proportion, (int, float)) or not 0 <= proportion <= 1:
        raise Error(f"{what}: the available memory proportion must be a number from 0 to 1, got {proportion!r}")


def not_modelled(option, instead):
    """The error for an option the simulated IPU cannot honour (options are never accepted and ignored)."""
    return Error(f"{option} is not modelled by the simulated IPU: {instead}")


def replica_groups(api, kind, size, replicas):
    """The group index of each of ``replicas`` replicas under a ``CommGroupType`` ``kind`` with groups of
    ``size`` (used by Consecutive and Orthogonal only); ``api`` names the call in the error."""
    size = {CommGroupType.All: replicas, CommGroupType.NoGrouping: 1}.get(kind, size)
    if replicas % size:
        raise Error(
            f"{api}({size}, CommGroupType.{kind.name}) needs a group size dividing replicationFactor({replicas})"
        )
    if kind == CommGroupType.Orthogonal:
        return [r % (replicas // size) for r in range(replicas)]
    return [r // size for r in range(replicas)]


class _NoAssignment:
    """Refuses ``opts.deviceIterations = 4``, which would shadow the setter and change nothing."""

    def __setattr__(self, name, value):
        if name.startswith("_") or name not in dir(type(self)) and not self.__dict__.get("_sealed"):
            object.__setattr__(self, name, value)
            return
        owner = type(self).__name__.lstrip("_")
        if callable(getattr(type(self), name, None)):
            raise Error(f"{owner}.{name} is a setter: call it, e.g. opts.{name}({value!r}), instead of assigning")
        raise Error(f"Cannot assign {name!r} on {owner}: options change only through their setters")


class _Group(_NoAssignment):
    """A named group of options (``opts.Training``...) writing into its owner's store."""

    _prefix = ""

    def __init__(self, owner):
        self._owner = owner
        self._sealed = True

    def _set(self, key, value):
        self._owner._set(f"{self._prefix}.{key}", value)
        return self

    def _get(self, key):
        return self._owner._values[f"{self._prefix}.{key}"]


class _TrainingOptions(_Group):
    """``opts.Training``: gradient accumulation and how gradients are reduced."""

    _prefix = "Training"

    def gradientAccumulation(self, gradient_accumulation):
        """Micro-batches whose gradients are accumulated before each optimizer step."""
        return self._set("gradientAccumulation", _positive_int("gradientAccumulation", gradient_accumulation))

    def accumulationAndReplicationReductionType(self, reduction_type):
        """Reduce accumulated and replicated gradients by ReductionType.Mean (default) or ReductionType.Sum."""
        reduction_type = _enum("accumulationAndReplicationReductionType", ReductionType, reduction_type)
        if reduction_type == ReductionType.NoReduction:
            raise Error("accumulationAndReplicationReductionType must be ReductionType.Mean or ReductionType.Sum")
        return self._set("accumulationAndReplicationReductionType", reduction_type)

    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy):
        """When a Mean reduction divides: Post (default) sums the micro-batches' gradients and divides at the
        step; Running keeps a running mean, which cannot overflow a float16 accumulator."""
        strategy = _enum("setMeanAccumulationAndReplicationReductionStrategy", MeanReductionStrategy, strategy)
        if strategy == MeanReductionStrategy.PostAndLoss:
            raise not_modelled(
                "MeanReductionStrategy.PostAndLoss", "use MeanReductionStrategy.Post or MeanReductionStrategy.Running"
            )
        return self._set("meanAccumulationAndReplicationReductionStrategy", strategy)

    def setAutomaticLossScaling(self, enabled):
        """Automatic loss scaling: after each optimizer step (or every ``updatePeriod`` steps) the device halves
        the loss scaling if more than ``thresholdUpperCountProportion`` (1e-7) of the elements of the float16
        gradients of matmuls and convolutions reach ``binEdgeLocation`` (1/16) of float16's maximum, else
        doubles it. Those PopART settings are set with ``_Popart.set("automaticLossScalingSettings.<name>", v)``.
        The optimizer's ``loss_scaling`` is the starting value and is updated from the device after each step."""
        return self._set("automaticLossScaling", _bool("setAutomaticLossScaling", enabled))

    def _automaticLossScalingSetting(self, name, value):
        """PopART's ``automaticLossScalingSettings.<name>`` (``_Popart.set``), checked as PopART checks it."""
        if name == "enabled":
            return self.setAutomaticLossScaling(value)
        if name in ("binEdgeLocation", "thresholdUpperCountProportion"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise Error(
                    f"Out of range value for '{name}'. The current value is {value!r}, but it should be in the "
                    "range [0, 1]."
                )
            return self._set(f"automaticLossScalingSettings.{name}", float(value))
        if name == "updatePeriod":
            return self._set("automaticLossScalingSettings.updatePeriod", _positive_int(_ALS_PREFIX + name, value))
        if name == "gradientTensorTrackingMethod":
            if isinstance(value, bool) or value != _ALS_CONV_AND_MATMUL:
                raise not_modelled(
                    f"automaticLossScalingSettings.gradientTensorTrackingMethod {value!r}",
                    "the tensors it selects are PopART IR tensors; the simulator tracks the gradients of matmuls "
                    "and convolutions (GradientTensorTrackingMethod.ConvAndMatmulGradients, 1, the default)",
                )
            return self
        raise not_modelled(
            f"The PopART option {_ALS_PREFIX + name!r}",
            "the simulator models automaticLossScalingSettings.enabled, binEdgeLocation, "
            "thresholdUpperCountProportion, updatePeriod and gradientTensorTrackingMethod (1 only)",
        )

    def setConvolutionDithering(self, enabled):
        """Convolution dithering (Poplar's enableConvDithering for every convolution): each convolution's
        tiles, forward and gradients alike, start at a tile column and run in a direction hashed from its
        shape, so that convolutions of different shapes spread their temporary memory over different tiles.
        Results are unchanged."""
        return self._set("convolutionDithering", _bool("setConvolutionDithering", enabled))

    @property
    def gradient_accumulation(self):
        return self._get("gradientAccumulation")

    @property
    def accumulation_and_replication_reduction_type(self):
        return self._get("accumulationAndReplicationReductionType")

    @property
    def mean_reduction_strategy(self):
        return self._get("meanAccumulationAndReplicationReductionStrategy")

    @property
    def automatic_loss_scaling(self):
        return self._get("automaticLossScaling")

    @property
    def automatic_loss_scaling_settings(self):
        """PopART's automatic loss scaling settings by name (binEdgeLocation, ...), or None when disabled."""
        if not self.automatic_loss_scaling:
            return None
        prefix = f"{self._prefix}.{_ALS_PREFIX}"
        return {key[len(prefix) :]: value for key, value in self._owner._values.items() if key.startswith(prefix)}

    @property
    def convolution_dithering(self):
        return self._get("convolutionDithering")


class _PrecisionOptions(_Group):
    """``opts.Precision``: partials type and floating-point behaviour."""

    _prefix = "Precision"

    def setPartialsType(self, dtype):
        """Type of matmul/convolution partials: torch.float (default) or torch.half."""
        if dtype not in _PARTIALS:
            raise ValueError(f"setPartialsType accepts torch.float or torch.half, not {dtype!r}")
        return self._set("partialsType", _PARTIALS[dtype])

    def enableStochasticRounding(self, enabled):
        """Round float16 results stochastically (from the device's seeded random numbers) instead of to nearest."""
        return self._set("stochasticRounding", _bool("enableStochasticRounding", enabled))

    def enableFloatingPointExceptions(self, enabled):
        """Raise poptorch.Error, naming the op and source line, when an op produces inf or NaN."""
        return self._set("floatingPointExceptions", _bool("enableFloatingPointExceptions", enabled))

    def runningStatisticsAlwaysFloat(self, enabled):
        """Keep batch-norm running statistics in float32 even in a half model."""
        return self._set("runningStatisticsAlwaysFloat", _bool("runningStatisticsAlwaysFloat", enabled))

    def halfFloatCasting(self, behavior):
        """Type of ops mixing float16 and float32: HalfUpcastToFloat (torch's rule, the default)."""
        behavior = _enum("halfFloatCasting", HalfFloatCastingBehavior, behavior)
        if behavior == HalfFloatCastingBehavior.FloatDowncastToHalf:
            raise not_modelled(
                "HalfFloatCastingBehavior.FloatDowncastToHalf",
                "ops follow torch's type promotion (HalfUpcastToFloat); cast the float32 operand to half yourself",
            )
        return self._set("halfFloatCasting", HalfFloatCastingBehavior.HalfUpcastToFloat)

    @property
    def partials_type(self):
        return self._get("partialsType")

    @property
    def stochastic_rounding(self):
        return self._get("stochasticRounding")

    @property
    def floating_point_exceptions(self):
        return self._get("floatingPointExceptions")


class _DistributedOptions(_Group):
    """``opts.Distributed``: this process's place among several host processes.

    A new Options reads it from ``torch.distributed`` when a process group is initialised, else from
    torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or Open MPI's (``OMPI_COMM_WORLD_RANK``,
    ``OMPI_COMM_WORLD_SIZE``) environment variables; ``configureProcessId`` overrides it."""

    _prefix = "Distributed"

    def configureProcessId(self, process_id, num_processes):
        """Declare this process as ``process_id`` of ``num_processes``."""
        _positive_int("numProcesses", num_processes)
        if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise Error(f"processId must be an integer in [0, {num_processes}), got {process_id!r}")
        self._set("processId", process_id)
        return self._set("numProcesses", num_processes)

    def setEnvVarNames(self, var_num_processes, var_process_id):
        """Read the process count and id from these environment variables (unset: process 0 of 1)."""
        place = _distributed.from_variables(var_process_id, var_num_processes)
        place = place or _distributed.Place(0, 1, 0)
        self._set("localProcessId", place.local_id)
        return self.configureProcessId(place.id, place.count)

    def disable(self):
        """Run as a single process whatever the environment says."""
        self._set("localProcessId", 0)
        return self.configureProcessId(0, 1)

    def _from_environment(self):
        place = _distributed.from_environment()
        self._set("localProcessId", place.local_id)
        return self.configureProcessId(place.id, place.count)

    @property
    def processId(self):
        return self._get("processId")

    @property
    def numProcesses(self):
        return self._get("numProcesses")

    @property
    def localProcessId(self):
        """This process's id among the processes of its host (torchrun's ``LOCAL_RANK``)."""
        return self._get("localProcessId")


class TensorLocationSettings:
    """Where one kind of tensor lives (``Options.TensorLocations.set*Location``): tile memory, or streaming
    (off-chip) memory for tensors of at least ``minElementsForOffChip`` elements (default 2, as PopART).
    Replicated tensor sharding is modelled for optimizer state (see ``_streaming``); I/O
    tiles for loading or storing are refused as not modelled when given to a ``set*Location``."""

    MIN_ELEMENTS_FOR_OFF_CHIP = 2  # PopART's default: smaller tensors (scalars) stay on the chip
    MIN_ELEMENTS_FOR_SHARDING = 8192  # PopART's default: smaller tensors are not sharded over replicas

    def __init__(self):
        self._values = {}

    def _record(self, name, value, check):
        self._values[name] = check(name, value)
        return self

    def minElementsForOffChip(self, min_elements):
        """Tensors with fewer elements stay on the chip."""
        return self._record("minElementsForOffChip", min_elements, _non_negative)

    def minElementsForReplicatedTensorSharding(self, min_elements):
        """Tensors with fewer elements are not sharded over replicas."""
        return self._record("minElementsForReplicatedTensorSharding", min_elements, _non_negative)

    def useOnChipStorage(self, use=True):
        """Keep the tensors in tile memory (True) or in streaming memory (False)."""
        return self._record("useOnChipStorage", use, _bool)

    def useReplicatedTensorSharding(self, use=True):
        """Shard the tensors over replicas."""
        return self._record("useReplicatedTensorSharding", use, _bool)

    def useIOTilesToLoad(self, use=True):
        """Load the tensors from streaming memory through the I/O tiles."""
        return self._record("useIOTilesToLoad", use, _bool)

    def useIOTilesToStore(self, use=True):
        """Store the tensors to streaming memory through the I/O tiles."""
        return self._record("useIOTilesToStore", use, _bool)

    def unmodelled(self):
        """The settings the simulated IPU does not model (I/O tiles), as
        ``name(value)`` strings."""
        wanted = {"useIOTilesToLoad": False, "useIOTilesToStore": False}
        return [f"{k}({v})" for k, v in self._values.items() if k in wanted and v != wanted[k]]

    def sharded(self):
        """Whether the tensors are sharded over replicas (``useReplicatedTensorSharding(True)``)."""
        return self._values.get("useReplicatedTensorSharding", False)

    def min_elements_sharded(self):
        return self._values.get("minElementsForReplicatedTensorSharding", self.MIN_ELEMENTS_FOR_SHARDING)

    def off_chip(self):
        """Whether the tensors go to streaming memory (``useOnChipStorage(False)``)."""
        return not self._values.get("useOnChipStorage", True)

    def min_elements_off_chip(self):
        return self._values.get("minElementsForOffChip", self.MIN_ELEMENTS_FOR_OFF_CHIP)


def _non_negative(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Error(f"{name} takes a non-negative integer, got {value!r}")
    return value


# Why sharding each other kind of tensor over the replicas is refused: what PopART would do that the simulated
# replicas (run one after another on one device, each holding whole tensors outside the optimizer step) do not.
_UNSHARDED_BECAUSE = {
    "Weight": "PopART would keep a shard of each weight and all-gather it before each of its readers in every pass",
    "Accumulator": "PopART would reduce-scatter each micro-batch's gradient into every replica's accumulator shard, "
    "while each simulated replica accumulates whole gradients",
    "Activation": "activations are each replica's own values, not copies of one tensor to shard",
}


class _TensorLocationOptions(_Group):
    """``opts.TensorLocations``: where tensors live (I/O tiles; weights, optimizer state, accumulators and
    activations in tile memory or streaming memory)."""

    MIN_IO_TILES, MAX_IO_TILES = 32, 192  # PopTorch's bounds of numIOTiles (an even count)

    _prefix = "TensorLocations"

    def _location(self, kind, location):
        if not isinstance(location, TensorLocationSettings):
            raise Error(f"set{kind}Location takes a poptorch.TensorLocationSettings, got {location!r}")
        refused = location.unmodelled()
        if refused:
            raise not_modelled(
                f"TensorLocations.set{kind}Location with {', '.join(refused)}",
                "tensors live in tile memory or in streaming memory, unsharded, loaded and stored by the compute "
                "tiles (no I/O-tile loading or storing); drop those settings",
            )
        if location.sharded() and kind != "Optimizer":
            raise not_modelled(
                f"TensorLocations.set{kind}Location with useReplicatedTensorSharding(True)",
                f"{_UNSHARDED_BECAUSE[kind]}. Replicated tensor sharding is modelled for optimizer state only, in "
                "tile or streaming memory (setOptimizerLocation(TensorLocationSettings()"
                ".useReplicatedTensorSharding(True))); drop useReplicatedTensorSharding here",
            )
        if kind == "Optimizer":
            self._set("shardedOptimizer", location.min_elements_sharded() if location.sharded() else None)
        streamed = {k: n for k, n in self._get("streamed") if k != kind}
        if location.off_chip():
            streamed[kind] = location.min_elements_off_chip()
        return self._set("streamed", tuple(sorted(streamed.items())))

    @property
    def streamed(self):
        """{kind ("Weight", "Optimizer", "Accumulator", "Activation"): minElementsForOffChip} of the kinds in
        streaming memory."""
        return dict(self._get("streamed"))

    @property
    def sharded_optimizer(self):
        """minElementsForReplicatedTensorSharding of the optimizer state sharded over replicas, or None."""
        return self._get("shardedOptimizer")

    def setWeightLocation(self, location):
        """Where weights (parameters) live: tile memory, or streaming memory with ``useOnChipStorage(False)``."""
        return self._location("Weight", location)

    def setActivationLocation(self, location):
        """Where activations live: tile memory, or with ``useOnChipStorage(False)`` the forward activations the
        backward pass reads (of at least ``minElementsForOffChip`` elements) go to streaming memory after their
        last forward reader and are loaded again before each backward reader."""
        return self._location("Activation", location)

    def setOptimizerLocation(self, location):
        """Where optimizer state lives: tile memory, or streaming memory with ``useOnChipStorage(False)``."""
        return self._location("Optimizer", location)

    def setAccumulatorLocation(self, location):
        """Where gradient accumulators live: tile memory, or streaming memory with ``useOnChipStorage(False)``."""
        return self._location("Accumulator", location)

    def numIOTiles(self, num_tiles):
        """Tiles reserved for I/O (an even number from 32 to 192): the model computes on the other tiles."""
        if not isinstance(num_tiles, int) or num_tiles % 2 or not self.MIN_IO_TILES <= num_tiles <= self.MAX_IO_TILES:
            raise Error(f"numIOTiles must be an even number between {self.MIN_IO_TILES} and {self.MAX_IO_TILES}.")
        return self._set("numIOTiles", num_tiles)

    @property
    def num_io_tiles(self):
        return self._get("numIOTiles")


class _JitOptions(_Group):
    """``opts.Jit``: kept for old code; models are always captured with torch.export."""

    _prefix = "Jit"

    def traceModel(self, trace_model):
        """Only False is accepted: torch.jit.trace capture does not exist any more."""
        if trace_model:
            raise Error(
                "Jit.traceModel(True) is not supported: models are captured with torch.export, not torch.jit.trace."
            )
        return self


class _PopartOptions(_Group):
    """``opts._Popart``: PopART session options. The few with a meaning here map onto Options setters."""

    _prefix = "_Popart"

    def set(self, key, value):
        """Set PopART option ``key``; only those the simulator models are accepted."""
        if key == "engineOptions":
            return self._engine_options(value)
        if key.startswith(_ALS_PREFIX):
            self._owner.Training._automaticLossScalingSetting(key[len(_ALS_PREFIX) :], value)
            return self
        if key not in _POPART_OPTIONS:
            raise not_modelled(
                f"The PopART option {key!r}",
                f"the simulator has no PopART backend; it models only {', '.join(sorted(_POPART_OPTIONS))}",
            )
        getattr(self._owner, _POPART_OPTIONS[key])(value)
        return self

    def _engine_options(self, options):
        """Poplar engine options: ``debug.allowOutOfMemory`` compiles (and here runs) a program whose tiles
        exceed their memory, so its profile shows where; other engine options are refused."""
        if not isinstance(options, dict):
            raise Error(f"_Popart.set('engineOptions', ...) takes a dict of Poplar engine options, got {options!r}")
        for name, value in options.items():
            if name not in _ENGINE_OPTIONS:
                raise not_modelled(
                    f"The Poplar engine option {name!r}", "the simulator models only debug.allowOutOfMemory"
                )
            flag = value if isinstance(value, bool) else _ENGINE_FLAGS.get(str(value).lower())
            if flag is None:
                raise Error(f"The Poplar engine option {name!r} takes 'true' or 'false', got {value!r}")
            self._owner._set(_ENGINE_OPTIONS[name], flag)
        return self

    def setPatterns(self, patterns, level=None):
        """PopART graph patterns: refused, the simulator runs its own popir passes."""
        raise not_modelled("_Popart.setPatterns", "the simulator optimises graphs with its own passes; remove the call")


def _config_value(node):
    """An option file's argument: a literal, a ``poptorch.<name>`` attribute (an enum member) or a call of
    one with literal arguments (an execution strategy such as ``poptorch.ShardedExecution()``). Names are
    looked up in the poptorch package only, so a file cannot run arbitrary code."""
    if isinstance(node, ast.Call) and not node.keywords:
        return _config_value(node.func)(*[_config_value(a) for a in node.args])
    if isinstance(node, ast.Attribute):
        parts = ast.unparse(node).split(".")
        if parts[0] == "poptorch":
            import poptorch  # the package is fully imported by the time a file is loaded

            value = poptorch
            for part in parts[1:]:
                if part.startswith("_"):
                    raise ValueError(f"{part!r} is private")
                value = getattr(value, part)
            return value
    return ast.literal_eval(node)


class Options(_NoAssignment):
    """Options of a wrapped model (the PopTorch 3.x API)."""

    def __init__(self):
        self._values = dict(_DEFAULTS)
        self._frozen = False
        self.Training = _TrainingOptions(self)
        self.Precision = _PrecisionOptions(self)
        self.Distributed = _DistributedOptions(self)
        self.TensorLocations = _TensorLocationOptions(self)
        self.Jit = _JitOptions(self)
        self._Popart = _PopartOptions(self)
        self._sealed = True
        self.Distributed._from_environment()
        if os.environ.get("POPTORCH_CACHE_DIR"):
            self._values["executableCachePath"] = os.environ["POPTORCH_CACHE_DIR"]
        if os.environ.get("POPTORCH_IPU_MODEL_VERSION"):
            self.ipuVersion(os.environ["POPTORCH_IPU_MODEL_VERSION"])
        if os.environ.get(ENV_IPU_MODEL):
            self._values["useIpuModel"] = _env_flag(ENV_IPU_MODEL)
        if os.environ.get(ENV_DEFAULTS):
            self._apply_json(os.environ[ENV_DEFAULTS], f"the environment variable {ENV_DEFAULTS}")
        if os.environ.get(ENV_WAIT_FOR_IPU) and _env_flag(ENV_WAIT_FOR_IPU):
            # PopTorch then waits for a free IPU when attaching; a simulated IPU is always free.
            _logging.logger.debug(
                "%s is set: a simulated IPU is always free, so attaching never waits", ENV_WAIT_FOR_IPU
            )

    # -- store ----------------------------------------------------------------------------------
    def _set(self, key, value):
        if self._frozen:
            raise Error(
                "Options have already been used by a model or a DataLoader and can no longer be changed: "
                "call clone() to get a modifiable copy."
            )
        self._values[key] = value
        return self

    def _freeze(self):
        self._frozen = True
        return self

    def _for_model(self, training):
        """The frozen copy a wrapper runs with: OutputMode.Default resolved to Final (training) or All."""
        resolved = self.clone()
        if resolved.defaultOutputMode():
            resolved._values["outputMode"] = OutputMode.Final if training else OutputMode.All
        return resolved._freeze()

    def _apply_dict(self, settings, prefix=""):
        for name, value in settings.items():
            if isinstance(value, dict):
                self._apply_dict(value, f"{prefix}{name}.")
            else:
                self._call(f"{prefix}{name}", value if isinstance(value, list) else [value])

    def _apply_json(self, text, source):
        try:
            settings = json.loads(text)
            if not isinstance(settings, dict):
                raise ValueError('expected a JSON object such as {"deviceIterations": 2}')
            self._apply_dict(settings)
        except (ValueError, TypeError, Error) as exc:
            raise Error(f"Cannot apply the options in {source}: {exc}") from None

    def _call(self, dotted, args):
        target = self
        *groups, setter = dotted.split(".")
        for group in groups:
            target = getattr(target, group, None)
        method = getattr(target, setter, None)
        if not callable(method) or setter.startswith("_"):
            raise Error(f"Unknown option {dotted!r}")
        method(*args)

    def clone(self):
        """An unfrozen copy with the same values."""
        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        other = Options.__new__(Options)
        other.__init__()
        other._values = dict(self._values)
        return other

    def toDict(self):
        """Every option by dotted name (enums as their names)."""
        return {k: (v.name if isinstance(v, enum.Enum) else v) for k, v in self._values.items()}

    def __repr__(self):
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in self.toDict().items()) + ")"

    def loadFromFile(self, filepath):
        """Apply one setter call per line, e.g. ``deviceIterations(2)`` or ``Training.gradientAccumulation(4)``."""
        with open(filepath) as f:
            for number, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                try:
                    call = ast.parse(line, mode="eval").body
                    if not isinstance(call, ast.Call) or call.keywords:
                        raise ValueError("expected a setter call")
                    self._call(ast.unparse(call.func), [_config_value(a) for a in call.args])
                except (SyntaxError, ValueError, AttributeError) as exc:
                    raise Error(f"{filepath}:{number}: cannot parse option {line!r}: {exc}") from None
        return self

    def from_json(self, text):
        """Apply settings from a JSON object, in the format of POPTORCH_DEFAULT_OPTIONS:
        ``{"deviceIterations": 2, "Training": {"gradientAccumulation": 4}}``."""
        self._apply_json(text, "the JSON string given to Options.from_json")
        return self

    # -- setters --------------------------------------------------------------------------------
    def deviceIterations(self, device_iterations):
        """Optimizer steps (training) or micro-batches (inference) run per call."""
        return self._set("deviceIterations", _positive_int("deviceIterations", device_iterations))

    def replicationFactor(self, replication_factor):
        """Number of replicas; simulated as micro-batches whose gradients are reduced together."""
        return self._set("replicationFactor", _positive_int("replicationFactor", replication_factor))

    def broadcastBuffers(self, broadcast_buffers=True):
        """Keep buffers in sync between replicas (default). PopTorch cannot broadcast buffers, so a model that
        updates buffers (BatchNorm running statistics, in-place copies) on replicas needs
        ``broadcastBuffers(False)``: each replica then keeps its own buffers, and reading them on the host
        gives the first replica's."""
        return self._set("broadcastBuffers", _bool("broadcastBuffers", broadcast_buffers))

    def inputReplicaGrouping(self, input_group_size, input_group_type):
        """Replicas of one group of ``input_group_size`` receive the same inputs, so a call's inputs hold
        ``replicationFactor / input_group_size`` micro-batches per iteration. Groups are Consecutive
        (replicas 0..size-1 share the first micro-batch) or Orthogonal (replica r takes micro-batch
        r % (replicationFactor / size)); All gives every replica the same inputs, NoGrouping (the default)
        each its own."""
        input_group_type = _enum("inputReplicaGrouping", CommGroupType, input_group_type)
        if input_group_type in (CommGroupType.Consecutive, CommGroupType.Orthogonal):
            input_group_size = _positive_int("input_group_size", input_group_size)
        self._set("inputGroupSize", input_group_size)
        return self._set("inputGroupType", input_group_type)

    def outputMode(self, output_mode, output_return_period=None):
        """Which outputs a call returns: OutputMode.All, Final, Sum, EveryN (needs a period) or Default.

        The return period changes only with EveryN."""
        output_mode = _enum("outputMode", OutputMode, output_mode)
        if output_mode == OutputMode.EveryN:
            self._set("outputReturnPeriod", _positive_int("output_return_period", output_return_period))
        elif output_return_period is not None:
            raise ValueError("output_return_period is only used with OutputMode.EveryN")
        return self._set("outputMode", output_mode)

    def anchorMode(self, anchor_mode, anchor_return_period=None):
        """PopTorch's older name for :meth:`outputMode`."""
        return self.outputMode(anchor_mode, anchor_return_period)

    def randomSeed(self, random_seed):
        """Seed of on-device randomness (an unsigned 64-bit integer); also seeds torch on the host."""
        if isinstance(random_seed, bool) or not isinstance(random_seed, int) or not 0 <= random_seed < _SEED_LIMIT:
            raise Error(f"randomSeed takes an integer in [0, 2**64), got {random_seed!r}")
        torch.manual_seed(random_seed)
        return self._set("randomSeed", random_seed)

    def useIpuModel(self, use_model):
        """Run on the IPU Model, a simulator of the IPU (overrides POPTORCH_IPU_MODEL). Without IPU hardware
        both settings run on the simulated IPU."""
        return self._set("useIpuModel", _bool("useIpuModel", use_model))

    def ipuVersion(self, version):
        """Simulated IPU generation: "ipu1" (Mk1), "ipu2" (Mk2, default) or "ipu21" (Bow)."""
        if version not in IPU_VERSIONS:
            raise ValueError(f"Unknown IPU version {version!r}: expected ipu1, ipu2 or ipu21")
        return self._set("ipuVersion", IPU_VERSIONS[version])

    def enableExecutableCaching(self, path):
        """Cache compiled executables under the directory ``path`` (None disables caching)."""
        return self._set("executableCachePath", None if path is None else _path("enableExecutableCaching", path))

    def logDir(self, log_dir):
        """Directory of the profile the wrapper's ``profile=True`` argument writes (``<logDir>/profile.json``;
        default: the current directory). ``enableProfiling`` names its own directory."""
        return self._set("logDir", _path("logDir", log_dir))

    def logCycleCount(self, log_cycle_count):
        """Record the simulated cycle count of each run: logged at DEBUG, read with PoplarExecutor.cycleCount()."""
        return self._set("logCycleCount", _bool("logCycleCount", log_cycle_count))

    def showCompilationProgressBar(self, show=True):
        """Show a progress bar while compiling (default True)."""
        return self._set("showCompilationProgressBar", _bool("showCompilationProgressBar", show))

    def setExecutionStrategy(self, strategy):
        """How the model's blocks run over IPUs: a PipelinedExecution (the default when blocks are used),
        ShardedExecution, SerialPhasedExecution or ParallelPhasedExecution."""
        if not isinstance(strategy, _blocks.STRATEGIES):
            names = ", ".join(f"poptorch.{s.__name__}" for s in _blocks.STRATEGIES)
            raise Error(f"setExecutionStrategy takes an execution strategy ({names}), got {strategy!r}")
        return self._set("executionStrategy", strategy)

    def _autoRecomputation(self, recomputation):
        """PopART's ``autoRecomputation`` (``_Popart.set("autoRecomputation", n)``, popart.RecomputationType):
        0 (None) keeps every activation for the backward pass; 1 (Standard) keeps the activations PopART's
        heuristic checkpoints (the smallest set of live activations in each of a series of intervals of the
        forward pass) and recomputes the others; 2 (NormOnly) recomputes only normalisation layers' outputs;
        3 (Pipeline) recomputes each stage's forward activations in its backward pass from the stage's inputs
        and ``recomputationCheckpoint`` values; 4 (RecomputeAll) recomputes every forward activation from the
        inputs and checkpoints afresh for each backward op that reads it, with no stage boundaries (see
        ``poptorch._recompute``)."""
        if isinstance(recomputation, bool) or not isinstance(recomputation, int) or not 0 <= recomputation <= 4:
            raise Error(f"autoRecomputation takes a popart.RecomputationType value 0-4, got {recomputation!r}")
        return self._set("autoRecomputation", recomputation)

    def autoRoundNumIPUs(self, auto_round=True):
        """Allocate a power-of-two number of IPUs when the model uses another number (else that is an error)."""
        return self._set("autoRoundNumIPUs", _bool("autoRoundNumIPUs", auto_round))

    def enableSyntheticData(self, enabled):
        """Disable host I/O: inputs are drawn from a normal distribution on the device (zeros for integer
        inputs) and outputs are not copied back (they are returned as zeros)."""
        return self._set("enableSyntheticData", _bool("enableSyntheticData", enabled))

    def maxRepeatLogs(self, number):
        """After ``number`` repetitions of the same log message, further repetitions are silenced."""
        number = _positive_int("maxRepeatLogs", number)
        _logging.set_max_repeats(number)
        return self._set("maxRepeatLogs", number)

    def modelName(self, name):
        """Name of the model in its logs and profiles (profiles go to ``<profile dir>/<name>/``)."""
        if not isinstance(name, str) or not name or os.sep in name:
            raise Error(f"modelName takes a non-empty name without {os.sep!r}, got {name!r}")
        return self._set("modelName", name)

    def connectionType(self, connection_type):
        """When to attach to the device: Always (at compile time, default), OnDemand (at the first run) or
        Never (compile only: running raises)."""
        return self._set("connectionType", _enum("connectionType", ConnectionType, connection_type))

    def syncPattern(self, sync_pattern):
        """The IPU sync pattern: the simulated device syncs all its tiles (SyncPattern.Full)."""
        sync_pattern = _enum("syncPattern", SyncPattern, sync_pattern)
        if sync_pattern != SyncPattern.Full:
            raise not_modelled(
                f"SyncPattern.{sync_pattern.name}", "the simulated device only syncs with SyncPattern.Full"
            )
        return self._set("syncPattern", sync_pattern)

    def enableStableNorm(self, enabled):
        """Stable (two-pass) variance in norm layers; the simulator always computes it that way."""
        return self._set("enableStableNorm", _bool("enableStableNorm", enabled))

    def enableProfiling(self, profile_dir=None):
        """Write the simulated profile (profile.json) after compiling, into ``profile_dir`` (default: the current
        directory, as PopTorch) under a sub-directory named by modelName (default: training or inference)."""
        return self._set("profileDir", "." if profile_dir is None else _path("enableProfiling", profile_dir))

    def disableModuleNamescope(self):
        """Do not prefix the names of the forward pass's values (``getTensorNames()``) with their modules'
        names: ``MatMul:0`` rather than ``fc1/MatMul:0``."""
        return self._set("moduleNamescope", False)

    def updatableNamedBuffers(self, buffers):
        """Names of the buffers ``PoplarExecutor.copyNamedBuffersToDevice()`` uploads."""
        if isinstance(buffers, str) or not all(isinstance(b, str) for b in buffers):
            raise Error(f"updatableNamedBuffers takes a list of buffer names, got {buffers!r}")
        return self._set("updatableNamedBuffers", tuple(buffers))

    def relaxOptimizerAttributesChecks(self, relax=True):
        """Report the attributes an optimizer given to setOptimizer() gained after compilation (which the
        compiled update ignores) at DEBUG instead of as warnings."""
        return self._set("relaxOptimizerAttributesChecks", _bool("relaxOptimizerAttributesChecks", relax))

    def sourceLocationExcludes(self, excludes):
        """Path fragments of files skipped when errors name the user's source line, besides torch's and
        poptorch's own files (which are always skipped)."""
        if isinstance(excludes, str) or not all(isinstance(e, str) for e in excludes):
            raise Error(f"sourceLocationExcludes takes a list of path fragments, got {excludes!r}")
        return self._set("sourceLocationExcludes", tuple(excludes))

    def useOfflineIpuTarget(self, ipu_version=2):
        """Compile for an IPU of ``ipu_version`` (1, 2 or 21) without attaching to a device
        (ConnectionType.Never)."""
        self.ipuVersion(ipu_version)
        return self.connectionType(ConnectionType.Never)

    def useIpuId(self, ipu_id):
        """Run on the device of id ``ipu_id`` of the simulated IPU-POD16, as ``gc-info`` numbers them: 0 to 15
        are single IPUs, 16 to 23 pairs, 24 to 27 groups of 4, 28 and 29 groups of 8, and 30 all 16 IPUs. The
        device must have at least the model's IPUs times the replication factor (a larger one leaves some
        unused, with a warning); the IPU model ignores the id and an offline target refuses it."""
        return self._set("ipuId", _device_ids.device(ipu_id).id)

    def setAvailableMemoryProportion(self, available_memory_proportion):
        """The share (0 to 1) of each tile's memory the matmul and convolution plans of an IPU may use for
        temporary data, per IPU, e.g. ``{"IPU0": 0.5}`` (default 0.6; ``poptorch.set_available_memory``
        overrides it for one op). A lower proportion gives plans with less temporary memory and usually
        more cycles."""
        if not isinstance(available_memory_proportion, dict):
            raise Error(
                'setAvailableMemoryProportion takes a dictionary such as {"IPU0": 0.5}, '
                f"got {available_memory_proportion!r}"
            )
        proportions = {}
        for key, proportion in available_memory_proportion.items():
            if not isinstance(key, str) or not key.startswith("IPU") or not key[3:].isdigit():
                raise Error(
                    'Available memory proportions are expected to be in a dictionary of {"IPU0": 0.5} where the 0 '
                    f"in IPU is the index of the IPU. Invalid key: {key}"
                )
            check_proportion(proportion, f"setAvailableMemoryProportion({key!r})")
            proportions[int(key[3:])] = float(proportion)
        return self._set("availableMemoryProportion", tuple(sorted(proportions.items())))

    def anchorTensor(self, short_name, long_name, output_mode=None, output_return_period=1):
        """Stream the graph tensor PopART names ``long_name`` to the host after each run, to read it with
        ``getAnchoredTensor(short_name)``: an input (``input``, ``input/1``...), a value of the forward pass
        (``fc1/MatMul:0``), a parameter ``model.<fqn>``, its gradient ``Gradient___model.<fqn>``, its value
        after the optimizer step ``UpdatedVar___model.<fqn>``, its optimizer state, accumulated gradient or
        hyper-parameters (``getTensorNames()`` lists them all). ``output_mode`` (default: the model's output
        mode) selects which of a call's values are returned; ``output_return_period`` is used only with
        ``OutputMode.EveryN``."""
        for name, value in (("short_name", short_name), ("long_name", long_name)):
            if not isinstance(value, str) or not value:
                raise Error(f"anchorTensor's {name} must be a non-empty string, got {value!r}")
        if output_mode is not None:
            output_mode = _enum("anchorTensor's output_mode", OutputMode, output_mode)
        if output_mode == OutputMode.EveryN:
            output_return_period = _positive_int("output_return_period", output_return_period)
        else:
            output_return_period = 1
        requests = [r for r in self._values["anchoredTensors"] if r[0] != short_name]
        return self._set("anchoredTensors", (*requests, (short_name, long_name, output_mode, output_return_period)))

    # -- read side (PopTorch's snake_case properties) -------------------------------------------
    @property
    def execution_strategy(self):
        return self._values["executionStrategy"]

    @property
    def recomputation(self):
        """The recomputation mode: "none", "standard", "norm_only", "pipeline" or "all" (see
        ``_autoRecomputation``)."""
        return RECOMPUTATION[self._values["autoRecomputation"]]

    @property
    def auto_round_num_ipus(self):
        return self._values["autoRoundNumIPUs"]

    @property
    def device_iterations(self):
        return self._values["deviceIterations"]

    @property
    def replication_factor(self):
        return self._values["replicationFactor"]

    @property
    def broadcast_buffers(self):
        return self._values["broadcastBuffers"]

    @property
    def input_replica_groups(self):
        """The input group of each replica (``inputReplicaGrouping``), as a list of group indices."""
        return replica_groups(
            "inputReplicaGrouping",
            self._values["inputGroupType"],
            self._values["inputGroupSize"],
            self.replication_factor,
        )

    @property
    def input_replication_factor(self):
        """Replicas with distinct inputs: a call's inputs hold this many micro-batches per iteration."""
        return max(self.input_replica_groups) + 1

    @property
    def output_mode(self):
        return self._values["outputMode"]

    @property
    def output_return_period(self):
        return self._values["outputReturnPeriod"]

    @property
    def anchored_tensors(self):
        """The anchorTensor requests: (short name, long name, OutputMode or None, return period)."""
        return self._values["anchoredTensors"]

    @property
    def random_seed(self):
        return self._values["randomSeed"]

    @property
    def ipu_version(self):
        return self._values["ipuVersion"]

    @property
    def executable_cache_dir(self):
        return self._values["executableCachePath"]

    @property
    def log_dir(self):
        return self._values["logDir"]

    @property
    def available_memory_proportion(self):
        """{IPU index: proportion} set by ``setAvailableMemoryProportion``."""
        return dict(self._values["availableMemoryProportion"])

    @property
    def allow_out_of_memory(self):
        """Poplar's debug.allowOutOfMemory: popsim compiles with relax_memory."""
        return self._values["allowOutOfMemory"]

    @property
    def log_cycle_count(self):
        return self._values["logCycleCount"]

    @property
    def module_namescope(self):
        return self._values["moduleNamescope"]

    @property
    def relax_optimizer_attributes_checks(self):
        return self._values["relaxOptimizerAttributesChecks"]

    @property
    def show_compilation_progress_bar(self):
        return self._values["showCompilationProgressBar"]

    @property
    def enable_synthetic_data(self):
        return self._values["enableSyntheticData"]

    @property
    def use_ipu_model(self):
        return self._values["useIpuModel"]

    @property
    def ipu_id(self):
        return self._values["ipuId"]

    @property
    def connection_type(self):
        return self._values["connectionType"]

    @property
    def model_name(self):
        return self._values["modelName"]

    @property
    def profile_dir(self):
        return self._values["profileDir"]

    @property
    def updatable_named_buffers(self):
        return self._values["updatableNamedBuffers"]

    @property
    def source_location_excludes(self):
        return self._values["sourceLocationExcludes"]

    def defaultOutputMode(self):
        """True while the output mode is OutputMode.Default."""
        return self._values["outputMode"] == OutputMode.Default

    def defaultAnchorMode(self):
        """PopTorch's older name for :meth:`defaultOutputMode`."""
        return self.defaultOutputMode()

    def _compile_key(self):
        """The options that change the compiled program, for the executable cache."""
        key = {k: str(self._values[k]) for k in COMPILE_KEYS}
        # Phased Liveness moves activations to streaming memory without changing the graphs.
        key["liveness"] = str(_blocks.spill_mode(self.execution_strategy))
        # Overlapping the transfers with the neighbouring phases holds their tensors longer on the tiles.
        key["overlapStreaming"] = str(_blocks.overlaps_streaming(self.execution_strategy))
        # Whether the passes share the last phase decides how often its streamed variables are loaded.
        key["sharedPhase"] = str(_blocks.shares_last_phase(self.execution_strategy))
        # The strategy decides the step's schedule (pipelined or not) and the profile saved with the executable.
        strategy = self.execution_strategy
        key["executionStrategy"] = type(strategy).__name__ if strategy is not None else "PipelinedExecution"
        return key


def _env_flag(variable):
    value = os.environ[variable].strip().lower()
    if value not in _ENV_FLAGS:
        raise Error(
            f"The environment variable {variable} must be 1 or 0 (or true / false), got {os.environ[variable]!r}"
        )
    return _ENV_FLAGS[value]
