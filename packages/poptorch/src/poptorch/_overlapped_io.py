"""Overlapped host I/O (``set_overlap_for_input`` / ``_output`` with an overlapping ``OverlapMode``).

Captured for the simulated IPU, a marked tensor becomes a ``poptorch::set_overlap`` node that lowers to the
value itself and records, on the popir graph, which model input or output it marks. As in PopTorch, the
marks need I/O tiles (``TensorLocations.numIOTiles``) and a sharded or phased execution strategy, an input
mark must be the only op applied to a model input and an output mark must be a model output returned once.
``resolve`` gives the executor ``{input or output name: (direction, mode)}`` for the call timeline (``_call_timeline``).
"""

import weakref

from poptorch import _blocks
from poptorch._marker_ops import define_marker
from poptorch.enums import OverlapMode
from poptorch.errors import Error

INPUT, OUTPUT = "input", "output"
# graph -> {"input": {input name: mode}, "output": [(popir Value, mode)]}
_MARKS = weakref.WeakKeyDictionary()


def check_options(options):
    """Refuse overlapped I/O under options PopTorch refuses it with (its error texts)."""
    strategy = options.execution_strategy  # None: PipelinedExecution, the default
    if strategy is None or type(strategy) is _blocks.PipelinedExecution:
        raise Error(
            "Overlapped IO is not supported with poptorch.PipelinedExecution. If you are using only one IPU, "
            "please switch to poptorch.ShardedExecution."
        )
    if not options.TensorLocations.num_io_tiles:
        raise Error(
            "No IO tiles allocated. You must allocate at least 32 IO tiles using "
            "poptorch.Options().TensorLocations.numIOTiles."
        )


# Marks a model input or output for host transfers overlapping compute (``mode``); it has no gradient formula.
set_overlap = define_marker("set_overlap", ("str mode", "str direction"), differentiable=False)


def mark(ctx, value, mode, direction):
    """Lowering of ``poptorch::set_overlap``: record which model input (checked now) or output (checked by
    ``resolve``) ``value`` is."""
    marks = _MARKS.setdefault(ctx.graph, {INPUT: {}, OUTPUT: []})
    if direction == OUTPUT:
        marks[OUTPUT].append((value, mode))
        return
    source = ctx.node.args[0]
    if value.producer is not None or value.kind != "input" or source.op != "placeholder":
        raise Error("poptorch.set_overlap_for_input applied on a node which is not a tensor input to the model.")
    if len(source.users) > 1:
        raise Error(
            "poptorch.set_overlap_for_input must be the only op applied to an input. This is not the case for "
            f"input {value.name} to the model."
        )
    marks[INPUT][value.name] = mode


def resolve(captured):
    """``{name: (direction, OverlapMode)}`` of the marked inputs and outputs of a ``captured`` model."""
    graph = captured.graph
    marks = _MARKS.get(graph, {INPUT: {}, OUTPUT: []})
    resolved = {name: (INPUT, OverlapMode(mode)) for name, mode in marks[INPUT].items()}
    for value, mode in marks[OUTPUT]:
        names = [name for name in captured.outputs if graph.outputs[name] is value]
        if not names:
            raise Error("poptorch.set_overlap_for_output applied on a node which is not a tensor output to the model.")
        if len(names) > 1:
            raise Error(
                "poptorch.set_overlap_for_output cannot be used with a tensor that is returned twice. Please check "
                "all returned tensors including those nested in tuples/lists."
            )
        resolved[names[0]] = (OUTPUT, OverlapMode(mode))
    return resolved
