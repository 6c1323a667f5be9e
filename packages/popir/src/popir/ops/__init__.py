"""popir primitives and composite ops. Importing this package registers every primitive.

Primitives (one registry entry each) live in base, elementwise, reduction, movement, linalg, conv and
random; composites (plain functions over primitives) in stats, activations, normalization, losses and layers.
"""

from popir.ops.activations import clamp, dropout, gelu, hardtanh, leaky_relu, log_softmax, silu, softmax
from popir.ops.base import (
    add,
    broadcast_to,
    constant,
    div,
    exp,
    full,
    mul,
    neg,
    reduce_sum,
    reshape,
    sub,
    sum_to,
    zeros_like,
)
from popir.ops.conv import conv2d, conv2d_grad_input, conv2d_grad_weight, max_pool2d, max_pool2d_grad, max_pool2d_select
from popir.ops.elementwise import (
    abs_ as abs,  # noqa: A004 - op names mirror the registry
)
from popir.ops.elementwise import (
    cast,
    cos,
    eq,
    erf,
    ge,
    gt,
    le,
    log,
    logical_and,
    logical_not,
    logical_or,
    lt,
    maximum,
    minimum,
    ne,
    relu,
    rsqrt,
    sigmoid,
    sign,
    sin,
    sqrt,
    tanh,
    where,
)
from popir.ops.elementwise import (
    pow_ as pow,  # noqa: A004
)
from popir.ops.layers import avg_pool2d, conv_transpose2d, embedding, flatten, linear, masked_fill
from popir.ops.linalg import matmul
from popir.ops.losses import cross_entropy, mse_loss, nll_loss, reduce_loss
from popir.ops.movement import concat, gather, pad, scatter_add, take_along_axis, transpose
from popir.ops.movement import slice_ as slice  # noqa: A004
from popir.ops.normalization import batch_norm, group_norm, instance_norm, layer_norm
from popir.ops.random import random_uniform
from popir.ops.reduction import argmax, argmin, reduce_max, reduce_min
from popir.ops.stats import logsumexp, mean, std, var

__all__ = [
    "abs", "add", "argmax", "argmin", "avg_pool2d", "batch_norm", "broadcast_to", "cast", "clamp", "concat",
    "constant", "conv2d", "conv2d_grad_input", "conv2d_grad_weight", "conv_transpose2d", "cos", "cross_entropy",
    "div", "dropout", "embedding", "eq", "erf", "exp", "flatten", "full", "gather", "ge", "gelu", "group_norm",
    "gt", "hardtanh", "instance_norm", "layer_norm", "le", "leaky_relu", "linear", "log", "log_softmax",
    "logical_and", "logical_not", "logical_or", "logsumexp", "lt", "masked_fill", "matmul", "max_pool2d",
    "max_pool2d_grad", "max_pool2d_select", "maximum", "mean", "minimum", "mse_loss", "mul", "ne", "neg",
    "nll_loss", "pad", "pow", "random_uniform", "reduce_loss", "reduce_max", "reduce_min", "reduce_sum", "relu",
    "reshape", "rsqrt", "scatter_add", "sigmoid", "sign", "silu", "sin", "slice", "softmax", "sqrt", "std", "sub",
    "sum_to", "take_along_axis", "tanh", "transpose", "var", "where", "zeros_like",
]  # fmt: skip
