"""Which device variables live in streaming memory (``Options.TensorLocations.set*Location`` with
``useOnChipStorage(False)``): parameters are weights, ``_accum.`` state is gradient accumulators, other
optimizer state is the optimizer's. Buffers (running statistics) stay on the chip. popsim keeps the chosen
variables off the tiles and loads each into a tile buffer just before each use (``popsim.remote``)."""

from poptorch._training import ACCUMULATOR_PREFIX


def location_kind(value):
    """The ``set*Location`` kind governing graph input ``value``, or None for inputs and buffers."""
    if value.kind == "parameter":
        return "Weight"
    if value.kind == "optimizer_state":
        return "Accumulator" if value.name.startswith(ACCUMULATOR_PREFIX) else "Optimizer"
    return None


def remote_variables(graphs, options):
    """Names of the variables of ``graphs`` ({program: popir.Graph}) that ``options`` put in streaming memory:
    of a streamed kind and at least that kind's ``minElementsForOffChip`` elements."""
    streamed = options.TensorLocations.streamed
    names = set()
    for graph in graphs.values():
        for v in graph.inputs:
            kind = location_kind(v)
            if kind in streamed and v.type.size >= streamed[kind]:
                names.add(v.name)
    return names
