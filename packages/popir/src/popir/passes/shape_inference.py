"""Shape inference and verification: recompute every node's output types from its op's shape rule."""

from popir.passes._rebuild import Rebuilder


def infer_shapes(graph):
    """A new graph whose output types all come from the shape rules, checked by ``Graph.verify``.

    Raises IRError naming the node when a rule rejects its inputs, or when a state update no longer
    matches the type of its state.
    """
    return Rebuilder(graph).replay(reinfer=True).verify()
