"""Dead-code elimination: drop nodes that no output and no state update depends on."""

from popir.passes._rebuild import Rebuilder


def live_nodes(graph):
    """The nodes of ``graph`` that some output or update needs, in graph order."""
    needed = {v.id for v in graph.outputs.values()}
    needed.update(v.id for v in graph.updates.values())
    live = []
    for node in reversed(graph.nodes):
        if any(v.id in needed for v in node.outputs):
            live.append(node)
            needed.update(v.id for v in node.inputs)
    live.reverse()
    return live


def eliminate_dead_code(graph):
    """A new graph without dead nodes; inputs (used or not), outputs and updates are kept."""
    return Rebuilder(graph).replay(live_nodes(graph))
