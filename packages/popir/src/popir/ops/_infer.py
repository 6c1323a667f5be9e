"""Shape and dtype helpers shared by op rules."""

import numpy as np

from popir.dtypes import DType, as_dtype
from popir.errors import IRError
from popir.graph import TensorType


def broadcast_shapes(*shapes):
    """NumPy broadcasting of ``shapes``; IRError naming them when they do not broadcast."""
    ndim = max(len(s) for s in shapes)
    padded = [(1,) * (ndim - len(s)) + tuple(s) for s in shapes]
    out = []
    for dims in zip(*padded):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise IRError(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def same_dtype(*types):
    """The common dtype of ``types``; IRError when they differ (frontends insert casts)."""
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        raise IRError(f"dtypes differ: {', '.join(sorted(str(d) for d in dtypes))}")
    return dtypes.pop()


def require_float(t):
    if not t.dtype.is_float:
        raise IRError(f"needs a floating-point input, got {t.dtype}")
    return t.dtype


def norm_axes(axes, ndim):
    """Axes as a sorted tuple of non-negative ints; None means all axes."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = (axes,)
    out = []
    for a in axes:
        if not -ndim <= a < max(ndim, 1):
            raise IRError(f"axis {a} is out of range for rank {ndim}")
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise IRError(f"repeated axis in {tuple(axes)}")
    return tuple(sorted(out))


def elementwise(*types):
    """Result type of a broadcasting elementwise op over inputs of one dtype."""
    return TensorType(broadcast_shapes(*(t.shape for t in types)), same_dtype(*types))


def boolean(shape):
    return TensorType(tuple(shape), DType.bool)


def numpy_dtype(dtype):
    """The NumPy dtype a reference computes in for a ``dtype`` attribute.

    The interpreter's float64 checking mode passes a NumPy dtype through, which is kept as is;
    graph attributes (DType names) map to their device dtype.
    """
    return dtype if isinstance(dtype, np.dtype) else as_dtype(dtype).numpy


def float_unary(x):
    """Rule of a float-only unary op."""
    require_float(x)
    return x


def numeric_unary(x):
    """Rule of a unary op on floats or ints (not bool)."""
    if x.dtype == DType.bool:
        raise IRError("needs a numeric input, got bool")
    return x


def float_binary(a, b):
    """Rule of a broadcasting float-only binary op."""
    t = elementwise(a, b)
    require_float(t)
    return t


def numeric_binary(a, b):
    """Rule of a broadcasting binary op on floats or ints (not bool)."""
    t = elementwise(a, b)
    if t.dtype == DType.bool:
        raise IRError("needs numeric inputs, got bool")
    return t


def reduce_infer(x, axes, keepdims):
    """Rule of a reduction over ``axes`` (None: all)."""
    axes = norm_axes(axes, len(x.shape))
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes)
    return TensorType(shape, x.dtype)
