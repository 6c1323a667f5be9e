"""poptorch: run unmodified PyTorch models on a simulated Graphcore IPU (the PopTorch 3.x API)."""

import warnings
from importlib.metadata import version as _version

import torch

from popdata import AsynchronousDataAccessor, DataLoader, DataLoaderMode, SharingStrategy
from poptorch import experimental, optim, profiling, testing
from poptorch._attributes import Attribute
from poptorch._autocast import autocast
from poptorch._blocks import (
    IPU,
    AutoStage,
    BeginBlock,
    Block,
    BlockFunction,
    Liveness,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    recomputationCheckpoint,
    removeBlocks,
)
from poptorch._cluster_ops import fps, nearest
from poptorch._ctc_decoder import ctc_beam_search_decoder
from poptorch._custom_op import custom_op
from poptorch._executor import PoplarExecutor
from poptorch._executor_api import (
    ICustomArgParser,
    hasMLIRSupportOnPlatform,
    hasMlirSupportOnPlatform,
    ipuHardwareIsAvailable,
    ipuHardwareVersion,
    isRunningOnIpu,
    registerCustomArgParser,
    registerPostCompileHook,
    registerPreCompileHook,
)
from poptorch._host_io_ops import CPU, MultiConv, set_overlap_for_input, set_overlap_for_output
from poptorch._logging import logger
from poptorch._logging import set_level as _set_level
from poptorch._losses import identity_loss, ipu_print_tensor
from poptorch._memory import serializedMatMul, set_available_memory
from poptorch._poptorch_ops import NameScope, cond, dynamic_slice, dynamic_update, for_loop, nop
from poptorch._precompiled import load
from poptorch.enums import (
    AnchorMode,
    CommGroupType,
    ConnectionType,
    HalfFloatCastingBehavior,
    MatMulSerializationMode,
    MeanReductionStrategy,
    MultiConvPlanType,
    OutputMode,
    OverlapMode,
    ReductionType,
    SyncPattern,
    VariableRetrievalMode,
)
from poptorch.errors import Error, RecoverableError, UnrecoverableError, UnsupportedOpError
from poptorch.options import ConfigFileError, Options, TensorLocationSettings

__version__ = _version("poptorch")

_LEGACY_TRAINING = (
    "device_iterations",
    "gradient_accumulation",
    "replication_factor",
    "profile",
    "trace_model",
    "loss",
    "optimizer",
)
_LEGACY_INFERENCE = ("device_iterations", "replication_factor", "profile", "trace_model")


def trainingModel(model, options=None, *args, optimizer=None, **legacy_kwargs):
    """Wrap ``model`` for training on the IPU: each call runs forward, backward and the optimizer step.

    Call as ``trainingModel(model, options=None, optimizer=None)``; ``optimizer`` defaults to
    ``poptorch.optim.SGD(lr=0.01)``. The old signature ``trainingModel(model, device_iterations,
    gradient_accumulation=1, replication_factor=1, profile=False, trace_model=True, loss=None,
    optimizer=None)`` is still accepted, with a DeprecationWarning.
    """
    if _is_legacy(options, (), legacy_kwargs, _LEGACY_TRAINING):
        legacy_kwargs.setdefault("optimizer", optimizer)
        return _legacy(model, True, (options, *args), legacy_kwargs, _LEGACY_TRAINING)
    if len(args) > 1:
        raise TypeError("trainingModel(model, options=None, optimizer=None) takes at most 3 positional arguments")
    if args:
        optimizer = args[0]
    return PoplarExecutor(model, options if options is not None else Options(), True, optimizer)


def inferenceModel(model, options=None, *legacy_args, **legacy_kwargs):
    """Wrap ``model`` for inference on the IPU.

    The old signature ``inferenceModel(model, device_iterations=1, replication_factor=1, profile=False,
    trace_model=True)`` is still accepted, with a DeprecationWarning.
    """
    if _is_legacy(options, legacy_args, legacy_kwargs, _LEGACY_INFERENCE):
        return _legacy(model, False, (options, *legacy_args), legacy_kwargs, _LEGACY_INFERENCE)
    return PoplarExecutor(model, options if options is not None else Options(), False)


