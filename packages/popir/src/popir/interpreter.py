"""The reference interpreter: runs a graph with the NumPy reference of every primitive."""

import numpy as np

from popir.dtypes import as_dtype
from popir.errors import IRError
from popir.registry import get_op


def evaluate(graph, feeds, compute_dtype=None):
    """All values of ``graph`` given arrays for every graph input; returns {value id: ndarray}.

    ``compute_dtype`` (tests only, e.g. np.float64) replaces every floating-point dtype of the graph,
    including float ``dtype`` attributes, so gradients can be checked against finite differences.
    """
    compute = None if compute_dtype is None else np.dtype(compute_dtype)

    def storage(dtype):
        return compute if compute is not None and dtype.is_float else dtype.numpy

    env = {}
    for v in graph.inputs:
        if v.name not in feeds:
            raise IRError(f"no value fed for graph input {v.name!r}")
        array = np.asarray(feeds[v.name])
        if array.shape != v.shape:
            raise IRError(f"input {v.name!r}: expected shape {v.shape}, got {array.shape}")
        env[v.id] = array.astype(storage(v.dtype), copy=False)
    for node in graph.nodes:
        attrs = node.attrs
        if compute is not None and "dtype" in attrs and as_dtype(attrs["dtype"]).is_float:
            attrs = {**attrs, "dtype": compute}
        try:
            result = get_op(node.op).ref(*[env[v.id] for v in node.inputs], **attrs)
        except IRError as exc:  # data-dependent failures (e.g. an index out of range) name their node
            raise IRError(f"{node.describe()}: {exc}") from None
        results = result if isinstance(result, tuple) else (result,)
        for value, array in zip(node.outputs, results):
            env[value.id] = np.asarray(array, dtype=storage(value.dtype)).reshape(value.shape)
    return env


def run(graph, feeds):
    """The named outputs of ``graph`` for ``feeds`` (name -> array, one per graph input)."""
    env = evaluate(graph, feeds)
    return {name: env[v.id] for name, v in graph.outputs.items()}


def step(graph, feeds):
    """One run that also returns the updated state: (outputs, {state name: new array})."""
    env = evaluate(graph, feeds)
    outputs = {name: env[v.id] for name, v in graph.outputs.items()}
    return outputs, {state.name: env[v.id] for state, v in graph.updates.items()}
