"""``Precision.enableFloatingPointExceptions``: an op producing inf or NaN raises, naming the op and line.

The IPU traps on overflow, invalid operations and division by zero. The simulator instruments each
program instead: every float value a node produces gets a scalar flag output (0 finite, 1 inf, 2 NaN),
named after the node's op and source line, and after each run the first flagged node, in program order,
is the op that produced the first non-finite value.
"""

import numpy as np

import popir
from poptorch.errors import Error

PREFIX = "_fpcheck."
_NAN_FLAG, _INF_FLAG = 2.0, 1.0
# Ops that make no new values: a constant's or a graph input's inf was not produced by the model's math.
_SKIPPED_OPS = frozenset({"constant"})


def instrument(graphs):
    """Add a non-finite flag output for every float value of every graph in ``{program: Graph}``."""
    for graph in graphs.values():
        for index, node in enumerate(list(graph.nodes)):
            if node.op in _SKIPPED_OPS:
                continue
            for value in node.outputs:
                if value.dtype.is_float:
                    where = node.source or "an unknown line"
                    graph.output(f"{PREFIX}{index:06d} {node.op} at {where}", _flag(graph, value))
    return graphs


def _flag(graph, value):
    with graph.source_line(None):
        is_nan = popir.ops.ne(value, value)
        is_inf = popir.ops.eq(popir.ops.abs(value), graph.constant(np.array(np.inf), dtype=value.dtype))
        as_float = [popir.ops.cast(b, dtype="float32") for b in (is_nan, is_inf)]
        flags = as_float[0] * graph.constant(np.float32(_NAN_FLAG)) + as_float[1]
        return popir.ops.reduce_max(flags, axes=None, keepdims=False)


def check(result):
    """Remove the flag outputs from a run's ``result``; raise for the first op that produced inf or NaN."""
    flags = sorted(name for name in result if name.startswith(PREFIX))
    first = None
    for name in flags:
        flag = float(np.max(result.pop(name)))
        if first is None and flag > 0:
            first = (name, flag)
    if first is not None:
        name, flag = first
        what = "NaN" if flag >= _NAN_FLAG else "inf"
        description = name[len(PREFIX) :].split(" ", 1)[1]
        op, _, location = description.partition(" at ")
        raise Error(
            f"Floating-point exception: {op} produced {what} at {location} "
            "(Precision.enableFloatingPointExceptions is set; disable it to let inf and NaN through)",
            type="floating_point_exception",
            location=location,
        )