def setLogLevel(level):
    """Set poptorch's log level: TRACE_ALL, TRACE, DEBUG, INFO, WARN (default), ERR or OFF (or PopTorch's
    legacy integers 0-6); the environment variable POPTORCH_LOG_LEVEL sets the initial level."""
    _set_level(level)


def _is_legacy(options, args, kwargs, names):
    return isinstance(options, int) or bool(args) or any(k in names for k in kwargs)


def _legacy(model, training, args, kwargs, names):
    warnings.warn(
        f"This {'trainingModel' if training else 'inferenceModel'} signature is deprecated: pass a "
        "poptorch.Options instead of device_iterations, replication_factor, ...",
        DeprecationWarning,
        stacklevel=3,
    )
    values = dict(zip(names, args))
    values.update(kwargs)
    values = {k: v for k, v in values.items() if v is not None}
    unknown = set(values) - set(names)
    if unknown:
        raise TypeError(f"Unexpected arguments: {', '.join(sorted(unknown))}")
    opts = Options().deviceIterations(values.get("device_iterations", 1))
    opts.replicationFactor(values.get("replication_factor", 1))
    opts.Training.gradientAccumulation(values.get("gradient_accumulation", 1))
    if values.get("loss") is not None:
        model = _WithLoss(model, values["loss"])
    executor = PoplarExecutor(model, opts, training, values.get("optimizer"))
    executor._write_profile = bool(values.get("profile"))
    executor._sync_after_call = values.get("loss") is not None
    return executor


class _WithLoss(torch.nn.Module):
    """The legacy ``loss=`` argument: the model's output and ``loss(output, label)``, the label last."""

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args):
        *inputs, label = args
        output = self.model(*inputs)
        return output, self.loss(output, label)


__all__ = [
    "AnchorMode",
    "AsynchronousDataAccessor",
    "Attribute",
    "CommGroupType",
    "ConfigFileError",
    "AutoStage",
    "BeginBlock",
    "Block",
    "BlockFunction",
    "IPU",
    "Liveness",
    "MatMulSerializationMode",
    "ParallelPhasedExecution",
    "Phase",
    "PipelinedExecution",
    "SerialPhasedExecution",
    "SharingStrategy",
    "ShardedExecution",
    "Stage",
    "TensorLocationSettings",
    "recomputationCheckpoint",
    "removeBlocks",
    "serializedMatMul",
    "set_available_memory",
    "CPU",
    "MultiConv",
    "MultiConvPlanType",
    "OverlapMode",
    "ctc_beam_search_decoder",
    "custom_op",
    "set_overlap_for_input",
    "set_overlap_for_output",
    "ConnectionType",
    "DataLoader",
    "DataLoaderMode",
    "Error",
    "ICustomArgParser",
    "HalfFloatCastingBehavior",
    "MeanReductionStrategy",
    "NameScope",
    "Options",
    "OutputMode",
    "PoplarExecutor",
    "RecoverableError",
    "ReductionType",
    "SyncPattern",
    "UnrecoverableError",
    "UnsupportedOpError",
    "VariableRetrievalMode",
    "__version__",
    "autocast",
    "cond",
    "dynamic_slice",
    "dynamic_update",
    "experimental",
    "for_loop",
    "fps",
    "identity_loss",
    "inferenceModel",
    "hasMLIRSupportOnPlatform",
    "hasMlirSupportOnPlatform",
    "ipuHardwareIsAvailable",
    "ipuHardwareVersion",
    "isRunningOnIpu",
    "load",
    "logger",
    "nearest",
    "nop",
    "ipu_print_tensor",
    "optim",
    "profiling",
    "registerCustomArgParser",
    "registerPostCompileHook",
    "registerPreCompileHook",
    "setLogLevel",
    "testing",
    "trainingModel",
]
