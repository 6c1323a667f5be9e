"""Host callbacks: ``host_call`` runs a function registered on the host in the middle of a graph.

A frontend registers a function under a name (``register_host_callback``); the node holds only the name and
its results' types, so a graph stays plain data. The function takes and returns NumPy arrays. The op is
opaque to autodiff: no gradient flows through a host callback.
"""

import numpy as np

from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import numpy_dtype
from popir.registry import defop

_CALLBACKS = {}
# Ops with an effect on the host: each node runs at run time, once per execution, so passes neither merge
# two of them nor evaluate one at compile time.
HOST_OPS = frozenset({"host_call"})


def register_host_callback(name, fn):
    """Make ``fn(*arrays) -> array or tuple of arrays`` the host function ``host_call`` nodes named ``name``
    run (replacing any earlier one of that name)."""
    if not isinstance(name, str) or not name:
        raise IRError(f"a host callback needs a non-empty string name, got {name!r}")
    if not callable(fn):
        raise IRError(f"host callback {name!r} must be callable, got {type(fn).__name__}")
    _CALLBACKS[name] = fn


def run_host_callback(name, arrays, out_types, fn=None):
    """Run host callback ``name`` (``fn`` if given, else the function registered under ``name``) on
    ``arrays``; its results, checked against ``out_types`` ((shape, dtype) pairs) and cast to those dtypes.
    An exception of the callback propagates unchanged."""
    fn = fn or _CALLBACKS.get(name)
    if fn is None:
        raise IRError(f"no host callback {name!r} is registered in this process; register_host_callback it first")
    results = fn(*arrays)
    results = list(results) if isinstance(results, list | tuple) else [results]
    if len(results) != len(out_types):
        raise IRError(f"host callback {name!r} returned {len(results)} results, expected {len(out_types)}")
    checked = []
    for i, (result, (shape, dtype)) in enumerate(zip(results, out_types)):
        array = np.asarray(result)
        if array.shape != tuple(shape):
            raise IRError(f"host callback {name!r}: result {i} has shape {list(array.shape)}, expected {list(shape)}")
        checked.append(array.astype(numpy_dtype(dtype), copy=False))
    return tuple(checked)


def _infer(*inputs, callback, out_types):
    if not isinstance(callback, str) or not callback:
        raise IRError(f"host_call needs a callback name, got {callback!r}")
    if not out_types:
        raise IRError("host_call needs at least one result")
    return tuple(TensorType.of(shape, dtype) for shape, dtype in out_types)


def _ref(*arrays, callback, out_types):
    return run_host_callback(callback, arrays, out_types)


host_call = defop(
    "host_call",
    infer=_infer,
    ref=_ref,
    differentiable=False,
    doc="Run the registered host callback ``callback`` on the inputs; results typed by ``out_types``.",
)
