"""PopTorch's graph ops: ``for_loop``, ``cond``, ``dynamic_slice``, ``dynamic_update``, ``nop``, ``NameScope``,
and the per-convolution settings a ``MultiConv`` marks its convolutions with (dithering, partials type).

They are written with ordinary torch ops, so the model runs the same on the CPU and torch.export captures
them into ATen ops that lower to popir. ``for_loop`` unrolls its body (the device program repeats the body's
code ``count`` times instead of looping over one copy); ``cond`` computes both branches on the device and
selects each output with ``torch.where`` (the same values as running one branch).
"""

import contextlib

import torch
import torch.fx.traceback as fx_traceback

from poptorch import _memory
from poptorch._executor_api import capturing_training, isRunningOnIpu
from poptorch._marker_ops import define_marker
from poptorch.errors import Error


def _inference_only(name):
    if isRunningOnIpu() and capturing_training():
        raise Error(f"poptorch.{name}() is only supported in inference.")


def _tensor_list(name, what, values):
    if not isinstance(values, list | tuple) or not all(isinstance(v, torch.Tensor) for v in values):
        raise Error(f"poptorch.{name}(): {what} must be a list of tensors, got {type(values).__name__}")
    return list(values)


def _as_list(result):
    return list(result) if isinstance(result, list | tuple) else [result]


def for_loop(count, body, inputs):
    """Run ``body`` ``count`` times, each time on the previous iteration's outputs; returns the last outputs.

    ``body`` takes the tensors of ``inputs`` as arguments and returns as many tensors, of the same shapes
    and dtypes. Inference only on the IPU."""
    _inference_only("for_loop")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise Error(f"poptorch.for_loop(): count must be a positive integer, got {count!r}")
    values = _tensor_list("for_loop", "inputs", inputs)
    for _ in range(count):
        outputs = _tensor_list("for_loop", "the body's outputs", _as_list(body(*values)))
        if [(o.shape, o.dtype) for o in outputs] != [(v.shape, v.dtype) for v in values]:
            raise Error(
                "poptorch.for_loop(): the body must return tensors of the same number, shapes and dtypes as its "
                f"inputs: got {[tuple(o.shape) for o in outputs]} for inputs {[tuple(v.shape) for v in values]}"
            )
        values = outputs
    return values


def cond(condition, then_body, then_inputs, else_body, else_inputs):
    """``then_body(*then_inputs)`` if ``condition`` (a one-element bool tensor) is true, else
    ``else_body(*else_inputs)``; both branches return the same number of tensors of the same shapes.
    Inference only on the IPU."""
    _inference_only("cond")
    if not isinstance(condition, torch.Tensor) or condition.numel() != 1 or condition.dtype != torch.bool:
        raise Error(f"poptorch.cond(): condition must be a one-element bool tensor, got {condition!r}")
    then_inputs = _tensor_list("cond", "then_inputs", then_inputs)
    else_inputs = _tensor_list("cond", "else_inputs", else_inputs)
    if not isRunningOnIpu():
        return _as_list(then_body(*then_inputs) if bool(condition) else else_body(*else_inputs))
    taken = _tensor_list("cond", "then_body's outputs", _as_list(then_body(*then_inputs)))
    other = _tensor_list("cond", "else_body's outputs", _as_list(else_body(*else_inputs)))
    if [(t.shape, t.dtype) for t in taken] != [(o.shape, o.dtype) for o in other]:
        raise Error("poptorch.cond(): both branches must return tensors of the same number, shapes and dtypes")
    flag = condition.reshape(())
    return [torch.where(flag, t, o) for t, o in zip(taken, other)]


def _positions(tensor, dim, start, size, step=1):
    if not isinstance(size, int) or size < 1 or size > tensor.shape[dim]:
        raise Error(f"size must be an integer from 1 to {tensor.shape[dim]} (dimension {dim}), got {size!r}")
    start = torch.as_tensor(start).reshape(()).to(torch.int64)
    return start + torch.arange(size, dtype=torch.int64) * step


