"""PopTorch's executor queries and workflow hooks that sit beside the run loop.

``ExecutorQueries`` is mixed into ``PoplarExecutor``: compilation time, the simulated latencies of the
last call, the device's random-number state, named-buffer uploads and on-demand host syncs. The
module-level functions are PopTorch's: ``isRunningOnIpu``, hardware queries, compile hooks and custom
argument parsers.
"""

import abc
import collections
import contextlib
import time

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

import popsim
from poptorch import _anchors, _precompiled, _weights
from poptorch._training import RNG_SEED
from poptorch.enums import ConnectionType
from poptorch.errors import Error

# OrderedDicts: RemovableHandle keeps a weak reference to its dict, which a plain dict does not allow.
_PRE_COMPILE_HOOKS = collections.OrderedDict()
_POST_COMPILE_HOOKS = collections.OrderedDict()
# (capturing for the IPU, capturing a training model, its Options) while a model is being captured.
_CAPTURE = [(False, False, None)]
NO_HARDWARE = (
    "No IPU hardware available on this system: the model runs on the simulated IPU "
    "(poptorch.ipuHardwareIsAvailable() is False)"
)


# -- module-level API ------------------------------------------------------------------------------
def isRunningOnIpu():
    """True while the model's forward is being captured for the IPU, False when it runs on the CPU.

    A model can take an IPU-specific branch: ``if poptorch.isRunningOnIpu(): ...``."""
    return _CAPTURE[-1][0]


def capturing_training():
    """True while a trainingModel's forward is being captured."""
    return _CAPTURE[-1][1]


def capturing_options():
    """The Options of the model being captured (None outside a capture)."""
    return _CAPTURE[-1][2]


@contextlib.contextmanager
def running_on_ipu(training, options=None):
    """Inside: ``isRunningOnIpu()`` is True (the model is being captured for the device, with ``options``)."""
    _CAPTURE.append((True, training, options))
    try:
        yield
    finally:
        _CAPTURE.pop()


def ipuHardwareIsAvailable(num_ipus=1):
    """Whether ``num_ipus`` physical IPUs are present: never, the device is simulated."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int) or num_ipus < 1:
        raise Error(f"ipuHardwareIsAvailable takes a positive number of IPUs, got {num_ipus!r}")
    return False


def ipuHardwareVersion():
    """The physical IPU's version; raises, as PopTorch does on a machine without IPU hardware."""
    raise Error(NO_HARDWARE)


def hasMlirSupportOnPlatform():
    """Whether PopTorch's MLIR compiler (``poptorch.experimental.IPUScope``, ``enums.Compiler.MLIR``) can run
    here: never, the simulator compiles through its own IR only. Scripts that gate MLIR-only code on this
    skip it, as they do on platforms PopTorch built without MLIR."""
    return False


# PopTorch's releases spell the query both ways.
hasMLIRSupportOnPlatform = hasMlirSupportOnPlatform


def registerPreCompileHook(hook):
    """Call ``hook()`` before every model compilation; returns a handle whose ``remove()`` unregisters it."""
    return _register(_PRE_COMPILE_HOOKS, hook)


def registerPostCompileHook(hook):
    """Call ``hook()`` after every model compilation; returns a handle whose ``remove()`` unregisters it."""
    return _register(_POST_COMPILE_HOOKS, hook)


