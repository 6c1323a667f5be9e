"""Common-subexpression elimination: one node per (op, inputs, attributes, placement), constants shared by
value on each placement."""

import numpy as np

from popir.ops.host import HOST_OPS
from popir.passes._rebuild import Rebuilder

# Ops whose result does not depend on the order of their two operands (exactly, in IEEE arithmetic too).
COMMUTATIVE = frozenset({"add", "mul", "eq", "ne", "logical_and", "logical_or"})


def attr_key(value):
    """A hashable key equal for equal attribute values: arrays by dtype, shape and bytes, floats by bits."""
    kind = type(value)
    if kind is tuple:
        return tuple([attr_key(v) for v in value])
    if kind is float:
        # -0.0 == 0.0 in Python, yet the two give different results (pad value, division).
        return ("float", value.hex())
    if kind is np.ndarray:
        return ("array", value.dtype.str, value.shape, value.tobytes())
    return value


class CommonSubexpressions:
    """A rewrite rule: answer a node already emitted with the same op, inputs, attributes and placement.

    Nodes placed on different IPUs stay apart: merging them would make one IPU compute the value and copy it
    over the IPU-Links to the other (a constant made on each IPU costs no link traffic).

    Keep one instance per sweep: it remembers the nodes of the graph being built.
    """

    def __init__(self):
        self.seen = {}

    def __call__(self, builder, op, inputs, attrs, types):
        if op in HOST_OPS:
            return builder.emit(op, inputs, attrs, types)
        ids = [v.id for v in inputs]
        if op in COMMUTATIVE:
            ids.sort()
        attr_keys = tuple((k, attr_key(v)) for k, v in sorted(attrs.items()))
        key = (op, tuple(ids), attr_keys, builder.placement)
        found = self.seen.get(key)
        if found is not None:
            builder.changes += 1
            return found
        outputs = builder.emit(op, inputs, attrs, types)
        self.seen[key] = outputs
        return outputs


def eliminate_common_subexpressions(graph):
    """A new graph in which identical computations are done once."""
    return Rebuilder(graph, [CommonSubexpressions()]).replay()
