"""PopTorch ops about host transfers and host code in the middle of a model: ``set_overlap_for_input`` /
``set_overlap_for_output``, ``CPU`` host callbacks and ``MultiConv``.

Each runs as PopTorch's does on the CPU. Captured for the simulated IPU, what the simulator models is real
(``OverlapMode.NoOverlap`` marks nothing, the overlapping modes are ``poptorch._overlapped_io``; a ``CPU``
callback becomes a popir ``host_call`` the device runs by streaming its inputs to the host and the results
back; ``MultiConv``'s convolutions run as ordinary ones), and the rest is refused with an error saying it
is not modelled, never accepted and ignored.
"""

import contextlib
import functools
import uuid
import weakref

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.overrides import TorchFunctionMode

import popir
from poptorch import _memory, _overlapped_io, _poptorch_ops
from poptorch._executor_api import capturing_options, capturing_training, isRunningOnIpu
from poptorch.enums import MultiConvPlanType, OverlapMode
from poptorch.errors import Error
from poptorch.options import not_modelled


def _overlap(name, tensors, mode):
    if not isinstance(mode, OverlapMode):
        raise Error(f"{name}: mode must be a poptorch.OverlapMode, got {mode!r}")
    leaves = torch.utils._pytree.tree_leaves(tensors)
    bad = next((leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
    if bad is not None:
        raise Error(f"You may only set overlap for torch.tensor values. {type(bad)} is not supported.")
    if mode is OverlapMode.NoOverlap or not isRunningOnIpu():
        return tensors
    _overlapped_io.check_options(capturing_options())
    direction = _overlapped_io.INPUT if name == "set_overlap_for_input" else _overlapped_io.OUTPUT
    return torch.utils._pytree.tree_map(lambda t: _overlapped_io.set_overlap(t, mode.value, direction), tensors)


def set_overlap_for_input(input_tensors, mode):
    """Mark model inputs (a tensor or any tuple / list / dict of them) for host transfers that overlap
    compute, and return them; use the returned tensors. An overlapping mode needs I/O tiles
    (``TensorLocations.numIOTiles``) and a sharded or phased execution strategy."""
    return _overlap("set_overlap_for_input", input_tensors, mode)


def set_overlap_for_output(output_tensors, mode):
    """Mark model outputs for host transfers that overlap compute, and return them (as
    ``set_overlap_for_input``)."""
    return _overlap("set_overlap_for_output", output_tensors, mode)


# A CPU op's host-callback name is its ID and a random token (two ops may share an ID); a copied or unpickled
# op keeps its original's name, so each executable runs the ops of its own capture (collecting_host_callbacks).
# The ops each capture in progress meets: callback name -> op.
_COLLECTING = []
# callback name -> the CPU op last captured under it, for the popir interpreter. Weak: a host callback does
# not keep its model alive.
_CPU_OPS = weakref.WeakValueDictionary()


@contextlib.contextmanager
def collecting_host_callbacks():
    """Inside, the CPU ops a capture meets gather in the yielded {callback name: op}: the executor hands
    their functions to its executable (``host_callbacks``), so a wrapped model runs its own ops."""
    found = {}
    _COLLECTING.append(found)
    try:
        yield found
    finally:
        _COLLECTING.pop()


def _op_of(callback):
    """The CPU op named ``callback`` in the capture in progress (else the last one captured)."""
    return _COLLECTING[-1][callback] if _COLLECTING and callback in _COLLECTING[-1] else _CPU_OPS[callback]


def _callback_name(ID):  # noqa: N803 - PopTorch's argument name
    return f"{ID}#{uuid.uuid4().hex[:12]}"


def _run_registered(callback, *arrays):
    op = _CPU_OPS.get(callback)
    if op is None:
        raise Error(f"host callback {callback!r}: its poptorch.CPU op no longer exists; wrap the model again")
    return op.run_arrays(*arrays)


@torch.library.custom_op("poptorch::host_call", mutates_args=())
def _host_call(inputs: list[torch.Tensor], callback: str) -> list[torch.Tensor]:
    return [t.clone() for t in _op_of(callback).run_on_host(inputs)]


@_host_call.register_fake
def _host_call_fake(inputs, callback):
    # As PopTorch does, the function runs once on zeros of the inputs' shapes to learn its results' shapes.
    with unset_fake_temporarily():
        zeros = [torch.zeros(t.shape, dtype=t.dtype) for t in inputs]
        results = _op_of(callback).run_on_host(zeros)
    return [torch.empty(r.shape, dtype=r.dtype) for r in results]


class CPU:
    """Run ``layer_to_call`` on the host in the middle of a model (PopTorch: inference only). On the CPU the
    call goes straight through. In a model captured for the simulated IPU it is a host callback: the device
    streams the arguments (tensors) to the host, stops while the host runs the function, and streams its
    results (a tensor or a list / tuple of them) back; the profile shows both transfers. A function that
    raises stops the run with a ``poptorch.Error``."""

    def __init__(self, layer_to_call, ID):  # noqa: N803 - PopTorch's argument name
        if not callable(layer_to_call):
            raise Error(f"poptorch.CPU needs a callable to run on the host, got {type(layer_to_call).__name__}")
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._layer_to_call = layer_to_call
        self._ID = ID
        self._callback = _callback_name(ID)
        self._input_dtypes = None
        self._returns_sequence = False

    def run_on_host(self, inputs):
        """The function's results (a list of tensors) for a list of input tensors, without gradients."""
        with torch.no_grad():
            results = self._layer_to_call(*inputs)
        self._returns_sequence = isinstance(results, list | tuple)
        results = list(results) if self._returns_sequence else [results]
        if not results or not all(isinstance(r, torch.Tensor) for r in results):
            raise Error(f"poptorch.CPU({self._ID!r}): the function must return a tensor or a list of tensors")
        return results

    def run_arrays(self, *arrays):
        """The function's results as NumPy arrays for NumPy arguments (the device's host call)."""
        # The device holds int64 as int32: the function sees the dtypes it was captured with.
        inputs = [torch.from_numpy(np.array(a)).to(dtype) for a, dtype in zip(arrays, self._input_dtypes)]
        return [r.detach().numpy() for r in self.run_on_host(inputs)]

    def __call__(self, *args, **kwargs):
        if not isRunningOnIpu():
            return self._layer_to_call(*args, **kwargs)
        if capturing_training():
            raise Error(
                f"poptorch.CPU({self._ID!r}): CPU ops are only supported in inference graphs, as in PopTorch; "
                "run the host code before or after the training model's call"
            )
        if kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
            raise Error(f"poptorch.CPU({self._ID!r}): on the IPU the arguments must be tensors, passed by position")
        self._input_dtypes = [a.dtype for a in args]
        if _COLLECTING:
            _COLLECTING[-1][self._callback] = self
        _CPU_OPS[self._callback] = self
        popir.ops.register_host_callback(self._callback, functools.partial(_run_registered, self._callback))
        results = _host_call(list(args), self._callback)
        return results if self._returns_sequence else results[0]


# MultiConv settings the simulator honours as given: it plans each convolution alone over all the tiles and
# runs them one after another (a serial plan). Each convolution's available-memory proportion, dithering and
# partials type are honoured by its own plan (and its gradients').
_HONOURED_AS_GIVEN = frozenset({"availableMemoryProportions", "enableConvDithering", "partialsTypes"})
_MODELLED_SETTINGS = {
    "planType": (MultiConvPlanType.Serial,),
}
_REFUSAL_REASONS = {
    "planType": "the simulator plans each convolution alone and runs them one after another; use "
    "MultiConvPlanType.Serial or leave the plan type unset",
    "perConvReservedTiles": "the simulator runs the convolutions one after another over all the tiles, "
    "reserving none per convolution; remove the setting",
    "cycleBackOff": "the simulator's convolution planner does no cycle-bounded search; remove the setting",
}


def _per_conv(name, value, accepts, what):
    """One value for every convolution, or a non-empty list / tuple of one per convolution."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not values or not all(accepts(v) for v in values):
        raise Error(f"MultiConv.{name} takes {what} or a non-empty list of them (one per convolution), got {value!r}")
    return tuple(values)


def _shown(value):
    return f"{type(value).__name__}.{value.name}" if isinstance(value, MultiConvPlanType) else repr(value)


def _is_float(value):
    return isinstance(value, float)


_CONVOLUTIONS = frozenset(
    (torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d)
)


class _ConvolutionCount(TorchFunctionMode):
    """Counts the convolutions called while it is active (PopTorch's per-convolution settings must match).
    With ``proportions`` (one, or one per convolution), the i-th convolution's plan (and its gradients')
    takes at most its proportion of tile memory for temporary data, as ``set_available_memory`` does; with
    ``dithering`` or ``partials`` (likewise), it is dithered or not, and accumulates its float16 partials in
    that dtype, whatever the model's Training.setConvolutionDithering and Precision.setPartialsType say."""

    def __init__(self, proportions=None, dithering=None, partials=None):
        super().__init__()
        self.count = 0
        self._proportions = proportions
        self._dithering = dithering
        self._partials = partials

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func not in _CONVOLUTIONS:
            return result
        self.count += 1
        proportion, dithering, partials = (self._own(v) for v in (self._proportions, self._dithering, self._partials))
        if proportion is not None:
            result = _memory.set_available_memory(result, proportion)
        if partials is not None:
            result = _poptorch_ops.set_conv_partials_type(result, partials)
        return result if dithering is None else _poptorch_ops.set_conv_dithering(result, dithering)

    def _own(self, values):
        """The current convolution's value of a setting (None if unset or the count does not match: a count
        mismatch is reported when the scope ends)."""
        if values is None or self.count > len(values) > 1:
            return None
        return values[min(self.count, len(values)) - 1]


class MultiConv:
    """PopTorch plans the convolutions created inside ``with poptorch.MultiConv():`` together, to run in
    parallel. On the CPU the scope changes nothing. On the simulated IPU the convolutions run as ordinary
    convolutions (forward and backward), planned one by one: each plans within its
    ``availableMemoryProportions`` share of tile memory, is dithered as its ``enableConvDithering`` value
    says and accumulates its float16 partials in its ``partialsTypes`` dtype; ``MultiConvPlanType.Serial``
    (the plan the simulator makes) is accepted and any other setting is refused as not modelled when the
    model is captured."""

    def __init__(self):
        self._settings = {}
        self._counting = None

    def _set(self, name, value):
        if value is None:
            self._settings.pop(name, None)
        else:
            self._settings[name] = value
        return self

    def availableMemoryProportions(self, value):  # noqa: N802 - PopTorch's names below
        """The temporary-memory share of each convolution, each in [0, 1) (one float, or one per convolution)."""
        if value is not None:
            value = _per_conv("availableMemoryProportions", value, _is_float, "a float")
            if not all(0.0 <= v < 1.0 for v in value):
                raise Error(f"MultiConv.availableMemoryProportions: each value must be in [0, 1), got {value!r}")
        return self._set("availableMemoryProportions", value)

    def partialsTypes(self, value):  # noqa: N802
        """The partials type of each convolution: ``torch.float`` or ``torch.half`` (one, or one per convolution)."""
        if value is not None:
            value = _per_conv(
                "partialsTypes", value, lambda v: v in (torch.float32, torch.float16), "torch.float or torch.half"
            )
        return self._set("partialsTypes", value)

    def planType(self, value):  # noqa: N802
        """A ``poptorch.MultiConvPlanType``."""
        if value is not None and not isinstance(value, MultiConvPlanType):
            raise Error(f"MultiConv.planType takes a poptorch.MultiConvPlanType, got {value!r}")
        return self._set("planType", None if value is None else (value,))

    def perConvReservedTiles(self, value):  # noqa: N802
        """Tiles reserved for each convolution."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Error(f"MultiConv.perConvReservedTiles takes a non-negative integer, got {value!r}")
        return self._set("perConvReservedTiles", (value,))

    def cycleBackOff(self, value):  # noqa: N802
        """The planner's cycle back-off proportion, in [0, 1]."""
        if not isinstance(value, float) or not 0.0 <= value <= 1.0:
            raise Error(f"MultiConv.cycleBackOff takes a float in [0, 1], got {value!r}")
        return self._set("cycleBackOff", (value,))

    def enableConvDithering(self, value):  # noqa: N802
        """Dither the tile placement of each convolution (one bool, or one per convolution)."""
        if value is not None:
            value = _per_conv("enableConvDithering", value, lambda v: isinstance(v, bool), "a bool")
        return self._set("enableConvDithering", value)

    def __enter__(self):
        if isRunningOnIpu():
            for name, values in self._settings.items():
                if name not in _HONOURED_AS_GIVEN and not all(v in _MODELLED_SETTINGS.get(name, ()) for v in values):
                    shown = ", ".join(_shown(v) for v in values)
                    shown = shown if len(values) == 1 else f"[{shown}]"
                    reason = _REFUSAL_REASONS[name]
                    raise not_modelled(f"poptorch.MultiConv().{name}({shown})", reason)
        settings = self._settings
        self._counting = _ConvolutionCount(
            settings.get("availableMemoryProportions"),
            settings.get("enableConvDithering"),
            settings.get("partialsTypes"),
        ).__enter__()
        return self

    def __exit__(self, *exc):
        counting, self._counting = self._counting, None
        counting.__exit__(*exc)
        if exc[0] is None:
            for name, values in self._settings.items():
                if len(values) not in (1, counting.count):
                    raise Error(
                        f"poptorch.MultiConv: {name} has {len(values)} values but the scope holds {counting.count} "
                        "convolutions: give one value for all of them, or one per convolution"
                    )
        return False
