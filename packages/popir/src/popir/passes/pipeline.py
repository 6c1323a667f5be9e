"""The optimisation pipeline: every pass, repeated to a fixed point."""

from popir.passes._rebuild import Rebuilder
from popir.passes.algebraic import simplify_rule
from popir.passes.common_subexpressions import CommonSubexpressions
from popir.passes.constant_folding import fold_rule
from popir.passes.dead_code import live_nodes


def optimize(graph, verify=True):
    """A new graph after simplification, constant folding, CSE and dead-code elimination to a fixed point.

    Each round replays only the live nodes through all rewrite rules at once (a rule's new nodes pass
    through the rules too); the first round in which no rule fires has also dropped every dead node.
    ``verify`` re-checks the result with ``Graph.verify``.
    """
    while True:
        builder = Rebuilder(graph, [simplify_rule, fold_rule, CommonSubexpressions()])
        result = builder.replay(live_nodes(graph))
        if builder.changes == 0:
            return result.verify() if verify else result
        graph = result
