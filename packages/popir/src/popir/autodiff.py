"""Reverse-mode autodiff: walk the nodes in reverse and apply each primitive's VJP rule.

Gradients are popir nodes appended to the same graph, so passes optimise them and popsim runs them.
"""

import numpy as np

from popir.errors import IRError
from popir.registry import get_op


def grad(graph, loss, wrt, seed=None, unreached="zeros"):
    """Gradients of ``loss`` with respect to each Value in ``wrt`` (a list of Values, same order).

    ``seed`` is the cotangent of ``loss`` (default: ones). Nodes that do not lie on a path from
    ``wrt`` to ``loss`` are skipped. A Value no gradient reaches (no path, or only through
    non-differentiable ops such as stop_gradient) gets a zero gradient, or None with
    ``unreached="none"`` (torch's ``.grad is None``).
    """
    if unreached not in ("zeros", "none"):
        raise IRError(f"unreached must be 'zeros' or 'none', got {unreached!r}")
    if not loss.dtype.is_float:
        raise IRError(f"cannot differentiate a {loss.dtype} loss")
    with graph.annotate(role="backward"):
        return _grad(graph, loss, wrt, seed, unreached)


def _grad(graph, loss, wrt, seed, unreached):
    needed = _on_path(graph, wrt, loss)
    with graph.placed(loss.producer.placement if loss.producer is not None else None):
        cotangents = {loss.id: seed if seed is not None else _full(graph, loss, 1.0)}
    for node in reversed(graph.nodes):
        if not any(v.id in needed for v in node.outputs):
            continue
        cts = [cotangents.get(v.id) for v in node.outputs]
        if all(ct is None for ct in cts):
            continue
        opdef = get_op(node.op)
        if not opdef.differentiable:
            continue
        # A node's gradient nodes are the backward pass of its module, op and source line, and run where the
        # node ran (its pipeline stage and IPU).
        with graph.annotate(**{**node.annotations(), "role": "backward"}):
            input_cts = opdef.vjp(tuple(node.inputs), tuple(node.outputs), tuple(cts), **node.attrs)
            for value, ct in zip(node.inputs, input_cts):
                if ct is None or value.id not in needed or not value.dtype.is_float:
                    continue
                if ct.type != value.type:
                    raise IRError(f"vjp of {node.describe()} gave {ct.type} for input %{value.id}: {value.type}")
                previous = cotangents.get(value.id)
                cotangents[value.id] = ct if previous is None else previous + ct
    if unreached == "none":
        return [cotangents.get(w.id) for w in wrt]
    return [cotangents[w.id] if w.id in cotangents else _full(graph, w, 0.0) for w in wrt]


def _full(graph, like, fill):
    from popir.ops import broadcast_to

    scalar = graph.constant(np.array(fill, dtype=like.dtype.numpy))
    return broadcast_to(scalar, shape=like.shape) if like.shape else scalar


def _on_path(graph, wrt, loss):
    """Ids of values that depend on some ``wrt`` and on which ``loss`` depends."""
    forward = {w.id for w in wrt}
    for node in graph.nodes:
        if any(v.id in forward for v in node.inputs):
            forward.update(v.id for v in node.outputs)
    backward = {loss.id}
    for node in reversed(graph.nodes):
        if any(v.id in backward for v in node.outputs):
            backward.update(v.id for v in node.inputs)
    return forward & backward
