"""The ATen -> popir lowering table: one function per ATen op, registered in ``TABLE``.

Each lowering is called fx-Interpreter style as ``fn(ctx, *args, **kwargs)`` with the ATen node's
arguments, where tensors are popir Values and everything else stays Python. ``ctx`` is the
``_capture.Lowering`` in charge: it knows the graph, the node being lowered (``ctx.node``, with torch's
fake result in ``node.meta["val"]``) and hands out random seeds. Lowerings emit popir primitives by name
(``_op``), so each ATen op reads as its popir recipe. Losses are lowered here too (``LOSS_OPS``) as
popir composites over primitives.
"""

import math
import operator

import numpy as np
import torch

import popir
from poptorch import (
    _blocks,  # noqa: F401  (registers poptorch::recomputation_checkpoint)
    _custom_op,
    _host_print,
    _memory,
    _overlapped_io,
    _poptorch_ops,
)
from poptorch._indexing import advanced_index, index_put, wrapped_index
from poptorch._losses import REDUCTIONS
from poptorch.errors import Error

aten = torch.ops.aten
TABLE = {}

# ATen loss ops kept out of the decompositions so that each loss stays one recognisable node.
LOSS_OPS = (
    aten.mse_loss.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.nll_loss.default,
    aten.nll_loss_nd.default,
    aten.nll_loss_forward.default,
    aten.nll_loss2d.default,
    aten.nll_loss2d_forward.default,
    aten.cross_entropy_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.kl_div.default,
    aten.poisson_nll_loss.default,
    aten.hinge_embedding_loss.default,
    aten.soft_margin_loss.default,
    aten.cosine_embedding_loss.default,
    aten.margin_ranking_loss.default,
    aten.triplet_margin_loss.default,
    torch.ops.poptorch.ctc_loss.default,
    torch.ops.poptorch.identity_loss.default,
)

# ATen ops kept out of the decompositions: torch decomposes detach to alias, a plain view that would let
# gradients through (a decomposition torch deems valid only without autograd); the others below say why.
UNDECOMPOSED_OPS = (
    aten.detach.default,
    # Their decompositions compute an overflowing branch that a select masks: NaN gradients (see _softplus).
    aten.softplus.default,
    aten.mish.default,
    aten.celu.default,
    # Its decomposition returns strides that later views of the exported graph cannot take (GPT-2's attention).
    aten.scaled_dot_product_attention.default,
    # Lowered whole, through popir composites.
    aten.index_fill.int_Scalar,
    aten.index_fill.int_Tensor,
    aten.bilinear.default,
)

# ATen ops that only check metadata at run time: nothing to compute on the device.
IGNORED_OPS = (
    aten._assert_async.msg,
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
)

_TORCH_TO_POPIR = {
    torch.float32: "float32",
    torch.float64: "float32",
    torch.float16: "float16",
    torch.int64: "int32",
    torch.int32: "int32",
    torch.int16: "int32",
    torch.int8: "int32",
    torch.uint8: "int32",
    torch.bool: "bool",
}


def lowers(*targets):
    """Register the decorated function as the lowering of each ATen overload in ``targets``."""

    def register(fn):
        for target in targets:
            TABLE[target] = fn
        return fn

    return register


def popir_dtype(torch_dtype):
    """The device dtype of a torch dtype (int64 -> int32, float64 -> float32, as PopTorch does)."""
    try:
        return _TORCH_TO_POPIR[torch_dtype]
    except KeyError:
        raise Error(f"tensors of type {torch_dtype} are not supported on the IPU") from None


def _op(name, *inputs, **attrs):
    """Apply popir primitive ``name``: one Value, or a list for several outputs."""
    outputs = inputs[0].graph.apply(name, inputs, attrs)
    return outputs[0] if len(outputs) == 1 else outputs


def _const(graph, value, dtype):
    return graph.constant(np.asarray(value, dtype=np.dtype(dtype)))


def _cast(x, dtype):
    return x if x.dtype == dtype else _op("cast", x, dtype=dtype)


def _meta(ctx):
    return ctx.node.meta["val"]


def _out_dtype(ctx, index=None):
    val = _meta(ctx)
    return popir_dtype((val if index is None else val[index]).dtype)


def _out_shape(ctx, index=None):
    val = _meta(ctx)
    return tuple(int(d) for d in (val if index is None else val[index]).shape)


def _as_value(ctx, x, dtype):
    """``x`` cast to ``dtype`` if it is a Value, else a constant scalar of ``dtype``."""
    if hasattr(x, "graph"):
        return _cast(x, dtype)
    return _const(ctx.graph, x, dtype)


def _promoted(ctx):
    """The popir dtype torch computes in for the current node's tensor/scalar arguments."""
    args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in ctx.node.args]
    operands = [a for a in args if isinstance(a, (torch.Tensor, bool, int, float))]
    result = operands[0] if len(operands) == 1 else torch.result_type(*operands[:2])
    return popir_dtype(result.dtype if isinstance(result, torch.Tensor) else result)


def _axis(dim, ndim):
    return dim % max(ndim, 1)


def _axes(dims, ndim):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(_axis(d, ndim) for d in dims))


def _count(x, axes):
    return int(np.prod([x.shape[a] for a in (range(x.ndim) if axes is None else axes)], dtype=np.int64))


# -- arithmetic and elementwise ------------------------------------------------------------------


def _arith(prim):
    def lower(ctx, a, b, *, alpha=1):
        dtype = _out_dtype(ctx)
        a, b = _as_value(ctx, a, dtype), _as_value(ctx, b, dtype)
        if alpha != 1:
            b = _op("mul", b, _const(ctx.graph, alpha, dtype))
        return _op(prim, a, b)

    return lower


TABLE[aten.add.Tensor] = TABLE[aten.add.Scalar] = _arith("add")
TABLE[aten.sub.Tensor] = TABLE[aten.sub.Scalar] = _arith("sub")
TABLE[aten.mul.Tensor] = TABLE[aten.mul.Scalar] = _arith("mul")
TABLE[aten.maximum.default] = _arith("maximum")
TABLE[aten.minimum.default] = _arith("minimum")
TABLE[aten.pow.Tensor_Tensor] = TABLE[aten.pow.Scalar] = _arith("pow")


@lowers(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(ctx, a, b, *, alpha=1):
    return _arith("sub")(ctx, b, a if alpha == 1 else _arith("mul")(ctx, a, alpha))


@lowers(aten.div.Tensor, aten.div.Scalar)
def _div(ctx, a, b):
    dtype = _out_dtype(ctx)
    return _op("div", _as_value(ctx, a, dtype), _as_value(ctx, b, dtype))


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default)
def _div_mode(ctx, a, b, *, rounding_mode="floor"):
    dtype = _out_dtype(ctx)
    if rounding_mode is None:
        return _div(ctx, a, b)
    quotient = _op("div", _as_value(ctx, a, dtype), _as_value(ctx, b, dtype))
    if dtype != "int32":
        return _op("floor", quotient) if rounding_mode == "floor" else popir.ops.trunc(quotient)
    if rounding_mode != "floor":
        raise Error("integer division with rounding_mode='trunc' is not supported: use rounding_mode='floor'")
    return quotient


@lowers(aten.pow.Tensor_Scalar)
def _pow_scalar(ctx, x, exponent):
    dtype = _out_dtype(ctx)
    x = _cast(x, dtype)
    if exponent == 1:
        return x
    if exponent == 2:
        return _op("mul", x, x)
    if exponent == 0.5:
        return _op("sqrt", x)
    if exponent == -0.5:
        return _op("rsqrt", x)
    return _op("pow", x, _const(ctx.graph, exponent, dtype))


