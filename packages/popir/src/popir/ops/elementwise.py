"""Elementwise primitives: float math, binary arithmetic, comparisons, logic, select, casts and stop_gradient.

The wave-0 arithmetic (add, sub, mul, div, neg, exp) lives in ``base.py``; everything else elementwise is here.
"""

import math

import numpy as np

from popir.dtypes import DType, as_dtype
from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import (
    boolean,
    broadcast_shapes,
    float_binary,
    float_unary,
    numeric_binary,
    numeric_unary,
    numpy_dtype,
    same_dtype,
)
from popir.ops.base import broadcast_to, exp, sum_to, zeros_like
from popir.registry import defop


def _scalar(v, value):
    return v.graph.constant(np.array(value, v.dtype.numpy))


# erf in float64 to ~1e-15: its Taylor series below |x| = 2 (Horner in x^2), Laplace's continued fraction for
# erfc above. Both are plain vector arithmetic, several times faster than calling math.erf per element.
_ERF_TAYLOR = [(-1) ** n * 2 / (math.factorial(n) * (2 * n + 1) * math.sqrt(math.pi)) for n in range(42)]
_ERF_SERIES_BELOW, _ERFC_DEPTH = 2.0, 80


def _erf_ref(x):
    x64 = np.asarray(x, np.float64)
    a = np.abs(x64)
    out = np.empty_like(x64)
    near = a < _ERF_SERIES_BELOW
    xs = x64[near]
    z = xs * xs
    acc = np.full_like(xs, _ERF_TAYLOR[-1])
    for c in reversed(_ERF_TAYLOR[:-1]):
        acc = acc * z + c
    out[near] = xs * acc
    far = a[~near]
    fraction = far.copy()
    for k in range(_ERFC_DEPTH, 0, -1):
        fraction = far + (k / 2) / fraction
    with np.errstate(over="ignore", invalid="ignore"):
        erfc = np.exp(-far * far) / (math.sqrt(math.pi) * fraction)
    out[~near] = np.sign(x64[~near]) * (1.0 - erfc)
    return out.astype(x.dtype)


log = defop("log", infer=float_unary, ref=np.log, vjp=lambda ins, outs, cts: (cts[0] / ins[0],))
sqrt = defop("sqrt", infer=float_unary, ref=np.sqrt, vjp=lambda ins, outs, cts: (cts[0] / (outs[0] * 2.0),))
rsqrt = defop(
    "rsqrt",
    infer=float_unary,
    ref=lambda x: (1.0 / np.sqrt(x)).astype(x.dtype),
    vjp=lambda ins, outs, cts: (cts[0] * outs[0] * outs[0] * outs[0] * -0.5,),
    doc="1 / sqrt(x).",
)
tanh = defop("tanh", infer=float_unary, ref=np.tanh, vjp=lambda ins, outs, cts: (cts[0] * (1.0 - outs[0] * outs[0]),))


def _sigmoid_ref(x):
    # exp of a non-positive argument only, so large |x| neither overflows nor loses precision.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype)


sigmoid = defop(
    "sigmoid",
    infer=float_unary,
    ref=_sigmoid_ref,
    vjp=lambda ins, outs, cts: (cts[0] * outs[0] * (1.0 - outs[0]),),
    doc="1 / (1 + exp(-x)), evaluated without overflow for large |x|.",
)
erf = defop(
    "erf",
    infer=float_unary,
    ref=_erf_ref,
    vjp=lambda ins, outs, cts: (cts[0] * exp(-(ins[0] * ins[0])) * (2.0 / math.sqrt(math.pi)),),
    doc="The Gauss error function 2/sqrt(pi) * integral of exp(-t^2) from 0 to x (float only; the reference "
    "is a series near 0 and a continued fraction beyond, without SciPy).",
)
sin = defop("sin", infer=float_unary, ref=np.sin, vjp=lambda ins, outs, cts: (cts[0] * cos(ins[0]),))
cos = defop("cos", infer=float_unary, ref=np.cos, vjp=lambda ins, outs, cts: (-(cts[0] * sin(ins[0])),))

sign = defop("sign", infer=numeric_unary, ref=np.sign, differentiable=False, doc="-1, 0 or 1 (zero gradient).")
abs_ = defop("abs", infer=numeric_unary, ref=np.abs, vjp=lambda ins, outs, cts: (cts[0] * sign(ins[0]),))
relu = defop(
    "relu",
    infer=numeric_unary,
    ref=lambda x: np.maximum(x, np.zeros((), x.dtype)),
    # Zero where x <= 0, else the cotangent: at a NaN input the cotangent passes, as in torch.
    vjp=lambda ins, outs, cts: (where(le(ins[0], _scalar(ins[0], 0)), zeros_like(cts[0]), cts[0]),),
    doc="max(x, 0); the gradient at 0 is 0 and at NaN passes through, as in torch.",
)


