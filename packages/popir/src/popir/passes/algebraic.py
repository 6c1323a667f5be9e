"""Algebraic simplification: identities that remove work without changing any value.

- x*1, 1*x, x+0, 0+x, x-0, x/1 (a constant counts when all its elements hold the value, also seen
  through broadcast_to and reshape: autodiff seeds are broadcast scalars);
- transpose of transpose (perms composed, identity dropped), reshape of reshape, broadcast_to of
  broadcast_to, and each of them, cast, slice, pad or concat when it returns its input unchanged;
- reduce_sum over axes of size 1 only; reshape of a reduce_sum to its keepdims shape;
- an explicit broadcast_to of an operand of a broadcasting elementwise op when the other operands
  already give the result its shape.

Matrix transposes move to where they are smallest: (A B)^T -> B^T A^T and A W^T -> (W A^T)^T (and
W^T B -> (B^T W)^T) whenever the transposes left to materialise hold fewer elements than the ones removed,
so a linear layer's large weight is never transposed, only its small activations and gradients.

The inexact rewrites: x+0 -> x keeps a -0.0 that x+0 would have made +0.0 (the two compare equal), and a
transposed matmul may sum its K products in another grouping on a device that splits K differently.
"""

import numpy as np

from popir.dtypes import DType, as_dtype
from popir.ops._infer import broadcast_shapes, norm_axes
from popir.passes._rebuild import Rebuilder, constant_array, producer_op


def filled_with(builder, value, fill):
    """Whether every element of ``value`` is a constant equal to ``fill``."""
    key = ("filled", value.id, fill)
    known = builder.memo.get(key)
    if known is None:
        op = producer_op(value)
        if op == "constant":
            known = bool(np.all(constant_array(value) == fill))
        elif op in ("broadcast_to", "reshape"):
            known = filled_with(builder, value.producer.inputs[0], fill)
        else:
            known = False
        builder.memo[key] = known
    return known


def _as_shape(builder, x, shape):
    """``x`` itself when it already has ``shape``, else ``x`` broadcast to it."""
    return x if x.shape == shape else builder.apply("broadcast_to", [x], {"shape": shape})[0]


def _identity_operand(builder, keep, drop, other, fill):
    """``keep`` (broadcast to the result shape) when ``drop`` is filled with ``fill``, else None."""
    if not filled_with(builder, drop, fill):
        return None
    return [_as_shape(builder, keep, broadcast_shapes(keep.shape, other.shape))]


def _add(builder, a, b, attrs):
    return _identity_operand(builder, a, b, b, 0) or _identity_operand(builder, b, a, a, 0)


def _mul(builder, a, b, attrs):
    return _identity_operand(builder, a, b, b, 1) or _identity_operand(builder, b, a, a, 1)


def _sub(builder, a, b, attrs):
    return _identity_operand(builder, a, b, b, 0)


def _div(builder, a, b, attrs):
    return _identity_operand(builder, a, b, b, 1)


def _transpose(builder, x, attrs):
    perm = attrs["perm"]
    if perm == (1, 0) and (swapped := _transposed_matmul(builder, x)) is not None:
        return swapped
    if producer_op(x) == "transpose":
        inner = x.producer
        perm = tuple(inner.attrs["perm"][p] for p in perm)
        x = inner.inputs[0]
    elif perm != tuple(range(len(perm))):
        return None
    if perm == tuple(range(len(perm))):
        return [x]
    return builder.apply("transpose", [x], {"perm": perm})


def _is_matrix_transpose(x):
    return producer_op(x) == "transpose" and x.ndim == 2 and x.producer.attrs["perm"] == (1, 0)


def _transposed(builder, x):
    """x^T of a matrix: the source of a transpose, else a new transpose."""
    if _is_matrix_transpose(x):
        return x.producer.inputs[0]
    return builder.apply("transpose", [x], {"perm": (1, 0)})[0]


def _new_transpose_elements(*values):
    """Elements that transposing ``values`` would materialise (a transpose's source comes free)."""
    return sum(v.type.size for v in values if not _is_matrix_transpose(v))


def _transposed_matmul(builder, x):
    """(A B)^T -> B^T A^T when the new transposes are smaller than the result."""
    if producer_op(x) != "matmul" or x.ndim != 2:
        return None
    a, b = x.producer.inputs
    if a.ndim != 2 or b.ndim != 2 or _new_transpose_elements(a, b) >= x.type.size:
        return None
    return builder.apply("matmul", [_transposed(builder, b), _transposed(builder, a)], {})


