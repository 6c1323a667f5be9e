"""``poptorch.Options``: every knob of a wrapped model, grouped like PopTorch's (Training, Precision, ...).

Setters are camelCase, return ``self`` (so calls chain) and refuse to run once the options are frozen by
a wrapper or a DataLoader. Values live in one flat dict keyed by dotted names ("Training.gradientAccumulation");
the snake_case properties are the read side that PopTorch code (and popdata) use.
"""

import ast
import copy
import json
import os

import torch

from poptorch.enums import MeanReductionStrategy, OutputMode, ReductionType
from poptorch.errors import Error

IPU_VERSIONS = {"ipu1": "ipu1", "ipu2": "ipu2", "ipu21": "ipu21", 1: "ipu1", 2: "ipu2", 21: "ipu21"}

_DEFAULTS = {
    "deviceIterations": 1,
    "replicationFactor": 1,
    "outputMode": OutputMode.Default,
    "outputReturnPeriod": 1,
    "randomSeed": None,
    "useIpuModel": False,
    "executableCachePath": None,
    "ipuVersion": "ipu2",
    "logDir": None,
    "logCycleCount": False,
    "showCompilationProgressBar": True,
    "executionStrategy": None,
    "autoRoundNumIPUs": False,
    "enableSyntheticData": False,
    "Training.gradientAccumulation": 1,
    "Training.accumulationAndReplicationReductionType": ReductionType.Mean,
    "Training.meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy.Post,
    "Precision.partialsType": "float32",
    "Precision.stochasticRounding": False,
    "Precision.floatingPointExceptions": False,
    "Precision.runningStatisticsAlwaysFloat": True,
    "Distributed.processId": 0,
    "Distributed.numProcesses": 1,
    "TensorLocations.numIOTiles": 0,
}

# Options that change the compiled program; they (with the graphs) key the executable cache.
COMPILE_KEYS = (
    "replicationFactor",
    "ipuVersion",
    "Training.gradientAccumulation",
    "Training.accumulationAndReplicationReductionType",
    "Training.meanAccumulationAndReplicationReductionStrategy",
    "Precision.partialsType",
    "Precision.stochasticRounding",
    "TensorLocations.numIOTiles",
)

_PARTIALS = {torch.float32: "float32", torch.float16: "float16", "float": "float32", "half": "float16"}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Error(f"{name} must be a positive integer, got {value!r}")
    return value


class _Group:
    """A named group of options (``opts.Training``...) writing into its owner's store."""

    _prefix = ""

    def __init__(self, owner):
        self._owner = owner

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
        if reduction_type not in (ReductionType.Mean, ReductionType.Sum):
            raise Error(
                f"accumulationAndReplicationReductionType must be ReductionType.Mean or Sum, not {reduction_type}"
            )
        return self._set("accumulationAndReplicationReductionType", ReductionType(reduction_type))

    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy):
        """When a Mean reduction divides (MeanReductionStrategy); the results are the same up to rounding."""
        return self._set("meanAccumulationAndReplicationReductionStrategy", MeanReductionStrategy(strategy))

    @property
    def gradient_accumulation(self):
        return self._get("gradientAccumulation")

    @property
    def accumulation_and_replication_reduction_type(self):
        return self._get("accumulationAndReplicationReductionType")


class _PrecisionOptions(_Group):
    """``opts.Precision``: partials type and floating-point behaviour."""

    _prefix = "Precision"

    def setPartialsType(self, dtype):
        """Type of matmul/convolution partials: torch.float (default) or torch.half."""
        if dtype not in _PARTIALS:
            raise ValueError(f"setPartialsType accepts torch.float or torch.half, not {dtype!r}")
        return self._set("partialsType", _PARTIALS[dtype])

    def enableStochasticRounding(self, enabled):
        """Stochastic rounding of half-precision results."""
        return self._set("stochasticRounding", bool(enabled))

    def enableFloatingPointExceptions(self, enabled):
        """Trap on floating-point overflow, invalid operation and division by zero."""
        return self._set("floatingPointExceptions", bool(enabled))

    def runningStatisticsAlwaysFloat(self, enabled):
        """Keep batch-norm running statistics in float32 even in a half model."""
        return self._set("runningStatisticsAlwaysFloat", bool(enabled))

    @property
    def partials_type(self):
        return self._get("partialsType")


class _DistributedOptions(_Group):
    """``opts.Distributed``: this process's place among several host processes."""

    _prefix = "Distributed"

    def configureProcessId(self, process_id, num_processes):
        """Declare this process as ``process_id`` of ``num_processes``."""
        _positive_int("numProcesses", num_processes)
        if not 0 <= process_id < num_processes:
            raise Error(f"processId must be in [0, {num_processes}), got {process_id}")
        self._set("processId", process_id)
        return self._set("numProcesses", num_processes)

    @property
    def processId(self):
        return self._get("processId")

    @property
    def numProcesses(self):
        return self._get("numProcesses")


class _TensorLocationOptions(_Group):
    """``opts.TensorLocations``: where tensors live (I/O tiles)."""

    _prefix = "TensorLocations"

    def numIOTiles(self, num_tiles):
        """Tiles reserved for overlapping I/O: an even number from 32 to 192."""
        if not isinstance(num_tiles, int) or num_tiles % 2 or not 32 <= num_tiles <= 192:
            raise Error("numIOTiles must be an even number between 32 and 192.")
        return self._set("numIOTiles", num_tiles)


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


