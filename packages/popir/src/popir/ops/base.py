"""Base primitives every graph needs: constants, arithmetic, broadcasting, reshape and summation.

Each primitive is one ``defop`` with its shape rule, NumPy reference and VJP side by side.
"""

import numpy as np

from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import broadcast_shapes, elementwise, norm_axes, reduce_infer
from popir.registry import defop


def _constant_infer(value):
    if not isinstance(value, np.ndarray):
        raise IRError("constant needs an ndarray value")
    return TensorType.of(value.shape, value.dtype)


constant = defop(
    "constant",
    infer=_constant_infer,
    ref=lambda value: value,
    differentiable=False,
    doc="A constant tensor held in the graph.",
)


def sum_to(x, shape):
    """Sum ``x`` down to ``shape`` (the adjoint of broadcasting to ``x.shape``)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    return reshape(reduce_sum(x, axes=axes, keepdims=False), shape=shape)


add = defop(
    "add",
    infer=elementwise,
    ref=np.add,
    vjp=lambda ins, outs, cts: (sum_to(cts[0], ins[0].shape), sum_to(cts[0], ins[1].shape)),
)
sub = defop(
    "sub",
    infer=elementwise,
    ref=np.subtract,
    vjp=lambda ins, outs, cts: (sum_to(cts[0], ins[0].shape), sum_to(-cts[0], ins[1].shape)),
)
mul = defop(
    "mul",
    infer=elementwise,
    ref=np.multiply,
    vjp=lambda ins, outs, cts: (
        sum_to(cts[0] * ins[1], ins[0].shape),
        sum_to(cts[0] * ins[0], ins[1].shape),
    ),
)


def _div_ref(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return np.floor_divide(a, b)
    return np.divide(a, b)


div = defop(
    "div",
    infer=elementwise,
    ref=_div_ref,
    vjp=lambda ins, outs, cts: (
        sum_to(cts[0] / ins[1], ins[0].shape),
        sum_to(-(cts[0] * outs[0] / ins[1]), ins[1].shape),
    ),
    doc="Elementwise division (floor division for integers).",
)
neg = defop("neg", infer=lambda x: x, ref=np.negative, vjp=lambda ins, outs, cts: (-cts[0],))
exp = defop("exp", infer=lambda x: x, ref=np.exp, vjp=lambda ins, outs, cts: (cts[0] * outs[0],))


def _broadcast_infer(x, shape):
    """Output: ``shape``, x's dtype; x's shape must broadcast to it (NumPy rules: aligned at the right, each
    dim 1 or equal), with no fewer dims."""
    shape = tuple(shape)
    if len(shape) < len(x.shape) or broadcast_shapes(x.shape, shape) != shape:
        raise IRError(f"cannot broadcast {list(x.shape)} to {list(shape)}")
    return TensorType(shape, x.dtype)


broadcast_to = defop(
    "broadcast_to",
    infer=_broadcast_infer,
    ref=lambda x, shape: np.broadcast_to(x, shape),
    vjp=lambda ins, outs, cts, shape: (sum_to(cts[0], ins[0].shape),),
    doc="x repeated along new leading axes and size-1 axes to ``shape`` (no copy in the reference); the "
    "gradient sums back over the broadcast axes.",
)


def _reshape_infer(x, shape):
    """Output: ``shape``, x's dtype; the element counts must match (no -1 placeholder: give every dim)."""
    shape = tuple(shape)
    if int(np.prod(shape, dtype=np.int64)) != x.size or any(d < 0 for d in shape):
        raise IRError(f"cannot reshape {list(x.shape)} ({x.size} elements) to {list(shape)}")
    return TensorType(shape, x.dtype)


reshape = defop(
    "reshape",
    infer=_reshape_infer,
    ref=lambda x, shape: np.reshape(x, shape),
    vjp=lambda ins, outs, cts, shape: (reshape(cts[0], shape=ins[0].shape),),
    doc="x's elements in row-major (C) order laid out in ``shape``, as np.reshape and torch.reshape.",
)


def _reduce_sum_vjp(ins, outs, cts, axes, keepdims):
    x = ins[0]
    kept = tuple(1 if i in norm_axes(axes, x.ndim) else d for i, d in enumerate(x.shape))
    return (broadcast_to(reshape(cts[0], shape=kept), shape=x.shape),)


reduce_sum = defop(
    "reduce_sum",
    infer=reduce_infer,
    ref=lambda x, axes, keepdims: np.sum(
        x,
        axis=norm_axes(axes, x.ndim),
        keepdims=keepdims,
        dtype=np.float32 if x.dtype == np.float16 else None,
    ).astype(x.dtype),
    vjp=_reduce_sum_vjp,
    doc="Sum over ``axes`` (None: all); fp16 inputs accumulate in fp32.",
)


def full(graph, shape, value, dtype):
    """A ``shape`` tensor of ``value`` in ``graph`` (a broadcast scalar constant)."""
    scalar = graph.constant(np.array(value), dtype)
    return broadcast_to(scalar, shape=tuple(shape)) if tuple(shape) else scalar


def zeros_like(x):
    """Zeros of ``x``'s shape and dtype."""
    return full(x.graph, x.shape, 0, x.dtype)
