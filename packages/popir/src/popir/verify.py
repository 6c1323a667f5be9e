"""The graph checker: structure and every op's shape rule, re-checked from scratch."""

from popir.errors import IRError
from popir.graph import INPUT_KINDS, TensorType
from popir.registry import get_op


def verify(graph):
    """Raise IRError unless ``graph`` is well formed. Values are matched by identity, so a value of
    another graph (even one with the same id) is never taken for one of this graph's."""
    defined, ids = set(), set()
    for v in graph.inputs:
        if v.kind not in INPUT_KINDS or v.name is None:
            raise IRError(f"graph input %{v.id} needs a name and a kind, has {v.name!r}, {v.kind!r}")
        _define(graph, defined, ids, v)
    for node in graph.nodes:
        for v in node.inputs:
            if v not in defined:
                raise IRError(f"{node.describe()}: input %{v.id} {_why_undefined(graph, v)}")
        result = get_op(node.op).infer(*[v.type for v in node.inputs], **node.attrs)
        types = [result] if isinstance(result, TensorType) else list(result)
        if [TensorType.of(*t) for t in types] != [v.type for v in node.outputs]:
            raise IRError(f"{node.describe()}: outputs {[str(v.type) for v in node.outputs]} disagree with its rule")
        for v in node.outputs:
            if v.producer is not node:
                raise IRError(f"{node.describe()}: output %{v.id} names another producer")
            _define(graph, defined, ids, v)
    for name, v in graph.outputs.items():
        if v not in defined:
            raise IRError(f"output {name!r}: value %{getattr(v, 'id', v)} {_why_undefined(graph, v)}")
    for state, v in graph.updates.items():
        if state.kind == "input" or state not in defined or v not in defined or state.type != v.type:
            raise IRError(f"update of {state.name!r} is invalid")


def _why_undefined(graph, value):
    if getattr(value, "graph", None) is not graph:
        return f"belongs to another graph, not {graph.name!r}"
    return "is used before it is defined"


def _define(graph, defined, ids, value):
    if value.graph is not graph:
        raise IRError(f"value %{value.id} belongs to another graph, not {graph.name!r}")
    if value.id in ids:
        raise IRError(f"value %{value.id} is defined twice")
    ids.add(value.id)
    defined.add(value)
