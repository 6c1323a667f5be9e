"""The replay machinery every pass shares: copy a graph node by node into a new graph through a value map.

A pass is a list of rewrite rules. Each node of the source graph is re-applied to the new graph through
``Rebuilder.apply``; a rule may answer with Values that stand for the node's outputs (a simpler
expression, a folded constant, an earlier identical node) or decline. Nodes a rule creates go through the
same rules, so one forward sweep already simplifies chains. Every node emitted while replaying a source
node carries that node's annotations (its ``source`` line).
"""

from popir.graph import ANNOTATIONS, Graph, Node, TensorType
from popir.registry import get_op


class Rebuilder:
    """A new graph under construction from ``source`` plus the map from old value ids to new Values.

    ``rules`` are callables ``rule(builder, op, inputs, attrs, types) -> list of Values or None`` (``types``
    as in ``apply``). A rule that answers adds to ``changes`` when it changed the graph; the pipeline stops
    when a sweep changes nothing.
    """

    def __init__(self, source, rules=()):
        self.source = source
        self.graph = Graph(source.name)
        self.rules = tuple(rules)
        self.changes = 0
        self.memo = {}
        self.map = {v.id: self.graph.add_input(v.name, v.shape, v.dtype, v.kind) for v in source.inputs}
        self._origin = None

    def apply(self, op, inputs, attrs, types=None):
        """Output Values of ``op(inputs, **attrs)`` in the new graph, after the rules had their say.

        ``types`` are the output types when the caller knows them (a replayed node whose inputs kept their
        types); otherwise the op's shape rule computes them.
        """
        for rule in self.rules:
            result = rule(self, op, inputs, attrs, types)
            if result is not None:
                return result
        return self.emit(op, inputs, attrs, types)

    @staticmethod
    def infer(op, inputs, attrs):
        """The output types of ``op(inputs, **attrs)`` by the op's shape rule."""
        result = get_op(op).infer(*[v.type for v in inputs], **attrs)
        return [TensorType.of(*t) for t in ([result] if isinstance(result, TensorType) else result)]

    @property
    def placement(self):
        """The placement the nodes emitted now take (that of the source node being replayed)."""
        return self._origin.placement if self._origin is not None else None

    def emit(self, op, inputs, attrs, types=None):
        """Append the node as is, bypassing the rules; returns its output Values."""
        if types is None:
            types = self.infer(op, inputs, attrs)
        graph = self.graph
        node = Node(op, list(inputs), attrs, [])
        for slot in ANNOTATIONS:
            setattr(node, slot, getattr(self._origin, slot) if self._origin is not None else None)
        node.outputs = [graph._new_value(t, producer=node) for t in types]
        graph.nodes.append(node)
        return node.outputs

    def constant(self, array):
        """A constant Value holding ``array`` (through the rules, so equal constants can be shared)."""
        return self.apply("constant", (), {"value": array})[0]

    def replay(self, nodes=None, reinfer=False):
        """Re-apply ``nodes`` (default: all nodes of the source, in order) and return the finished graph.

        ``reinfer`` recomputes every output type with the op's shape rule instead of trusting the source.
        """
        values = self.map
        for node in self.source.nodes if nodes is None else nodes:
            self._origin = node
            inputs = [values[v.id] for v in node.inputs]
            types = None if reinfer else [v.type for v in node.outputs]
            for old, new in zip(node.outputs, self.apply(node.op, inputs, node.attrs, types)):
                values[old.id] = new
        self._origin = None
        graph = self.graph
        for name, v in self.source.outputs.items():
            graph.output(name, values[v.id])
        for state, v in self.source.updates.items():
            graph.update(values[state.id], values[v.id])
        return graph


def producer_op(value):
    """The op that defines ``value``, or None for a graph input."""
    return value.producer.op if value.producer is not None else None


def constant_array(value):
    """The array of a constant Value, or None when ``value`` is not a constant."""
    node = value.producer
    return node.attrs["value"] if node is not None and node.op == "constant" else None
