"""popir: the graph IR of the simulated IPU stack (NumPy only, never torch).

A ``Graph`` of ``Value``s and ``Node``s; one op registry (shape rule, NumPy reference, VJP per
primitive); reverse-mode ``autodiff.grad``; the reference ``interpreter``; passes; serialization.
"""

from importlib.metadata import version as _version

from popir import autodiff, interpreter, ops, passes
from popir.dtypes import DType, as_dtype
from popir.errors import IRError
from popir.graph import Graph, Node, TensorType, Value
from popir.registry import OpDef, all_ops, defop, get_op

__version__ = _version("popir")

__all__ = [
    "DType",
    "Graph",
    "IRError",
    "Node",
    "OpDef",
    "TensorType",
    "Value",
    "__version__",
    "all_ops",
    "as_dtype",
    "autodiff",
    "defop",
    "get_op",
    "interpreter",
    "ops",
    "passes",
]
