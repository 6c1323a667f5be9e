"""``Precision.enableStochasticRounding(True)``: float16 results rounded stochastically, as the IPU does.

Every arithmetic op with a float16 result is computed in float32 and rounded to one of the two nearest
float16 values, up with probability (x - lower) / (upper - lower), using uniform numbers from the
device's seeded random-number state (``RNG_SEED``, advanced every run). On average a sum of increments
smaller than half a float16 step then grows as in exact arithmetic, where rounding to nearest loses them.
"""

import numpy as np

from popir.passes._rebuild import Rebuilder
from poptorch._training import RNG_SEED
from poptorch._training import _advance_rng as advance_rng

# Ops whose float16 results are rounded (data movement, comparisons and min/max are exact).
ROUNDED_OPS = frozenset(
    {
        "add", "sub", "mul", "div", "pow", "matmul", "conv2d", "conv2d_grad_input", "conv2d_grad_weight",
        "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "tan", "erf",
        "atan2", "reduce_sum", "cumsum", "scatter_add",
    }
)  # fmt: skip
_HALF = "float16"
_MIN_EXPONENT, _MANTISSA_BITS = -14, 10  # float16: smallest normal exponent, stored mantissa bits
_TINY = np.float32(2.0**-24)  # the smallest float16 subnormal


def apply(graph):
    """A copy of ``graph`` whose float16 arithmetic rounds stochastically."""
    builder = _Rounding(graph)
    if not any(v.name == RNG_SEED for v in graph.inputs):
        builder.seed = builder.graph.add_input(RNG_SEED, (2,), "int32", kind="buffer")
    else:
        builder.seed = builder.map[graph.input(RNG_SEED).id]
    rounded = builder.replay()
    advance_rng(rounded)
    return rounded


class _Rounding(Rebuilder):
    def __init__(self, source):
        super().__init__(source, rules=(_round_half_results,))
        self.streams = 0


def _round_half_results(builder, op, inputs, attrs, types):
    if op not in ROUNDED_OPS or types is None or not any(str(t.dtype) == _HALF for t in types):
        return None
    wide = [builder.emit("cast", [v], {"dtype": "float32"})[0] if str(v.dtype) == _HALF else v for v in inputs]
    results = builder.emit(op, wide, attrs)
    return [_stochastic_round(builder, r) if str(t.dtype) == _HALF else r for r, t in zip(results, types)]


def _stochastic_round(builder, x):
    """float32 ``x`` rounded to float16, up or down at random in proportion to its distance to each."""

    def op(name, *args, **attrs):
        return builder.emit(name, list(args), attrs)[0]

    def const(value):
        return builder.constant(np.array(value, dtype=np.float32))

    def full(value):
        return op("broadcast_to", const(value), shape=x.shape) if x.shape else const(value)

    magnitude = op("abs", x)
    safe = op("maximum", magnitude, full(_TINY))
    exponent = op("floor", op("div", op("log", safe), full(np.log(2.0))))
    # log() is inexact near powers of two: step the exponent so that 2**e <= |x| < 2**(e + 1).
    two = full(2.0)
    exponent = op("sub", exponent, op("cast", op("lt", safe, op("pow", two, exponent)), dtype="float32"))
    above = op("ge", safe, op("pow", two, op("add", exponent, full(1.0))))
    exponent = op("add", exponent, op("cast", above, dtype="float32"))
    exponent = op("maximum", exponent, full(_MIN_EXPONENT))
    ulp = op("pow", two, op("sub", exponent, full(_MANTISSA_BITS)))
    steps = op("div", magnitude, ulp)
    lower = op("floor", steps)
    builder.streams += 1
    stream = op("add", builder.seed, builder.constant(np.array([builder.streams, 0], dtype=np.int32)))
    uniform = op("random_uniform", stream, shape=x.shape, dtype="float32")
    up = op("cast", op("lt", uniform, op("sub", steps, lower)), dtype="float32")
    rounded = op("mul", op("sign", x), op("mul", op("add", lower, up), ulp))
    finite = op("lt", magnitude, full(np.inf))
    return op("cast", op("where", finite, rounded, x), dtype=_HALF)
