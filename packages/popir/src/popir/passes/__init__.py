"""Graph -> graph passes. Each returns a new graph; inputs keep their order, names and kinds even when
unused, outputs and updates are kept, and rewritten nodes keep the source line of the node they replace.

``optimize`` runs them all to a fixed point; the others run one pass each.
"""

from popir.passes.algebraic import simplify
from popir.passes.common_subexpressions import eliminate_common_subexpressions
from popir.passes.constant_folding import MAX_FOLDED_ELEMENTS, fold_constants
from popir.passes.dead_code import eliminate_dead_code
from popir.passes.pipeline import optimize
from popir.passes.shape_inference import infer_shapes

__all__ = [
    "MAX_FOLDED_ELEMENTS",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "infer_shapes",
    "optimize",
    "simplify",
]