def _unary(prim):
    def lower(ctx, x):
        return _op(prim, _cast(x, _out_dtype(ctx)))

    return lower


_UNARY = (
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "erf",
    "abs",
    "sin",
    "cos",
    "relu",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "floor",
    "ceil",
    "round",
    "sign",
    "log1p",
    "expm1",
)
for _name in _UNARY:
    TABLE[getattr(aten, _name).default] = _unary(_name)
TABLE[aten.remainder.Tensor] = TABLE[aten.remainder.Scalar] = _arith("remainder")
TABLE[aten.atan2.default] = _arith("atan2")


@lowers(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(ctx, a, b):
    dtype = _out_dtype(ctx)
    a, b = _as_value(ctx, a, dtype), _as_value(ctx, b, dtype)
    if a.dtype.is_float:
        return _op("sub", a, _op("mul", popir.ops.trunc(_op("div", a, b)), b))
    # remainder has the sign of b, fmod the sign of a: shift by b where they disagree.
    r = _op("remainder", a, b)
    zero = _const(ctx.graph, 0, dtype)
    disagree = _op("logical_and", _op("ne", r, zero), _op("ne", _op("lt", a, zero), _op("lt", b, zero)))
    return _op("where", disagree, _op("sub", r, b), r)


def _composite(name):
    """Lower through the popir composite ``name`` with the inputs cast to the result dtype."""

    def lower(ctx, *args):
        dtype = _out_dtype(ctx)
        return getattr(popir.ops, name)(*[_as_value(ctx, a, dtype) for a in args])

    return lower


TABLE[aten.trunc.default] = _composite("trunc")
TABLE[aten.exp2.default] = _composite("exp2")
TABLE[aten.hypot.default] = _composite("hypot")


@lowers(aten.reciprocal.default)
def _reciprocal(ctx, x):
    x = _cast(x, _out_dtype(ctx))
    return _op("div", _const(ctx.graph, 1.0, x.dtype), x)


@lowers(aten.log2.default, aten.log10.default)
def _log_base(ctx, x):
    x = _cast(x, _out_dtype(ctx))
    base = 2.0 if ctx.node.target is aten.log2.default else 10.0
    return _op("div", _op("log", x), _const(ctx.graph, math.log(base), x.dtype))


@lowers(aten.square.default)
def _square(ctx, x):
    x = _cast(x, _out_dtype(ctx))
    return _op("mul", x, x)


@lowers(aten.silu.default)
def _silu(ctx, x):
    return _op("mul", x, _op("sigmoid", x))


@lowers(aten.gelu.default)
def _gelu(ctx, x, *, approximate="none"):
    g = ctx.graph
    half = _op("mul", x, _const(g, 0.5, x.dtype))
    if approximate == "tanh":
        cube = _op("mul", _op("mul", x, x), x)
        inner = _op("add", x, _op("mul", cube, _const(g, 0.044715, x.dtype)))
        t = _op("tanh", _op("mul", inner, _const(g, math.sqrt(2.0 / math.pi), x.dtype)))
    else:
        t = _op("erf", _op("mul", x, _const(g, 1.0 / math.sqrt(2.0), x.dtype)))
    return _op("mul", half, _op("add", t, _const(g, 1.0, x.dtype)))


@lowers(aten.leaky_relu.default)
def _leaky_relu(ctx, x, negative_slope=0.01):
    zero = _const(ctx.graph, 0.0, x.dtype)
    return _op("where", _op("gt", x, zero), x, _op("mul", x, _const(ctx.graph, negative_slope, x.dtype)))


# The ELU family and softplus go through popir's composites, which feed each branch of their select only
# values from the region where that branch is chosen: a masked-out branch that overflowed (exp(100) = inf)
# would otherwise turn its zero cotangent into 0 * inf = NaN. torch's decompositions of softplus, mish and
# celu do not, so those ops are kept whole (UNDECOMPOSED_OPS).
@lowers(aten.elu.default)
def _elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    return popir.ops.elu(x, alpha=alpha, scale=scale, input_scale=input_scale)


@lowers(aten.celu.default)
def _celu(ctx, x, alpha=1.0):
    return popir.ops.celu(x, alpha=alpha)


@lowers(aten.softplus.default)
def _softplus(ctx, x, beta=1.0, threshold=20.0):
    return popir.ops.softplus(x, beta=beta, threshold=threshold)


@lowers(aten.mish.default)
def _mish(ctx, x):
    return popir.ops.mish(x)


@lowers(aten.rrelu_with_noise_functional.default)
def _rrelu(ctx, x, noise, lower=1.0 / 8.0, upper=1.0 / 3.0, training=False, generator=None):
    # noise (the slopes torch records for its own backward) is not needed: popir differentiates the select.
    return popir.ops.rrelu(x, lower, upper, ctx.random_seed() if training else None), noise


@lowers(aten.hardtanh.default, aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx, x, min=None, max=None):
    dtype = _out_dtype(ctx)
    x = _cast(x, dtype)
    if min is not None:
        x = _op("maximum", x, _as_value(ctx, min, dtype))
    if max is not None:
        x = _op("minimum", x, _as_value(ctx, max, dtype))
    return x


# -- comparisons and selection ---------------------------------------------------------------------


def _compare(prim):
    def lower(ctx, a, b):
        dtype = _promoted(ctx)
        return _op(prim, _as_value(ctx, a, dtype), _as_value(ctx, b, dtype))

    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    TABLE[getattr(aten, _name).Tensor] = TABLE[getattr(aten, _name).Scalar] = _compare(_name)


@lowers(aten.isnan.default)
def _isnan(ctx, x):
    return popir.ops.isnan(x) if x.dtype.is_float else _full_constant(ctx, False)


def _logical(prim):
    def lower(ctx, *xs):
        return _op(prim, *[_truthy(ctx, x) for x in xs])

    return lower


def _truthy(ctx, x):
    return x if x.dtype == "bool" else _op("ne", x, _const(ctx.graph, 0, x.dtype))


TABLE[aten.logical_and.default] = _logical("logical_and")
TABLE[aten.logical_or.default] = _logical("logical_or")
TABLE[aten.logical_not.default] = _logical("logical_not")
TABLE[aten.logical_xor.default] = _logical("ne")


def _bitwise(prim, logical):
    def lower(ctx, *args):
        dtype = _out_dtype(ctx)
        if dtype == "bool":
            return _logical(logical)(ctx, *[_as_value(ctx, a, dtype) for a in args])
        return _op(prim, *[_as_value(ctx, a, dtype) for a in args])

    return lower


TABLE[aten.bitwise_and.Tensor] = TABLE[aten.bitwise_and.Scalar] = _bitwise("bitwise_and", "logical_and")
TABLE[aten.bitwise_or.Tensor] = TABLE[aten.bitwise_or.Scalar] = _bitwise("bitwise_or", "logical_or")
TABLE[aten.bitwise_xor.Tensor] = TABLE[aten.bitwise_xor.Scalar] = _bitwise("bitwise_xor", "ne")
TABLE[aten.bitwise_not.default] = _bitwise("bitwise_not", "logical_not")


@lowers(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _where(ctx, cond, a, b):
    dtype = _out_dtype(ctx)
    return _op("where", _truthy(ctx, cond), _as_value(ctx, a, dtype), _as_value(ctx, b, dtype))


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx, x, mask, value):
    return _op("where", mask, x, _as_value(ctx, value, x.dtype))


# -- casts, copies and constants -----------------------------------------------------------------------


@lowers(aten._to_copy.default, aten.to.dtype, aten.type_as.default)
def _to_copy(ctx, x, *args, **kwargs):
    return _cast(x, _out_dtype(ctx))


@lowers(
    aten.clone.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.contiguous.default,
)
def _identity(ctx, x, *args, **kwargs):
    return x


@lowers(torch.ops.poptorch.recomputation_checkpoint.default)
def _recomputation_checkpoint(ctx, x):
    # The value itself: its producer is marked so recomputation keeps it (see poptorch._recompute).
    if x.producer is not None:
        x.producer.checkpoint = True
    return x


@lowers(torch.ops.poptorch.set_available_memory.default)
def _set_available_memory(ctx, x, proportion):
    # The value itself: the matmul or convolution that produced it plans within ``proportion`` of a tile.
    _memory.mark_available_memory(x, proportion)
    return x


@lowers(torch.ops.poptorch.set_conv_dithering.default)
def _set_conv_dithering(ctx, x, enabled):
    # The value itself: the convolution that produced it (and its gradients) is dithered as ``enabled`` says.
    _poptorch_ops.mark_convolutions(x, "enableConvDithering", conv_dithering=bool(enabled))
    return x


@lowers(torch.ops.poptorch.set_conv_partials_type.default)
def _set_conv_partials_type(ctx, x, dtype):
    # The value itself: the convolution that produced it (and its gradients) accumulates in ``dtype``.
    _poptorch_ops.mark_convolutions(x, "partialsTypes", partials_type=dtype)
    return x


@lowers(torch.ops.poptorch.ipu_print_tensor.default)
def _ipu_print_tensor(ctx, x, title, print_gradient):
    _host_print.record(ctx.graph, x, title, print_gradient)
    return x


@lowers(torch.ops.poptorch.set_overlap.default)
def _set_overlap(ctx, x, mode, direction):
    # The value itself: the executor overlaps its host transfer with compute (see poptorch._overlapped_io).
    _overlapped_io.mark(ctx, x, mode, direction)
    return x


@lowers(torch.ops.poptorch.host_call.default)
def _host_call(ctx, inputs, callback):
    # A poptorch.CPU callback: the device streams ``inputs`` to the host and the function's results back.
    out_types = tuple((tuple(v.shape), str(popir_dtype(v.dtype))) for v in _meta(ctx))
    return ctx.graph.apply("host_call", list(inputs), {"callback": callback, "out_types": out_types})


@lowers(aten.detach.default)
def _detach(ctx, x):
    return _op("stop_gradient", x)


@lowers(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default)
def _full_like(ctx, x, fill_value=0, **kwargs):
    fill = {aten.ones_like.default: 1, aten.full_like.default: fill_value}.get(ctx.node.target, 0)
    return _full_constant(ctx, fill)


def _full_constant(ctx, fill):
    dtype = _out_dtype(ctx)
    scalar = _const(ctx.graph, fill, dtype)
    shape = _out_shape(ctx)
    return _op("broadcast_to", scalar, shape=shape) if shape else scalar


@lowers(aten.copy.default)
def _copy(ctx, dst, src, non_blocking=False):
    return (
        _op("broadcast_to", _cast(src, dst.dtype), shape=dst.shape) if src.shape != dst.shape else _cast(src, dst.dtype)
    )


# -- reductions ------------------------------------------------------------------------------------------


@lowers(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx, x, dims=None, keepdim=False, *, dtype=None):
    x = _cast(x, _out_dtype(ctx))
    return _op("reduce_sum", x, axes=_axes(dims, x.ndim), keepdims=keepdim)


@lowers(aten.mean.dim, aten.mean.default)
def _mean(ctx, x, dims=None, keepdim=False, *, dtype=None):
    x = _cast(x, _out_dtype(ctx))
    axes = _axes(dims, x.ndim)
    total = _op("reduce_sum", x, axes=axes, keepdims=keepdim)
    return _op("div", total, _const(ctx.graph, _count(x, axes), x.dtype))


def _extreme(prim):
    def lower(ctx, x, dims=None, keepdim=False):
        return _op(prim, x, axes=_axes(dims, x.ndim), keepdims=keepdim)

    return lower


TABLE[aten.amax.default] = TABLE[aten.max.default] = _extreme("reduce_max")
TABLE[aten.amin.default] = TABLE[aten.min.default] = _extreme("reduce_min")


def _extreme_with_index(prim, arg):
    def lower(ctx, x, dim, keepdim=False):
        axis = _axis(dim, x.ndim)
        return _op(prim, x, axes=(axis,), keepdims=keepdim), _op(arg, x, axis=axis, keepdims=keepdim)

    return lower


TABLE[aten.max.dim] = _extreme_with_index("reduce_max", "argmax")
TABLE[aten.min.dim] = _extreme_with_index("reduce_min", "argmin")


def _arg(prim):
    def lower(ctx, x, dim=None, keepdim=False):
        if dim is None:
            flat = _op(
                "argmax" if prim == "argmax" else "argmin",
                _op("reshape", x, shape=(x.type.size,)),
                axis=0,
                keepdims=False,
            )
            return _op("reshape", flat, shape=(1,) * x.ndim) if keepdim else flat
        return _op(prim, x, axis=_axis(dim, x.ndim), keepdims=keepdim)

    return lower


TABLE[aten.argmax.default] = _arg("argmax")
TABLE[aten.argmin.default] = _arg("argmin")


@lowers(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default)
def _any_all(ctx, x, dims=None, keepdim=False):
    prim = "reduce_max" if ctx.node.target.name().startswith("aten::any") else "reduce_min"
    as_int = _cast(_truthy(ctx, x), "int32")
    reduced = _op(prim, as_int, axes=_axes(dims, x.ndim), keepdims=keepdim)
    return _op("ne", reduced, _const(ctx.graph, 0, "int32"))


@lowers(aten.prod.dim_int, aten.prod.default)
def _prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = _cast(x, _out_dtype(ctx))
    return _op("reduce_prod", x, axes=None if dim is None else (_axis(dim, x.ndim),), keepdims=keepdim)


@lowers(aten.cumsum.default)
def _cumsum(ctx, x, dim, *, dtype=None):
    x = _cast(x, _out_dtype(ctx))
    return _op("cumsum", x, axis=_axis(dim, x.ndim))


@lowers(aten.cumprod.default)
def _cumprod(ctx, x, dim, *, dtype=None):
    return popir.ops.cumprod(_cast(x, _out_dtype(ctx)), _axis(dim, x.ndim))


@lowers(aten.median.default)
def _median(ctx, x):
    return popir.ops.median(x)


@lowers(aten.median.dim)
def _median_dim(ctx, x, dim=0, keepdim=False):
    return popir.ops.median(x, _axis(dim, x.ndim), keepdim) if x.ndim else (x, _full_constant_at(ctx, 0, 1))


def _full_constant_at(ctx, fill, index):
    return _const(ctx.graph, fill, _out_dtype(ctx, index))


@lowers(aten.bucketize.Tensor)
def _bucketize(ctx, x, boundaries, *, out_int32=False, right=False):
    return popir.ops.bucketize(x, _cast(boundaries, x.dtype), right=bool(right))


@lowers(aten._cdist_forward.default)
def _cdist(ctx, a, b, p, compute_mode=None):
    return popir.ops.cdist(a, b, float(p))


@lowers(aten.sort.default, aten.sort.stable)
def _sort(ctx, x, dim=-1, descending=False, *, stable=None):
    return _op("sort", x, axis=_axis(dim, x.ndim), descending=bool(descending))


@lowers(aten.topk.default)
def _topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    return popir.ops.topk(x, k, axis=_axis(dim, x.ndim), largest=bool(largest))


@lowers(aten.roll.default)
def _roll(ctx, x, shifts, dims=()):
    if not dims:
        flat = _op("reshape", x, shape=(x.type.size,))
        return _op("reshape", popir.ops.roll(flat, tuple(shifts), (0,)), shape=x.shape)
    return popir.ops.roll(x, tuple(shifts), tuple(_axis(d, x.ndim) for d in dims))


@lowers(aten.scatter.src, aten.scatter.value)
def _scatter(ctx, x, dim, index, src):
    axis = _axis(dim, x.ndim)
    index = _index_value(ctx, index, x.shape[axis])
    src = _op("broadcast_to", _as_value(ctx, src, x.dtype), shape=index.shape) if not hasattr(src, "graph") else src
    return popir.ops.scatter(x, axis, index, slice_to(src, index.shape, -1))


@lowers(aten.scatter_reduce.two)
def _scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    axis = _axis(dim, x.ndim)
    index = _index_value(ctx, index, x.shape[axis], f"scatter_reduce on an axis of {x.shape[axis]}")
    if src.shape != index.shape:
        src = slice_to(src, index.shape, -1)
    return popir.ops.scatter_reduce(x, axis, index, src, reduce, bool(include_self))


@lowers(aten.index_reduce.default)
def _index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    axis = _axis(dim, x.ndim)
    index = _index_value(ctx, index, x.shape[axis], f"index_reduce on an axis of {x.shape[axis]}")
    return popir.ops.index_reduce(x, axis, index, source, reduce, bool(include_self))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill(ctx, x, dim, index, value):
    axis = _axis(dim, x.ndim)
    index = _index_value(ctx, _op("reshape", index, shape=(index.type.size,)), x.shape[axis], "index_fill")
    if hasattr(value, "graph"):
        value = _cast(value, x.dtype)
    return popir.ops.index_fill(x, axis, index, value)


@lowers(aten.bincount.default)
def _bincount(ctx, x, weights=None, minlength=0):
    # The output length depends on the values (max + 1), which a compiled graph cannot: it is minlength, and
    # each call checks that the values fit it.
    if minlength <= 0:
        raise Error(
            "torch.bincount's output length depends on the input values, which the IPU cannot compile: pass "
            "minlength=N (values must then lie in 0..N-1)"
        )
    ctx.bound_index(x, minlength, f"bincount with minlength={minlength}")
    return popir.ops.bincount(_cast(x, "int32"), minlength, None if weights is None else _cast(weights, "float32"))


@lowers(aten.linalg_vector_norm.default)
def _vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = _cast(x, _out_dtype(ctx))
    return popir.ops.norm(x, p=float(ord), axes=_axes(dim, x.ndim), keepdims=keepdim)


def variance(x, axes, correction, keepdim):
    """Variance of ``x`` over ``axes`` with ``correction`` (Bessel's correction when 1); also the mean."""
    g = x.graph
    n = _count(x, axes)
    mean = _op("div", _op("reduce_sum", x, axes=axes, keepdims=True), _const(g, n, x.dtype))
    centred = _op("sub", x, mean)
    sq = _op("reduce_sum", _op("mul", centred, centred), axes=axes, keepdims=keepdim)
    var = _op("div", sq, _const(g, max(n - correction, 0), x.dtype))
    return var, (mean if keepdim else _op("reshape", mean, shape=sq.shape))


@lowers(aten.var.correction, aten.var_mean.correction)
def _var(ctx, x, dims=None, *, correction=None, keepdim=False):
    x = _cast(x, "float32" if not x.dtype.is_float else x.dtype)
    var, mean = variance(x, _axes(dims, x.ndim), 1 if correction is None else correction, keepdim)
    return (var, mean) if ctx.node.target is aten.var_mean.correction else var


# -- movement -----------------------------------------------------------------------------------------------


@lowers(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.flatten.using_ints,
    aten.view_copy.default,
)
def _reshape(ctx, x, *args):
    shape = _out_shape(ctx)
    return x if x.shape == shape else _op("reshape", x, shape=shape)


@lowers(aten.permute.default)
def _permute(ctx, x, dims):
    perm = tuple(_axis(d, x.ndim) for d in dims)
    return x if perm == tuple(range(x.ndim)) else _op("transpose", x, perm=perm)


@lowers(aten.t.default, aten.numpy_T.default)
def _t(ctx, x):
    return _op("transpose", x, perm=tuple(reversed(range(x.ndim)))) if x.ndim > 1 else x


@lowers(aten.transpose.int)
def _transpose(ctx, x, dim0, dim1):
    perm = list(range(x.ndim))
    a, b = _axis(dim0, x.ndim), _axis(dim1, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(ctx, x, perm)


@lowers(aten.expand.default, aten.expand_copy.default)
def _expand(ctx, x, size, *, implicit=False):
    shape = _out_shape(ctx)
    return x if x.shape == shape else _op("broadcast_to", x, shape=shape)


@lowers(aten.as_strided.default)
def _as_strided(ctx, x, size, stride, storage_offset=None):
    # Device tensors have no strides, so only a view that reads all of a row-major input in order (a
    # reshape) is modelled; torch's adaptive pooling to 1x1 of a channels-last-looking tensor emits one.
    source = ctx.node.args[0].meta["val"]
    view = torch.empty_strided(size, stride, device="meta")
    in_order = source.is_contiguous() and source.storage_offset() == 0 and view.is_contiguous()
    if not in_order or (storage_offset or 0) != 0 or view.numel() != source.numel():
        raise Error(
            f"as_strided(size={list(size)}, stride={list(stride)}, storage_offset={storage_offset or 0}) of a "
            f"tensor of shape {list(source.shape)} and strides {list(source.stride())} reads memory out of "
            "row-major order, which the IPU model (no strides on the device) cannot: use view, permute, "
            "narrow or unfold instead"
        )
    return _reshape(ctx, x)


def slice_axis(x, axis, start, stop, step=1):
    """``x[..., start:stop:step, ...]`` along ``axis`` (bounds already clamped)."""
    if (start, stop, step) == (0, x.shape[axis], 1):
        return x
    starts = tuple(start if i == axis else 0 for i in range(x.ndim))
    stops = tuple(stop if i == axis else d for i, d in enumerate(x.shape))
    steps = tuple(step if i == axis else 1 for i in range(x.ndim))
    return _op("slice", x, starts=starts, stops=stops, steps=steps)


@lowers(aten.slice.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    axis = _axis(dim, x.ndim)
    start, stop, step = slice(start, end, step).indices(x.shape[axis])
    stop = max(stop, start)
    return slice_axis(x, axis, start, stop, step)


@lowers(aten.slice_scatter.default)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    axis = _axis(dim, x.ndim)
    start, stop, step = slice(start, end, step).indices(x.shape[axis])
    stop = max(stop, start)
    src = _cast(src, x.dtype)
    if step == 1:
        parts = [slice_axis(x, axis, 0, start), src, slice_axis(x, axis, stop, x.shape[axis])]
        parts = [t for t in parts if t.shape[axis] > 0]
        return parts[0] if len(parts) == 1 else _op("concat", *parts, axis=axis)
    # A strided slice: every output position reads either x or src, chosen by a constant index map.
    index = np.arange(x.shape[axis])
    index[start:stop:step] = x.shape[axis] + np.arange(src.shape[axis])
    both = _op("concat", x, src, axis=axis)
    return _op("gather", both, ctx.graph.constant(index.astype(np.int32)), axis=axis)


@lowers(aten.select_scatter.default)
def _select_scatter(ctx, x, src, dim, index):
    axis = _axis(dim, x.ndim)
    index = index % x.shape[axis]
    src = _op("reshape", src, shape=x.shape[:axis] + (1,) + x.shape[axis + 1 :])
    return _slice_scatter(ctx, x, src, axis, index, index + 1)


@lowers(aten.select.int)
def _select(ctx, x, dim, index):
    axis = _axis(dim, x.ndim)
    index = index % x.shape[axis]
    return _op("reshape", slice_axis(x, axis, index, index + 1), shape=_out_shape(ctx))


@lowers(aten.split_with_sizes.default, aten.split.Tensor, aten.split.sizes)
def _split(ctx, x, sizes, dim=0):
    axis = _axis(dim, x.ndim)
    if isinstance(sizes, int):
        sizes = [min(sizes, x.shape[axis] - s) for s in range(0, x.shape[axis], sizes)]
    offsets = np.cumsum([0, *sizes])
    return [slice_axis(x, axis, int(lo), int(hi)) for lo, hi in zip(offsets[:-1], offsets[1:])]


@lowers(aten.unbind.int)
def _unbind(ctx, x, dim=0):
    axis = _axis(dim, x.ndim)
    shape = x.shape[:axis] + x.shape[axis + 1 :]
    return [_op("reshape", slice_axis(x, axis, i, i + 1), shape=shape) for i in range(x.shape[axis])]


@lowers(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    dtype = _out_dtype(ctx)
    parts = [_cast(t, dtype) for t in tensors if t.type.size > 0 or t.ndim > 1]
    if len(parts) == 1:
        return parts[0]
    return _op("concat", *parts, axis=_axis(dim, parts[0].ndim))


@lowers(aten.stack.default)
def _stack(ctx, tensors, dim=0):
    axis = dim % (tensors[0].ndim + 1)
    parts = [_op("reshape", t, shape=t.shape[:axis] + (1,) + t.shape[axis:]) for t in tensors]
    return _cat(ctx, parts, axis)


@lowers(aten.repeat.default)
def _repeat(ctx, x, repeats):
    lead = len(repeats) - x.ndim
    x = _op("reshape", x, shape=(1,) * lead + x.shape) if lead else x
    interleaved = tuple(d for r, s in zip(repeats, x.shape) for d in (1, s))
    tiled = tuple(d for r, s in zip(repeats, x.shape) for d in (r, s))
    out = _op("broadcast_to", _op("reshape", x, shape=interleaved), shape=tiled)
    return _op("reshape", out, shape=_out_shape(ctx))


@lowers(aten.flip.default)
def _flip(ctx, x, dims):
    for axis in {_axis(d, x.ndim) for d in dims}:
        n = x.shape[axis]
        if n > 1:
            x = _op("gather", x, _const(ctx.graph, np.arange(n - 1, -1, -1), "int32"), axis=axis)
    return x


@lowers(aten.constant_pad_nd.default)
def _pad(ctx, x, pad, value=0):
    pairs = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        pairs[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    for axis, (lo, hi) in enumerate(pairs):
        if lo < 0 or hi < 0:
            x = slice_axis(x, axis, max(-lo, 0), x.shape[axis] - max(-hi, 0))
    pads = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pairs)
    if not any(lo or hi for lo, hi in pads):
        return x
    return _op("pad", x, pads=pads, value=float(value))


def _index_value(ctx, indices, size, what="indexing"):
    """Integer indices as int32 with negative ones wrapped into [0, size) (checked in [-size, size))."""
    ctx.bound_index(indices, size, what, negative=True)
    return wrapped_index(indices, size)


@lowers(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq:
        raise Error("embedding with scale_grad_by_freq=True is not supported")
    if padding_idx is not None and padding_idx >= 0:
        # torch never updates the padding row (it starts at zero): reading it through a zero mask gives the
        # same forward value and a zero gradient for that row.
        keep = np.ones((weight.shape[0], 1), dtype=weight.dtype.numpy)
        keep[padding_idx] = 0
        weight = _op("mul", weight, ctx.graph.constant(keep))
    ctx.bound_index(indices, weight.shape[0], f"an Embedding of {weight.shape[0]} rows")
    return _op("gather", weight, _cast(indices, "int32"), axis=0)


_UPSAMPLE_MODES = {
    aten.upsample_nearest1d: "nearest",
    aten.upsample_nearest2d: "nearest",
    aten.upsample_nearest3d: "nearest",
    aten._upsample_nearest_exact1d: "nearest-exact",
    aten._upsample_nearest_exact2d: "nearest-exact",
    aten._upsample_nearest_exact3d: "nearest-exact",
    aten.upsample_linear1d: "linear",
    aten.upsample_bilinear2d: "bilinear",
    aten.upsample_trilinear3d: "trilinear",
    aten.upsample_bicubic2d: "bicubic",
}
UPSAMPLE_OPS = tuple(getattr(p, o) for p in _UPSAMPLE_MODES for o in ("vec", "default"))
# Kept whole: resampled by per-axis maps rather than torch's index arithmetic.
UNDECOMPOSED_OPS += UPSAMPLE_OPS


@lowers(*UPSAMPLE_OPS)
def _upsample(ctx, x, *args):
    """F.interpolate: ``.vec`` overloads take (size, [align_corners], scale_factors), ``.default`` ones
    (size, [align_corners], *per-axis scales)."""
    target = ctx.node.target
    mode = _UPSAMPLE_MODES[target.overloadpacket]
    args = list(args)
    align_corners = bool(args.pop(1)) if mode not in popir.ops.resize.NEAREST_MODES else False
    spatial = x.ndim - 2
    if target._overloadname == "vec":
        scales = args[1] if len(args) > 1 else None
    else:
        scales = args[1:] if len(args) > 1 and any(s is not None for s in args[1:]) else None
    if scales is not None and any(s is None for s in scales):
        scales = None
    size = _out_shape(ctx)[2:]
    return popir.ops.interpolate(x, size, mode, align_corners, None if scales is None else tuple(scales[:spatial]))


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(
    ctx,
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    if scale_grad_by_freq or (padding_idx is not None and padding_idx >= 0):
        raise Error("EmbeddingBag with scale_grad_by_freq or padding_idx is not supported")
    ctx.bound_index(indices, weight.shape[0], f"an EmbeddingBag of {weight.shape[0]} rows")
    indices, offsets = _cast(indices, "int32"), _cast(offsets, "int32")
    mode = {0: "sum", 1: "mean", 2: "max"}[mode]
    out = popir.ops.embedding_bag(weight, indices, offsets, mode, per_sample_weights, bool(include_last_offset))
    # offset2bag, bag_size and max_indices serve torch's own backward; popir differentiates the bag itself.
    return out, None, None, None


@lowers(aten.bilinear.default)
def _bilinear(ctx, a, b, weight, bias=None):
    return popir.ops.bilinear(a, b, weight, bias)


@lowers(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    axis = _axis(dim, x.ndim)
    ctx.bound_index(index, x.shape[axis], f"index_select on an axis of {x.shape[axis]}")
    return _op("gather", x, _index_value(ctx, index, x.shape[axis]), axis=axis)


def _bound_indices(ctx, x, indices):
    """Each call checks integer index tensors that come from user inputs against their axis."""
    for axis, idx in enumerate(indices):
        if idx is not None and idx.dtype != "bool":
            ctx.bound_index(idx, x.shape[axis], "indexing", negative=True)


@lowers(aten.index.Tensor)
def _index(ctx, x, indices):
    _bound_indices(ctx, x, indices)
    return advanced_index(x, indices)


@lowers(aten.index_put.default, aten.index_put_.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    _bound_indices(ctx, x, indices)
    return index_put(x, indices, _as_value(ctx, values, x.dtype), accumulate)


@lowers(aten.gather.default)
def _gather(ctx, x, dim, index, *, sparse_grad=False):
    axis = _axis(dim, x.ndim)
    ctx.bound_index(index, x.shape[axis], f"gather on an axis of {x.shape[axis]}")
    index = _index_value(ctx, index, x.shape[axis])
    if index.shape != x.shape:
        x = slice_to(x, index.shape, axis)
    return _op("take_along_axis", x, index, axis=axis)


@lowers(aten.scatter_add.default)
def _scatter_add(ctx, x, dim, index, src):
    axis = _axis(dim, x.ndim)
    index = _index_value(ctx, index, x.shape[axis])
    if src.shape != index.shape:
        src = slice_to(src, index.shape, -1)
    return _op("scatter_add", x, index, src, axis=axis)


def slice_to(x, shape, keep_axis):
    """``x`` cut down to ``shape`` on every axis but ``keep_axis`` (torch.gather reads a prefix)."""
    for axis, d in enumerate(shape):
        if axis != keep_axis and d != x.shape[axis]:
            x = slice_axis(x, axis, 0, d)
    return x


# -- linear algebra, convolution and pooling ---------------------------------------------------------------


@lowers(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(ctx, a, b):
    return _op("matmul", a, b)


@lowers(aten.addmm.default, aten.baddbmm.default)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    prod = _op("matmul", a, b)
    if alpha != 1:
        prod = _op("mul", prod, _const(ctx.graph, alpha, prod.dtype))
    if beta == 0:
        return prod
    if beta != 1:
        bias = _op("mul", bias, _const(ctx.graph, beta, bias.dtype))
    return _op("add", prod, bias)


@lowers(aten.convolution.default)
def _convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    spatial = x.ndim - 2
    if spatial == 3 and transposed:
        window = {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation)}
        out = popir.ops.conv_transpose3d(x, w, output_padding=tuple(output_padding), groups=groups, **window)
        return out if bias is None else _op("add", out, _op("reshape", bias, shape=(1, bias.shape[0], 1, 1, 1)))
    if spatial == 3 and not transposed:
        out = popir.ops.conv3d(
            x, w, stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=groups
        )
        return out if bias is None else _op("add", out, _op("reshape", bias, shape=(1, bias.shape[0], 1, 1, 1)))
    if spatial not in (1, 2):
        raise Error(f"only 1-d, 2-d and 3-d convolutions are supported, got {spatial}-d")
    if transposed:
        conv_transpose = popir.ops.conv_transpose1d if spatial == 1 else popir.ops.conv_transpose2d
        window = {"stride": stride, "padding": padding, "output_padding": output_padding, "dilation": dilation}
        window = {k: (v[0] if spatial == 1 else tuple(v)) for k, v in window.items()}
        out = conv_transpose(x, w, groups=groups, **window)
        if bias is not None:
            out = _op("add", out, _op("reshape", bias, shape=(1, bias.shape[0]) + (1,) * spatial))
        return out
    if spatial == 1:
        x = _op("reshape", x, shape=(x.shape[0], x.shape[1], 1, x.shape[2]))
        w = _op("reshape", w, shape=(w.shape[0], w.shape[1], 1, w.shape[2]))
        stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
    out = _op(
        "conv2d", x, w, stride=tuple(stride), padding=_pad_pairs(padding), dilation=tuple(dilation), groups=groups
    )
    if bias is not None:
        out = _op("add", out, _op("reshape", bias, shape=(1, bias.shape[0], 1, 1)))
    return _op("reshape", out, shape=_out_shape(ctx)) if spatial == 1 else out


def _pad_pairs(padding):
    return tuple((int(p), int(p)) for p in _pair(padding))


def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    return (v, v) if isinstance(v, int) else (tuple(v) * 2 if len(v) == 1 else tuple(v))


@lowers(aten.max_pool2d_with_indices.default, aten.max_pool2d.default)
def _max_pool2d(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    kernel = _pair(kernel_size)
    out = _op(
        "max_pool2d",
        x,
        kernel=kernel,
        stride=_pair(stride, kernel),
        padding=_pad_pairs(padding),
        dilation=_pair(dilation),
        ceil_mode=bool(ceil_mode),
    )
    return (out, None) if ctx.node.target is aten.max_pool2d_with_indices.default else out


@lowers(aten.avg_pool2d.default)
def _avg_pool2d(
    ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    kernel = _pair(kernel_size)
    return popir.ops.avg_pool2d(
        x, kernel, _pair(stride, kernel), _pair(padding), bool(ceil_mode), bool(count_include_pad), divisor_override
    )


@lowers(aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(ctx, x, output_size):
    return popir.ops.adaptive_max_pool2d(x, tuple(output_size)), None


@lowers(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(ctx, x, output_size):
    if x.ndim == 3:
        out = popir.ops.adaptive_avg_pool2d(_op("reshape", x, shape=(1,) + x.shape), tuple(output_size))
        return _op("reshape", out, shape=_out_shape(ctx))
    return popir.ops.adaptive_avg_pool2d(x, tuple(output_size))


@lowers(aten.max_pool3d_with_indices.default)
def _max_pool3d(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return popir.ops.max_pool3d(x, tuple(kernel_size), tuple(stride) or None, padding, dilation, bool(ceil_mode)), None


@lowers(aten.avg_pool3d.default)
def _avg_pool3d(
    ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    if divisor_override is not None:
        raise Error("avg_pool3d with divisor_override is not supported")
    return popir.ops.avg_pool3d(x, tuple(kernel_size), tuple(stride) or None, padding, ceil_mode, count_include_pad)


@lowers(aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(ctx, x, output_size):
    return popir.ops.adaptive_avg_pool3d(x, tuple(output_size))


# -- normalisation, softmax and dropout ----------------------------------------------------------------------


def log_softmax(x, axis):
    """Numerically stable log-softmax of ``x`` along ``axis``."""
    shifted = _op("sub", x, _op("reduce_max", x, axes=(axis,), keepdims=True))
    return _op("sub", shifted, _op("log", _op("reduce_sum", _op("exp", shifted), axes=(axis,), keepdims=True)))


def softmax(x, axis):
    """Numerically stable softmax of ``x`` along ``axis``."""
    e = _op("exp", _op("sub", x, _op("reduce_max", x, axes=(axis,), keepdims=True)))
    return _op("div", e, _op("reduce_sum", e, axes=(axis,), keepdims=True))


@lowers(aten._softmax.default, aten.softmax.int)
def _softmax(ctx, x, dim, half_to_float=False):
    return softmax(_cast(x, _out_dtype(ctx)), _axis(dim, x.ndim))


@lowers(aten._log_softmax.default, aten.log_softmax.int)
def _log_softmax(ctx, x, dim, half_to_float=False):
    return log_softmax(_cast(x, _out_dtype(ctx)), _axis(dim, x.ndim))


def _normalise(x, mean, var, eps):
    rstd = _op("rsqrt", _op("add", var, _const(x.graph, eps, x.dtype)))
    return _op("mul", _op("sub", x, mean), rstd), rstd


def _affine(y, weight, bias, shape):
    if weight is not None:
        y = _op("mul", y, _op("reshape", weight, shape=shape))
    if bias is not None:
        y = _op("add", y, _op("reshape", bias, shape=shape))
    return y


@lowers(aten.native_layer_norm.default)
def _layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    var, mean = variance(x, axes, 0, True)
    y, rstd = _normalise(x, mean, var, eps)
    return _affine(y, weight, bias, tuple(normalized_shape)), mean, rstd


@lowers(aten.native_group_norm.default)
def _group_norm(ctx, x, weight, bias, n, c, hxw, group, eps):
    grouped = _op("reshape", x, shape=(n, group, (c // group) * hxw))
    var, mean = variance(grouped, (2,), 0, True)
    y, rstd = _normalise(grouped, mean, var, eps)
    y = _affine(_op("reshape", y, shape=x.shape), weight, bias, (1, c) + (1,) * (x.ndim - 2))
    return y, _op("reshape", mean, shape=(n, group)), _op("reshape", rstd, shape=(n, group))


def _bn_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    var, mean = variance(x, axes, 0, True)
    return var, mean, _count(x, axes)


@lowers(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        y, _ = _normalise(
            x, _op("reshape", running_mean, shape=_bn_shape(x)), _op("reshape", running_var, shape=_bn_shape(x)), eps
        )
        y = _affine(y, weight, bias, _bn_shape(x))
        return y, None, None, running_mean, running_var
    var, mean, n = _batch_stats(x)
    y, rstd = _normalise(x, mean, var, eps)
    y = _affine(y, weight, bias, _bn_shape(x))
    g = ctx.graph
    m = _const(g, momentum, x.dtype)
    keep = _const(g, 1.0 - momentum, x.dtype)
    flat_mean = _op("reshape", mean, shape=running_mean.shape)
    unbiased = _op("mul", _op("reshape", var, shape=running_var.shape), _const(g, n / max(n - 1, 1), x.dtype))
    new_mean = _op("add", _op("mul", running_mean, keep), _op("mul", flat_mean, m))
    new_var = _op("add", _op("mul", running_var, keep), _op("mul", unbiased, m))
    return y, flat_mean, _op("reshape", rstd, shape=running_var.shape), new_mean, new_var


@lowers(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    y, _ = _normalise(
        x, _op("reshape", running_mean, shape=_bn_shape(x)), _op("reshape", running_var, shape=_bn_shape(x)), eps
    )
    return _affine(y, weight, bias, _bn_shape(x)), None, None


@lowers(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(ctx, x, weight, bias, training, momentum, eps):
    var, mean, _ = _batch_stats(x)
    y, rstd = _normalise(x, mean, var, eps)
    flat = (x.shape[1],)
    return _affine(y, weight, bias, _bn_shape(x)), _op("reshape", mean, shape=flat), _op("reshape", rstd, shape=flat)


def dropout(ctx, x, p):
    """Inverted dropout with the device RNG: (output, keep mask)."""
    u = _op("random_uniform", ctx.random_seed(), shape=x.shape, dtype="float32")
    keep = _op("ge", u, _const(ctx.graph, p, "float32"))
    scaled = _op("mul", x, _const(ctx.graph, 1.0 / (1.0 - p), x.dtype))
    return _op("where", keep, scaled, _const(ctx.graph, 0.0, x.dtype)), keep


@lowers(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    if not train or p == 0:
        return x, _op("broadcast_to", _const(ctx.graph, True, "bool"), shape=x.shape)
    if p >= 1:
        zeros = _op("broadcast_to", _const(ctx.graph, 0.0, x.dtype), shape=x.shape)
        return zeros, _op("broadcast_to", _const(ctx.graph, False, "bool"), shape=x.shape)
    return dropout(ctx, x, p)


@lowers(aten.scaled_dot_product_attention.default)
def _attention(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype != "bool":
        attn_mask = _cast(attn_mask, q.dtype)
    seed = ctx.random_seed() if dropout_p > 0 else None
    return popir.ops.scaled_dot_product_attention(
        q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale, seed, bool(enable_gqa)
    )


@lowers(aten.bernoulli.p)
def _bernoulli(ctx, x, p=0.5, *, generator=None):
    u = _op("random_uniform", ctx.random_seed(), shape=x.shape, dtype="float32")
    return _cast(_op("lt", u, _const(ctx.graph, p, "float32")), _out_dtype(ctx))


@lowers(aten.rand.default, aten.rand_like.default)
def _rand(ctx, *args, **kwargs):
    return _cast(_op("random_uniform", ctx.random_seed(), shape=_out_shape(ctx), dtype="float32"), _out_dtype(ctx))


@lowers(aten.randn.default, aten.randn_like.default)
def _randn(ctx, *args, **kwargs):
    return _cast(popir.ops.normal(ctx.random_seed(), _out_shape(ctx)), _out_dtype(ctx))


def _normal_of(ctx, mean, std):
    """mean + std * a standard normal draw of the result's shape (mean and std tensors or numbers)."""
    dtype = _out_dtype(ctx)
    z = _cast(popir.ops.normal(ctx.random_seed(), _out_shape(ctx)), dtype)
    return _op("add", _op("mul", z, _as_value(ctx, std, dtype)), _as_value(ctx, mean, dtype))


@lowers(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def _normal(ctx, mean=0.0, std=1.0, *, generator=None):
    return _normal_of(ctx, mean, std)


@lowers(aten.normal.float_float)
def _normal_sized(ctx, mean, std, size, *, generator=None, **kwargs):
    return _normal_of(ctx, mean, std)


@lowers(aten.normal_functional.default)
def _normal_like(ctx, x, mean=0.0, std=1.0, *, generator=None):
    return _normal_of(ctx, mean, std)


@lowers(aten.uniform.default)
def _uniform(ctx, x, low=0.0, high=1.0, *, generator=None):
    u = popir.ops.uniform(ctx.random_seed(), _out_shape(ctx), float(low), float(high))
    return _cast(u, _out_dtype(ctx))


@lowers(aten.exponential.default)
def _exponential(ctx, x, lambd=1.0, *, generator=None):
    return _cast(popir.ops.exponential(ctx.random_seed(), _out_shape(ctx), float(lambd)), _out_dtype(ctx))


@lowers(aten.randperm.default)
def _randperm(ctx, n, **kwargs):
    return popir.ops.randperm(ctx.random_seed(), int(n))


# -- losses ------------------------------------------------------------------------------------------------------

_REDUCTION_ENUM = {0: "none", 1: "mean", 2: "sum"}


def _reduction(reduction):
    """torch's loss reduction enum (0/1/2) as popir's name ("none", "mean", "sum")."""
    return _REDUCTION_ENUM.get(reduction, reduction)


@lowers(torch.ops.poptorch.identity_loss.default)
def _identity_loss(ctx, x, reduction):
    if reduction not in REDUCTIONS:
        raise Error(f"identity_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return popir.ops.reduce_loss(x, reduction)


# The losses below are popir's composites (one definition of each formula); only the ATen argument order and
# the reduction enum are translated here.
@lowers(aten.mse_loss.default)
def _mse_loss(ctx, a, b, reduction=1):
    return popir.ops.mse_loss(a, b, _reduction(reduction))


@lowers(aten.l1_loss.default)
def _l1_loss(ctx, a, b, reduction=1):
    return popir.ops.l1_loss(a, b, _reduction(reduction))


@lowers(aten.smooth_l1_loss.default)
def _smooth_l1_loss(ctx, a, b, reduction=1, beta=1.0):
    return popir.ops.smooth_l1_loss(a, b, _reduction(reduction), beta=beta)


@lowers(aten.huber_loss.default)
def _huber_loss(ctx, a, b, reduction=1, delta=1.0):
    return popir.ops.huber_loss(a, b, _reduction(reduction), delta=delta)


def nll(logp, target, weight, reduction, ignore_index):
    """Negative log-likelihood of class indices ``target`` under log-probabilities ``logp`` (class axis 1)."""
    g = logp.graph
    if logp.ndim == 1:
        logp = _op("reshape", logp, shape=(1,) + logp.shape)
        target = _op("reshape", target, shape=(1,))
    target = _cast(target, "int32")
    valid = _op("ne", target, _const(g, ignore_index, "int32"))
    safe = _op("where", valid, target, _const(g, 0, "int32"))
    picked = _op("take_along_axis", logp, _op("reshape", safe, shape=(safe.shape[0], 1) + safe.shape[1:]), axis=1)
    picked = _op("reshape", picked, shape=safe.shape)
    w = _cast(valid, logp.dtype)
    if weight is not None:
        w = _op("mul", w, _op("gather", weight, safe, axis=0))
    losses = _op("neg", _op("mul", picked, w))
    reduction = _reduction(reduction)
    total_weight = _op("reduce_sum", w, axes=None, keepdims=False)
    if reduction == "none":
        return losses, total_weight
    total = _op("reduce_sum", losses, axes=None, keepdims=False)
    return (_op("div", total, total_weight) if reduction == "mean" else total), total_weight


@lowers(aten.nll_loss.default, aten.nll_loss_nd.default, aten.nll_loss2d.default)
def _nll_loss(ctx, logp, target, weight=None, reduction=1, ignore_index=-100):
    _bound_target(ctx, target, logp, ignore_index)
    reduction = _reduction(reduction)
    out = popir.ops.nll_loss(logp, _cast(target, "int32"), weight, reduction, ignore_index)
    return _reshaped(out, _out_shape(ctx))


def _bound_target(ctx, target, scores, ignore_index):
    classes = scores.shape[1] if scores.ndim > 1 else scores.shape[0]
    ctx.bound_index(target, classes, f"class labels of {classes} classes", allowed=(ignore_index,))


def _reshaped(x, shape):
    return x if x.shape == tuple(shape) else _op("reshape", x, shape=tuple(shape))


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(ctx, logp, target, weight, reduction, ignore_index):
    _bound_target(ctx, target, logp, ignore_index)
    out, total_weight = nll(logp, target, weight, reduction, ignore_index)
    return _op("reshape", out, shape=_out_shape(ctx, 0)), total_weight


@lowers(aten.cross_entropy_loss.default)
def _cross_entropy(ctx, logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    if not target.dtype.is_float:
        _bound_target(ctx, target, logits, ignore_index)
        target = _cast(target, "int32")
    reduction = _reduction(reduction)
    out = popir.ops.cross_entropy(logits, target, weight, reduction, ignore_index, label_smoothing)
    return _reshaped(out, _out_shape(ctx))


@lowers(aten.binary_cross_entropy.default)
def _bce(ctx, p, y, weight=None, reduction=1):
    return popir.ops.binary_cross_entropy(p, y, weight, _reduction(reduction))


@lowers(aten.binary_cross_entropy_with_logits.default)
def _bce_logits(ctx, x, y, weight=None, pos_weight=None, reduction=1):
    return popir.ops.binary_cross_entropy_with_logits(x, y, weight, _reduction(reduction), pos_weight)


@lowers(aten.kl_div.default)
def _kl_div(ctx, logq, target, reduction=1, *, log_target=False):
    return popir.ops.kl_div(logq, target, _reduction(reduction), log_target)


@lowers(aten.poisson_nll_loss.default)
def _poisson_nll_loss(ctx, x, target, log_input, full, eps, reduction):
    return popir.ops.poisson_nll_loss(x, target, bool(log_input), bool(full), eps, _reduction(reduction))


@lowers(aten.hinge_embedding_loss.default)
def _hinge_embedding_loss(ctx, x, target, margin=1.0, reduction=1):
    return popir.ops.hinge_embedding_loss(x, _cast(target, x.dtype), margin, _reduction(reduction))


@lowers(aten.soft_margin_loss.default)
def _soft_margin_loss(ctx, x, target, reduction=1):
    return popir.ops.soft_margin_loss(x, _cast(target, x.dtype), _reduction(reduction))


@lowers(aten.cosine_embedding_loss.default)
def _cosine_embedding_loss(ctx, a, b, target, margin=0.0, reduction=1):
    return popir.ops.cosine_embedding_loss(a, b, _cast(target, a.dtype), margin, _reduction(reduction))


@lowers(aten.margin_ranking_loss.default)
def _margin_ranking_loss(ctx, a, b, target, margin=0.0, reduction=1):
    return popir.ops.margin_ranking_loss(a, b, _cast(target, a.dtype), margin, _reduction(reduction))


@lowers(aten.triplet_margin_loss.default)
def _triplet_margin_loss(ctx, anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False, reduction=1):
    return popir.ops.triplet_margin_loss(anchor, positive, negative, margin, p, eps, bool(swap), _reduction(reduction))


@lowers(torch.ops.poptorch.ctc_loss.default)
def _ctc_loss(ctx, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    ctx.bound_index(targets, log_probs.shape[2], f"CTC targets of {log_probs.shape[2]} classes")
    lengths = [_cast(v, "int32") for v in (targets, input_lengths, target_lengths)]
    return popir.ops.ctc_loss(log_probs, *lengths, blank, reduction, bool(zero_infinity))


@lowers(torch.ops.poptorch.custom_operation.default)
def _custom_operation(ctx, inputs, name, domain, domain_version, attributes, example_outputs):
    outs = ctx.graph.apply(_custom_op.popir_op(name, domain), list(inputs), _custom_op.attributes_of(attributes))
    got, want = [(o.shape, o.dtype) for o in outs], [(e.shape, e.dtype) for e in example_outputs]
    if got != want:
        raise Error(f"custom_op {name!r}: the op gives outputs {got} but example_outputs describe {want}")
    return list(outs)


TABLE[operator.getitem] = lambda ctx, values, index: values[index]

# Shape arithmetic export emits around ops with a data-dependent size (bincount): every popir shape is static,
# so it evaluates on plain ints (the assertions it feeds are dropped, IGNORED_OPS).
TABLE[aten.sym_size.int] = lambda ctx, x, dim: x.shape[dim]
for _compare_ints in (operator.ge, operator.gt, operator.le, operator.lt, operator.eq):
    TABLE[_compare_ints] = lambda ctx, a, b, fn=_compare_ints: fn(a, b)
