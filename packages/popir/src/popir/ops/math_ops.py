"""More elementwise math (wave 2): rounding, trigonometric and hyperbolic functions, log1p/expm1,
remainder, atan2 and bitwise logic, plus the composites torch builds from them."""

import math

import numpy as np

from popir.errors import IRError
from popir.ops._infer import elementwise, float_binary, float_unary, numeric_binary, numeric_unary
from popir.ops.base import exp, full, sum_to
from popir.ops.elementwise import log, lt, rsqrt, sqrt, where
from popir.registry import defop

floor = defop("floor", infer=numeric_unary, ref=np.floor, differentiable=False, doc="Round down (zero gradient).")
ceil = defop("ceil", infer=numeric_unary, ref=np.ceil, differentiable=False, doc="Round up (zero gradient).")
round_ = defop(
    "round", infer=numeric_unary, ref=np.round, differentiable=False, doc="Round half to even, as torch.round."
)


def _unary(name, ref, grad, doc=""):
    """A float unary primitive whose VJP is ct * grad(x, y)."""
    return defop(
        name, infer=float_unary, ref=ref, vjp=lambda ins, outs, cts: (cts[0] * grad(ins[0], outs[0]),), doc=doc
    )


tan = _unary("tan", np.tan, lambda x, y: y * y + 1.0)
asin = _unary("asin", np.arcsin, lambda x, y: rsqrt(1.0 - x * x))
acos = _unary("acos", np.arccos, lambda x, y: -rsqrt(1.0 - x * x))
atan = _unary("atan", np.arctan, lambda x, y: 1.0 / (x * x + 1.0))
sinh = _unary("sinh", np.sinh, lambda x, y: cosh(x))
cosh = _unary("cosh", np.cosh, lambda x, y: sinh(x))
asinh = _unary("asinh", np.arcsinh, lambda x, y: rsqrt(x * x + 1.0))
acosh = _unary("acosh", np.arccosh, lambda x, y: rsqrt(x * x - 1.0))
atanh = _unary("atanh", np.arctanh, lambda x, y: 1.0 / (1.0 - x * x))
log1p = _unary("log1p", np.log1p, lambda x, y: 1.0 / (x + 1.0), doc="log(1 + x), accurate near 0.")
expm1 = _unary("expm1", np.expm1, lambda x, y: y + 1.0, doc="exp(x) - 1, accurate near 0.")


def log2(x):
    """Base-2 logarithm."""
    return log(x) * (1.0 / math.log(2.0))


def log10(x):
    """Base-10 logarithm."""
    return log(x) * (1.0 / math.log(10.0))


def exp2(x):
    """2 ** x."""
    return exp(x * math.log(2.0))


def reciprocal(x):
    """1 / x."""
    return 1.0 / x


def square(x):
    """x * x."""
    return x * x


def hypot(a, b):
    """sqrt(a^2 + b^2)."""
    return sqrt(a * a + b * b)


def _remainder_vjp(ins, outs, cts):
    a, b = ins
    return sum_to(cts[0], a.shape), sum_to(-(cts[0] * floor(a / b)), b.shape)


remainder = defop(
    "remainder",
    infer=numeric_binary,
    ref=np.remainder,
    vjp=_remainder_vjp,
    doc="torch.remainder: a - floor(a / b) * b (the result takes the sign of b).",
)


def _atan2_vjp(ins, outs, cts):
    a, b = ins
    scale = cts[0] / (a * a + b * b)
    return sum_to(scale * b, a.shape), sum_to(-(scale * a), b.shape)


atan2 = defop("atan2", infer=float_binary, ref=np.arctan2, vjp=_atan2_vjp, doc="atan(a / b) in the right quadrant.")


def _bitwise(*types):
    t = elementwise(*types)
    if t.dtype.is_float:
        raise IRError(f"bitwise ops need int32 or bool inputs, got {t.dtype}")
    return t


bitwise_and = defop("bitwise_and", infer=_bitwise, ref=np.bitwise_and, differentiable=False)
bitwise_or = defop("bitwise_or", infer=_bitwise, ref=np.bitwise_or, differentiable=False)
bitwise_xor = defop("bitwise_xor", infer=_bitwise, ref=np.bitwise_xor, differentiable=False)
bitwise_not = defop("bitwise_not", infer=_bitwise, ref=np.invert, differentiable=False)


def trunc(x):
    """Round toward zero (torch.trunc)."""
    return where(lt(x, full(x.graph, (), 0, x.dtype)), ceil(x), floor(x))
