"""The graph checker: structure and every op's shape rule, re-checked from scratch."""

from popir.errors import IRError
from popir.graph import INPUT_KINDS, TensorType
from popir.registry import get_op


def verify(graph):
    """Raise IRError unless ``graph`` is well formed."""
    defined = set()
    for v in graph.inputs:
        if v.kind not in INPUT_KINDS or v.name is None:
            raise IRError(f"graph input %{v.id} needs a name and a kind, has {v.name!r}, {v.kind!r}")
        _define(defined, v)
    for node in graph.nodes:
        for v in node.inputs:
            if v.id not in defined:
                raise IRError(f"{node.describe()}: input %{v.id} is used before it is defined")
        result = get_op(node.op).infer(*[v.type for v in node.inputs], **node.attrs)
        types = [result] if isinstance(result, TensorType) else list(result)
        if [TensorType.of(*t) for t in types] != [v.type for v in node.outputs]:
            raise IRError(f"{node.describe()}: outputs {[str(v.type) for v in node.outputs]} disagree with its rule")
        for v in node.outputs:
            if v.producer is not node:
                raise IRError(f"{node.describe()}: output %{v.id} names another producer")
            _define(defined, v)
    for name, v in graph.outputs.items():
        if v.id not in defined:
            raise IRError(f"output {name!r} is not defined in the graph")
    for state, v in graph.updates.items():
        if state.kind == "input" or v.id not in defined or state.type != v.type:
            raise IRError(f"update of {state.name!r} is invalid")


def _define(defined, value):
    if value.id in defined:
        raise IRError(f"value %{value.id} is defined twice")
    defined.add(value.id)