def dynamic_slice(tensor, dim, start, size, step=1):
    """``size`` elements of ``tensor`` along ``dim`` from ``start`` (a tensor: the offset may change at
    run time without recompiling), every ``step``-th one."""
    return tensor.index_select(dim, _positions(tensor, dim, start, size, step))


def dynamic_update(input, src, dim, start, size):  # noqa: A002 - PopTorch's argument name
    """A copy of ``input`` whose ``size`` elements along ``dim`` from ``start`` (a tensor) are ``src``."""
    positions = _positions(input, dim, start, size)
    if src.shape[dim] != size or src.dim() != input.dim():
        raise Error(f"dynamic_update: src must have size {size} along dimension {dim}, got {tuple(src.shape)}")
    index = torch.arange(input.shape[dim], dtype=torch.int64)
    inside = (index >= positions[0]) & (index <= positions[-1])
    taken = src.index_select(dim, (index - positions[0]).clamp(0, size - 1))
    shape = [1] * input.dim()
    shape[dim] = input.shape[dim]
    return torch.where(inside.reshape(shape), taken, input)


def nop(tensor):
    """An operation that returns its input: a marker the graph keeps."""
    return tensor.clone()


# The exported nodes' ``custom`` meta key holding the enclosing NameScopes, joined by "/".
NAME_SCOPE_META = "poptorch_name_scope"


@contextlib.contextmanager
def NameScope(name):  # noqa: N802 - PopTorch's name
    """Group the ops created inside under ``name``: their module path in profiles starts with the enclosing
    scopes joined by "/" (``outer/inner/layer1.0.conv2``)."""
    if not isinstance(name, str) or not name:
        raise Error(f"NameScope takes a non-empty name, got {name!r}")
    outer = (fx_traceback.current_meta.get("custom") or {}).get(NAME_SCOPE_META)
    with fx_traceback.annotate({NAME_SCOPE_META: f"{outer}/{name}" if outer else name}):
        yield


# popir ops of a convolution's passes (forward, input and weight gradients), which per-convolution settings mark.
_CONVOLUTION_OPS = frozenset({"conv2d", "conv2d_grad_input", "conv2d_grad_weight"})
_PARTIALS = {torch.float32: "float32", torch.float16: "float16"}


_set_conv_dithering = define_marker("set_conv_dithering", ("bool enabled",))
_set_conv_partials_type = define_marker("set_conv_partials_type", ("str dtype",))


def set_conv_dithering(tensor, enabled):
    """Dither (or not) the tile placement of the convolution producing ``tensor`` and of its gradients,
    whatever ``Training.setConvolutionDithering`` says for the model's other convolutions."""
    return _set_conv_dithering(tensor, bool(enabled)) if isRunningOnIpu() else tensor


def set_conv_partials_type(tensor, dtype):
    """Accumulate the float16 partial sums of the convolution producing ``tensor`` (and of its gradients) in
    ``dtype`` (``torch.float`` or ``torch.half``), whatever ``Precision.setPartialsType`` says."""
    return _set_conv_partials_type(tensor, _PARTIALS[dtype]) if isRunningOnIpu() else tensor


def mark_convolutions(value, setting, **annotations):
    """Lowering of the ``poptorch::set_conv_*`` ops: give the convolution that produced popir ``value`` the
    ``annotations`` (its gradients inherit them)."""
    convolutions = [node for node in _memory.planned_nodes(value) if node.op in _CONVOLUTION_OPS]
    if not convolutions:
        raise Error(
            f"poptorch.MultiConv().{setting} at {value.producer.source if value.producer else 'an input'}: "
            "the tensor is not the output of a convolution the simulator plans (conv2d)"
        )
    for node in convolutions:
        for name, annotation in annotations.items():
            setattr(node, name, annotation)
