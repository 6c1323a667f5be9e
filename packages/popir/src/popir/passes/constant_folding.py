"""Constant folding: evaluate nodes whose inputs are all constants with the ops' NumPy references."""

import numpy as np

from popir.ops.host import HOST_OPS
from popir.passes._rebuild import Rebuilder, constant_array
from popir.registry import get_op

# A folded result is stored in the graph (and in every serialized copy of it), so results above this many
# elements are folded only when they are no larger than an input constant: a scalar broadcast to a big
# shape stays a broadcast.
MAX_FOLDED_ELEMENTS = 4096


def fold_rule(builder, op, inputs, attrs, types):
    """Rewrite rule: a constant for a single-output node of constant inputs, unless the result is huge."""
    if op == "constant" or op in HOST_OPS or not inputs:
        return None
    for v in inputs:
        if v.producer is None or v.producer.op != "constant":
            return None
    arrays = [constant_array(v) for v in inputs]
    if types is None:
        types = builder.infer(op, inputs, attrs)
    if len(types) != 1:
        return None
    (out,) = types
    if out.size > MAX_FOLDED_ELEMENTS and out.size > max(a.size for a in arrays):
        return None
    try:
        with np.errstate(all="ignore"):
            result = get_op(op).ref(*arrays, **attrs)
    except Exception:  # a node that fails on its constants is left to fail at run time, as it would unfolded
        return None
    builder.changes += 1
    return [builder.constant(np.array(result, dtype=out.dtype.numpy, order="C").reshape(out.shape))]


def fold_constants(graph):
    """A new graph in which every foldable node of constants is a constant."""
    return Rebuilder(graph, [fold_rule]).replay()