def _pow_vjp(ins, outs, cts):
    a, b = ins
    ct = cts[0]
    ga = ct * b * pow_(a, b - 1.0)
    # d/db a^b = a^b log a; where a <= 0 torch's masked form gives 0 at a == 0, so log is taken of a safe value.
    positive = gt(a, _scalar(a, 0))
    safe = where(positive, a, broadcast_to(_scalar(a, 1), shape=a.shape))
    gb = where(broadcast_to(positive, shape=outs[0].shape), ct * outs[0] * log(safe), zeros_like(ct))
    return sum_to(ga, a.shape), sum_to(gb, b.shape)


pow_ = defop("pow", infer=float_binary, ref=np.power, vjp=_pow_vjp, doc="a ** b (float).")


def _minmax_vjp(pick):
    def vjp(ins, outs, cts):
        a, b = ins
        ct = cts[0]
        half = cast(eq(a, b), dtype=ct.dtype) * 0.5
        wins_a = cast(pick(a, b), dtype=ct.dtype) + half
        wins_b = cast(pick(b, a), dtype=ct.dtype) + half
        return sum_to(ct * wins_a, a.shape), sum_to(ct * wins_b, b.shape)

    return vjp


maximum = defop(
    "maximum",
    infer=numeric_binary,
    ref=np.maximum,
    vjp=_minmax_vjp(lambda a, b: gt(a, b)),
    doc="Elementwise max; at ties each input gets half the gradient, as in torch.",
)
minimum = defop(
    "minimum",
    infer=numeric_binary,
    ref=np.minimum,
    vjp=_minmax_vjp(lambda a, b: lt(a, b)),
    doc="Elementwise min; at ties each input gets half the gradient, as in torch.",
)


def _compare(a, b):
    same_dtype(a, b)
    return boolean(broadcast_shapes(a.shape, b.shape))


eq = defop("eq", infer=_compare, ref=np.equal, differentiable=False)
ne = defop("ne", infer=_compare, ref=np.not_equal, differentiable=False)
lt = defop("lt", infer=_compare, ref=np.less, differentiable=False)
le = defop("le", infer=_compare, ref=np.less_equal, differentiable=False)
gt = defop("gt", infer=_compare, ref=np.greater, differentiable=False)
ge = defop("ge", infer=_compare, ref=np.greater_equal, differentiable=False)


def _logical(*types):
    for t in types:
        if t.dtype != DType.bool:
            raise IRError(f"needs bool inputs, got {t.dtype}")
    return boolean(broadcast_shapes(*(t.shape for t in types)))


logical_and = defop("logical_and", infer=_logical, ref=np.logical_and, differentiable=False)
logical_or = defop("logical_or", infer=_logical, ref=np.logical_or, differentiable=False)
logical_not = defop("logical_not", infer=_logical, ref=np.logical_not, differentiable=False)


def _where_infer(cond, a, b):
    if cond.dtype != DType.bool:
        raise IRError(f"condition must be bool, got {cond.dtype}")
    return TensorType(broadcast_shapes(cond.shape, a.shape, b.shape), same_dtype(a, b))


def _where_vjp(ins, outs, cts):
    cond, a, b = ins
    ct = cts[0]
    zero = zeros_like(ct)
    return None, sum_to(where(cond, ct, zero), a.shape), sum_to(where(cond, zero, ct), b.shape)


where = defop("where", infer=_where_infer, ref=np.where, vjp=_where_vjp, doc="cond ? a : b, broadcasting all three.")


def _cast_infer(x, dtype):
    return TensorType(x.shape, as_dtype(dtype))


def _cast_vjp(ins, outs, cts, dtype):
    if not (ins[0].dtype.is_float and outs[0].dtype.is_float):
        return (None,)
    return (cast(cts[0], dtype=ins[0].dtype),)


cast = defop(
    "cast",
    infer=_cast_infer,
    ref=lambda x, dtype: x.astype(numpy_dtype(dtype)),
    vjp=_cast_vjp,
    doc="Convert to ``dtype`` (float to int truncates toward zero, as in torch).",
)


stop_gradient = defop(
    "stop_gradient",
    infer=lambda x: x,
    ref=np.copy,
    differentiable=False,
    doc="``x`` unchanged, but no gradient flows back through it (torch's ``detach``).",
)