def _register(hooks, hook):
    if not callable(hook):
        raise Error(f"A compile hook must be callable, got {hook!r}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


@contextlib.contextmanager
def compile_hooks():
    """Run the registered pre-compile hooks, then the body (a compilation), then the post-compile hooks."""
    for hook in list(_PRE_COMPILE_HOOKS.values()):
        hook()
    yield
    for hook in list(_POST_COMPILE_HOOKS.values()):
        hook()


class ICustomArgParser(abc.ABC):
    """How a model input of a custom type is taken apart into tensors and rebuilt from them."""

    @abc.abstractmethod
    def yieldTensors(self, struct):
        """Yield the tensors of ``struct`` in a fixed order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator):
        """A copy of ``original_structure`` taking its tensors, in the same order, from ``tensor_iterator``."""


def registerCustomArgParser(cls, parser):
    """Accept inputs of type ``cls``: ``parser`` (an ICustomArgParser) says which tensors they hold.

    The type is registered as a pytree node, so capture and every later call flatten it the same way."""
    if not isinstance(parser, ICustomArgParser):
        raise Error(f"registerCustomArgParser needs an ICustomArgParser instance, got {parser!r}")

    def flatten(struct):
        return list(parser.yieldTensors(struct)), _Template(struct)

    def flatten_with_keys(struct):
        tensors, template = flatten(struct)
        return [(pytree.SequenceKey(i), t) for i, t in enumerate(tensors)], template

    pytree.register_pytree_node(
        cls,
        flatten,
        lambda tensors, template: parser.reconstruct(template.struct, iter(tensors)),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


class _Template:
    """The original structure as a pytree context: equal when its type is, so later calls match capture."""

    def __init__(self, struct):
        self.struct = struct

    def __eq__(self, other):
        return isinstance(other, _Template) and type(other.struct) is type(self.struct)

    def __hash__(self):
        return hash(type(self.struct))

    def __deepcopy__(self, memo):
        # torch.export deep-copies tree specs while the inputs are fake tensors; a template is never mutated.
        return self

    def __repr__(self):
        return f"<{type(self.struct).__name__}>"


# -- executor methods ------------------------------------------------------------------------------
class ExecutorQueries:
    """Methods of PoplarExecutor that only read or write device state through the executable."""

    _compile_seconds = None
    _run_cycles = None
    _io_bytes = None

    def compilationTime(self):
        """Wall-clock seconds the last compilation took (capture, autodiff, passes and popsim's compile)."""
        if self._compile_seconds is None:
            raise Error("The model has not been compiled yet: call it or compile() first")
        return self._compile_seconds

    def _latencies(self, part):
        """(min, max, mean) seconds of ``part`` over the micro-batch runs of the last call."""
        if not self._run_cycles:
            raise Error("Run the model at least once before reading its latency")
        target = self._exe.profile.target
        host_ipu, ipu_host = (popsim.cost.host_cycles(target, n) for n in self._io_bytes)
        parts = {
            "total": lambda cycles: cycles,
            "host_ipu": lambda cycles: host_ipu,
            "ipu_host": lambda cycles: ipu_host,
            "compute": lambda cycles: cycles - host_ipu - ipu_host,
        }
        seconds = [parts[part](cycles) / target.clock_hz for cycles in self._run_cycles]
        return (min(seconds), max(seconds), float(np.mean(seconds)))

    def getLatency(self):
        """(min, max, average) simulated seconds of a micro-batch run of the last call, host to host."""
        return self._latencies("total")

    def getHostIpuLatency(self):
        """(min, max, average) simulated seconds streaming a micro-batch's inputs to the device."""
        return self._latencies("host_ipu")

    def getComputeLatency(self):
        """(min, max, average) simulated seconds of a micro-batch's computation on the device."""
        return self._latencies("compute")

    def getIpuHostLatency(self):
        """(min, max, average) simulated seconds streaming a micro-batch's outputs back to the host."""
        return self._latencies("ipu_host")

    @property
    def rng_state(self):
        """The device's random-number state (a list of ints); assign a saved state to replay randomness."""
        return [int(v) for v in np.array(self._exe.read_variable(RNG_SEED)).ravel()] if self._has_rng() else []

    @rng_state.setter
    def rng_state(self, state):
        if not self._has_rng():
            raise Error("The model draws no random numbers on the device: it has no rng_state to set")
        array = np.array(state, dtype=np.int64)
        if array.shape != (2,):
            raise Error(f"rng_state must be the 2 integers read from rng_state, got {state!r}")
        self._exe.write_variable(RNG_SEED, array.astype(np.int32))
        self._device.seeded = True

    def _has_rng(self):
        if self._exe is None:
            raise Error("The model must be compiled before its rng_state can be read or set")
        return RNG_SEED in self._exe.variables

    def copyNamedBuffersToDevice(self):
        """Upload the buffers named by Options.updatableNamedBuffers() from the host model to the device."""
        if self._exe is None:
            raise Error("The model must be compiled before buffers can be copied to the device")
        names = self._options.updatable_named_buffers
        if not names:
            raise Error("No buffers to copy: name them with Options.updatableNamedBuffers([...]) first")
        buffers = {name for name, _ in torch.nn.Module.named_buffers(self._model, remove_duplicate=False)}
        unknown = [n for n in names if n not in buffers or n not in self._device.tensors]
        if unknown:
            raise Error(f"updatableNamedBuffers names buffers the compiled model does not have: {', '.join(unknown)}")
        self._device.upload(names)

    def compileAndExport(self, filename, *args, export_model=True, **kwargs):
        """Compile for ``args`` / ``kwargs`` and save the executable to ``filename``; with ``export_model``
        the model, options and optimizer are saved too, for ``poptorch.load``."""
        self._check_arguments(args, kwargs)
        if self._exe is None:
            with compile_hooks():
                self._compile(args, kwargs)
        self._export(filename, args, kwargs, export_model)

    def save(self, filename, export_model=True):
        """Save the executable of a model already compiled (by a call or ``compile``) to ``filename``, as
        ``compileAndExport`` does; with ``export_model`` the model, options and optimizer too, for
        ``poptorch.load``. The file keeps zero inputs of the compiled shapes as its example inputs."""
        if self._exe is None:
            raise Error(
                "save() needs a compiled model: call the model (or model.compile(...)) first, or use "
                "compileAndExport(filename, *args)"
            )
        spec, signatures = self._compiled_inputs
        leaves = [torch.zeros(s.shape, dtype=s.dtype) if hasattr(s, "dtype") else s for s in signatures]
        args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
        self._export(filename, args, kwargs, export_model)

    def _export(self, filename, args, kwargs, export_model):
        model_state = None
        if export_model:
            self.copyWeightsToHost()
            model_state = {"model": self._model, "options": self._user_options._values, "optimizer": self._optimizer}
        _precompiled.export(filename, self._key, self._exe, (args, kwargs), self._training, model_state)

    def loadExecutable(self, filename):
        """Use the executable ``compileAndExport`` saved to ``filename`` instead of compiling this model."""
        self._load_exported(_precompiled.Exported(filename))

    def _load_exported(self, exported):
        if self._exe is not None:
            raise Error("The model is already compiled: call destroy() before loadExecutable()")
        if exported.header["training"] != self._training:
            kind = "trainingModel" if exported.header["training"] else "inferenceModel"
            raise Error(f"{exported.filename} holds a {kind}: wrap the model with poptorch.{kind}")
        args, kwargs = exported.inputs()
        self._check_arguments(args, kwargs)
        self._compile(args, kwargs, exported=exported)
        if not self._attached and self._options.connection_type == ConnectionType.Always:
            self.attachToDevice()

    def getTensorNames(self):
        """The PopART names of the compiled model's tensors that ``Options.anchorTensor`` can anchor: its
        inputs, the values of its forward pass, parameters and buffers (``model.<fqn>``) and, when training,
        each trained parameter's gradient, updated value, optimizer state, accumulated gradient (with
        gradient accumulation) and the optimizer's hyper-parameter tensors (see ``poptorch._anchors``)."""
        if self._anchors is None:
            raise AssertionError(_anchors.NOT_COMPILED)  # PopTorch's assertion, kept under python -O
        return list(self._anchors.names)

    def getAnchoredTensor(self, short_name):
        """The value of the tensor anchored as ``short_name`` (``Options.anchorTensor``) from the last run."""
        if short_name not in self._anchor_memory:  # also before the first run, as in PopTorch
            raise AssertionError(_anchors.NOT_FOUND.format(short_name))
        return self._anchor_memory[short_name]

    def copyWeightsToHostIfNeeded(self):
        """Copy the device's weights to the host if the host copy is out of date; True if it copied."""
        device = self._device
        if device is None or not any(_weights.record(t).holder is device for t in device.tensors.values()):
            return False
        self.copyWeightsToHost()
        return True


def record_compile_time(executor, started):
    """Store the seconds since ``started`` (time.perf_counter()) as the executor's compilation time."""
    executor._compile_seconds = time.perf_counter() - started


def record_run(executor, run_cycles, feeds, result):
    """Store a call's simulated cycles per micro-batch run and the bytes one run streams each way."""
    executor._run_cycles = run_cycles
    executor._io_bytes = (sum(a.nbytes for a in feeds.values()), sum(np.asarray(a).nbytes for a in result.values()))
