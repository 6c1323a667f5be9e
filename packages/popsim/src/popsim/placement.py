"""Which IPU of a multi-IPU Device each node, variable and streamed input of a program set lives on.

A node placed by its frontend (``popir.Node.placement``: (pipeline stage, IPU)) runs on that IPU. An
unplaced node runs where its operands are (the first operand whose IPU is known: an optimizer update runs
beside its weight and gradient), or else where its first reader runs (a constant goes where it is used);
a node with neither runs on IPU 0, so an unannotated graph stays on IPU 0. A variable or streamed input
lives on the IPU of its first reader.
"""

from popsim.errors import Error


class Placement:
    """The IPU of every node (by identity) and of every variable (by name) of a program set."""

    def __init__(self, graphs, num_ipus):
        self.num_ipus = num_ipus
        self.node_ipu = {}
        self.variable_ipu = {}
        self.input_ipu = {}
        for name, graph in graphs.items():
            self._place_graph(name, graph)

    def ipu_of(self, node):
        """The IPU ``node`` runs on."""
        return self.node_ipu.get(id(node), 0)

    def _place_graph(self, name, graph):
        value_ipu = {v.id: self.variable_ipu[v.name] for v in graph.inputs if v.name in self.variable_ipu}
        pending = []
        for node in graph.nodes:
            ipu = self._declared(name, node)
            if ipu is None:
                ipu = next((value_ipu[v.id] for v in node.inputs if v.id in value_ipu), None)
            if ipu is None:
                pending.append(node)
                continue
            self._settle(node, ipu, value_ipu)
        # Nodes that read nothing placed (constants, ops on unread state) go where their first reader runs.
        first_reader = {}
        for node in graph.nodes:
            for v in node.inputs:
                first_reader.setdefault(v.id, node)
        for node in reversed(pending):
            reader = next((first_reader[v.id] for v in node.outputs if v.id in first_reader), None)
            self._settle(node, self.node_ipu.get(id(reader), 0) if reader is not None else 0, value_ipu)
        for v in graph.inputs:
            reader = first_reader.get(v.id)
            ipu = self.node_ipu.get(id(reader), 0) if reader is not None else 0
            if v.kind == "input":
                self.input_ipu.setdefault((name, v.name), ipu)
            else:
                self.variable_ipu.setdefault(v.name, ipu)

    def _declared(self, name, node):
        if node.placement is None:
            return None if self.num_ipus > 1 else 0
        ipu = node.placement[1]
        if not 0 <= ipu < self.num_ipus:
            where = f" at {node.source}" if node.source else ""
            raise Error(
                f"program {name!r}: {node.op}{where} is placed on IPU {ipu}, but the device has {self.num_ipus} "
                f"IPU(s) (0..{self.num_ipus - 1}): compile for a popsim.Device with more IPUs"
            )
        return ipu

    def _settle(self, node, ipu, value_ipu):
        self.node_ipu[id(node)] = ipu
        for v in node.outputs:
            value_ipu[v.id] = ipu