class Options:
    """Options of a wrapped model (the PopTorch 3.x API)."""

    def __init__(self):
        self._values = dict(_DEFAULTS)
        self._frozen = False
        self.Training = _TrainingOptions(self)
        self.Precision = _PrecisionOptions(self)
        self.Distributed = _DistributedOptions(self)
        self.TensorLocations = _TensorLocationOptions(self)
        self.Jit = _JitOptions(self)
        if os.environ.get("POPTORCH_CACHE_DIR"):
            self._values["executableCachePath"] = os.environ["POPTORCH_CACHE_DIR"]
        if os.environ.get("POPTORCH_IPU_MODEL_VERSION"):
            self.ipuVersion(os.environ["POPTORCH_IPU_MODEL_VERSION"])
        if os.environ.get("POPTORCH_DEFAULT_OPTIONS"):
            self._apply_dict(json.loads(os.environ["POPTORCH_DEFAULT_OPTIONS"]))

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

    def _apply_dict(self, settings, prefix=""):
        for name, value in settings.items():
            if isinstance(value, dict):
                self._apply_dict(value, f"{prefix}{name}.")
            else:
                self._call(f"{prefix}{name}", value if isinstance(value, list) else [value])

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
        return {
            k: (v.name if isinstance(v, OutputMode | ReductionType | MeanReductionStrategy) else v)
            for k, v in self._values.items()
        }

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
                    self._call(ast.unparse(call.func), [ast.literal_eval(a) for a in call.args])
                except (SyntaxError, ValueError) as exc:
                    raise Error(f"{filepath}:{number}: cannot parse option {line!r}: {exc}") from None
        return self

    # -- setters --------------------------------------------------------------------------------
    def deviceIterations(self, device_iterations):
        """Optimizer steps (training) or micro-batches (inference) run per call."""
        return self._set("deviceIterations", _positive_int("deviceIterations", device_iterations))

    def replicationFactor(self, replication_factor):
        """Number of replicas; simulated as micro-batches whose gradients are reduced together."""
        return self._set("replicationFactor", _positive_int("replicationFactor", replication_factor))

    def outputMode(self, output_mode, output_return_period=None):
        """Which outputs a call returns: OutputMode.All, Final, Sum, EveryN (needs a period) or Default."""
        output_mode = OutputMode(output_mode)
        if output_mode == OutputMode.EveryN:
            _positive_int("output_return_period", output_return_period)
        elif output_return_period is not None:
            raise ValueError("output_return_period is only used with OutputMode.EveryN")
        self._set("outputMode", output_mode)
        return self._set("outputReturnPeriod", output_return_period or 1)

    def randomSeed(self, random_seed):
        """Seed of on-device randomness; also seeds torch on the host."""
        if not isinstance(random_seed, int) or random_seed < 0:
            raise ValueError(f"randomSeed must be a non-negative integer, got {random_seed!r}")
        torch.manual_seed(random_seed)
        return self._set("randomSeed", random_seed)

    def useIpuModel(self, use_model):
        """Accepted for compatibility: the device is always the simulated IPU."""
        return self._set("useIpuModel", bool(use_model))

    def ipuVersion(self, version):
        """Simulated IPU generation: "ipu1" (Mk1), "ipu2" (Mk2, default) or "ipu21" (Bow)."""
        if version not in IPU_VERSIONS:
            raise ValueError(f"Unknown IPU version {version!r}: expected ipu1, ipu2 or ipu21")
        return self._set("ipuVersion", IPU_VERSIONS[version])

    def enableExecutableCaching(self, path):
        """Cache compiled executables under ``path`` (None disables caching)."""
        return self._set("executableCachePath", None if path is None else str(path))

    def logDir(self, log_dir):
        """Directory for profiles and logs written by the model."""
        return self._set("logDir", str(log_dir))

    def logCycleCount(self, log_cycle_count):
        """Record the simulated cycle count of each run (read with PoplarExecutor.cycleCount())."""
        return self._set("logCycleCount", bool(log_cycle_count))

    def showCompilationProgressBar(self, show):
        """Show a progress bar while compiling (default True)."""
        return self._set("showCompilationProgressBar", bool(show))

    def setExecutionStrategy(self, strategy):
        """How multi-IPU blocks execute (PipelinedExecution by default)."""
        return self._set("executionStrategy", strategy)

    def autoRoundNumIPUs(self, auto_round):
        """Round the number of IPUs up to a power of two."""
        return self._set("autoRoundNumIPUs", bool(auto_round))

    def enableSyntheticData(self, enabled):
        """Skip host transfers (inputs are zeros on the device)."""
        return self._set("enableSyntheticData", bool(enabled))

    # -- read side (PopTorch's snake_case properties) -------------------------------------------
    @property
    def device_iterations(self):
        return self._values["deviceIterations"]

    @property
    def replication_factor(self):
        return self._values["replicationFactor"]

    @property
    def output_mode(self):
        return self._values["outputMode"]

    @property
    def output_return_period(self):
        return self._values["outputReturnPeriod"]

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
    def log_cycle_count(self):
        return self._values["logCycleCount"]

    @property
    def show_compilation_progress_bar(self):
        return self._values["showCompilationProgressBar"]

    @property
    def enable_synthetic_data(self):
        return self._values["enableSyntheticData"]

    def defaultOutputMode(self):
        """True while the output mode is OutputMode.Default."""
        return self._values["outputMode"] == OutputMode.Default

    def _compile_key(self):
        """The options that change the compiled program, for the executable cache."""
        return {k: str(self._values[k]) for k in COMPILE_KEYS}