def _matmul(builder, a, b, attrs):
    """A W^T -> (W A^T)^T and W^T B -> (B^T W)^T when W outweighs the transposes that replace its own."""
    if a.ndim != 2 or b.ndim != 2:
        return None
    out = a.shape[0] * b.shape[1]
    for wt, other in ((b, a), (a, b)):
        if _is_matrix_transpose(wt) and _new_transpose_elements(other) + out < wt.type.size:
            w = wt.producer.inputs[0]
            inner = [w, _transposed(builder, other)] if wt is b else [_transposed(builder, other), w]
            product = builder.apply("matmul", inner, {})[0]
            return builder.apply("transpose", [product], {"perm": (1, 0)})
    return None


def _reshape(builder, x, attrs):
    shape = attrs["shape"]
    if producer_op(x) == "reduce_sum" and not x.producer.attrs["keepdims"]:
        source = x.producer.inputs[0]
        axes = norm_axes(x.producer.attrs["axes"], source.ndim)
        if shape == tuple(1 if i in axes else d for i, d in enumerate(source.shape)):
            return builder.apply("reduce_sum", [source], {"axes": axes, "keepdims": True})
    if producer_op(x) == "reshape":
        x = x.producer.inputs[0]
    elif x.shape != shape:
        return None
    return [x] if x.shape == shape else builder.apply("reshape", [x], {"shape": shape})


def _broadcast_to(builder, x, attrs):
    shape = attrs["shape"]
    if producer_op(x) == "broadcast_to":
        x = x.producer.inputs[0]
    elif x.shape != shape:
        return None
    return [_as_shape(builder, x, shape)]


def _cast(builder, x, attrs):
    return [x] if as_dtype(attrs["dtype"]) is x.dtype else None


def _reduce_sum(builder, x, attrs):
    axes = norm_axes(attrs["axes"], x.ndim)
    if any(x.shape[a] != 1 for a in axes):
        return None
    if attrs["keepdims"] or not axes:
        return [x]
    return builder.apply("reshape", [x], {"shape": tuple(d for i, d in enumerate(x.shape) if i not in axes)})


def _slice(builder, x, attrs):
    # Steps are positive, so a slice as long as its input on every axis takes all of it.
    return [x] if builder.infer("slice", [x], attrs)[0].shape == x.shape else None


def _pad(builder, x, attrs):
    return [x] if all(lo == hi == 0 for lo, hi in attrs["pads"]) else None


_UNARY = {
    "transpose": _transpose,
    "reshape": _reshape,
    "broadcast_to": _broadcast_to,
    "cast": _cast,
    "reduce_sum": _reduce_sum,
    "slice": _slice,
    "pad": _pad,
}
_BINARY = {"add": _add, "sub": _sub, "mul": _mul, "div": _div}
# Ops that broadcast all their operands against each other, so an explicit broadcast_to of an operand is
# redundant whenever the other operands already give the result its shape.
BROADCASTING = frozenset("add sub mul div pow maximum minimum eq ne lt le gt ge logical_and logical_or where".split())


def _absorb_broadcasts(builder, op, inputs, attrs, types):
    if not any(producer_op(v) == "broadcast_to" for v in inputs):
        return None
    shape = broadcast_shapes(*(v.shape for v in inputs))
    inputs = list(inputs)
    absorbed = False
    for i, v in enumerate(inputs):
        if producer_op(v) == "broadcast_to":
            source = v.producer.inputs[0]
            if broadcast_shapes(*(source.shape if j == i else w.shape for j, w in enumerate(inputs))) == shape:
                inputs[i], absorbed = source, True
    return builder.apply(op, inputs, attrs, types) if absorbed else None


def simplify_rule(builder, op, inputs, attrs, types):
    """Rewrite rule: a simpler equivalent of the node, or None."""
    result = None
    if op in _UNARY:
        result = _UNARY[op](builder, inputs[0], attrs)
    elif op == "concat" and len(inputs) == 1:
        result = [inputs[0]]
    elif op == "matmul":
        result = _matmul(builder, inputs[0], inputs[1], attrs)
    elif op in BROADCASTING:
        if op in _BINARY and inputs[0].dtype is not DType.bool:
            result = _BINARY[op](builder, inputs[0], inputs[1], attrs)
        if result is None:
            result = _absorb_broadcasts(builder, op, inputs, attrs, types)
    if result is not None:
        builder.changes += 1
    return result


def simplify(graph):
    """A new graph with the algebraic identities above applied."""
    return Rebuilder(graph, [simplify_rule]).replay()
