"""The optimisation pipeline: every pass, repeated to a fixed point."""

from popir.errors import IRError
from popir.passes._rebuild import Rebuilder
from popir.passes.algebraic import simplify_rule
from popir.passes.common_subexpressions import CommonSubexpressions
from popir.passes.constant_folding import fold_rule
from popir.passes.dead_code import live_nodes

# Rules apply to the nodes they create, so a fixed point usually takes two rounds (the second changes
# nothing); a rewrite that keeps firing is a bug in a rule, reported instead of looping forever.
MAX_ROUNDS = 16


def optimize(graph, verify=True):
    """A new graph after simplification, constant folding, CSE and dead-code elimination to a fixed point.

    Each round replays only the live nodes through all rewrite rules at once (a rule's new nodes pass
    through the rules too); the first round in which no rule fires has also dropped every dead node.
    ``verify`` re-checks the result with ``Graph.verify``.
    """
    for _ in range(MAX_ROUNDS):
        builder = Rebuilder(graph, [simplify_rule, fold_rule, CommonSubexpressions()])
        result = builder.replay(live_nodes(graph))
        if builder.changes == 0:
            return result.verify() if verify else result
        graph = result
    raise IRError(f"popir.passes.optimize found no fixed point for graph {graph.name!r} in {MAX_ROUNDS} rounds")
