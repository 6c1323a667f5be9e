"""Which device variables live in streaming memory (``Options.TensorLocations.set*Location`` with
``useOnChipStorage(False)``): parameters are weights, ``_accum.`` state is gradient accumulators, other
optimizer state is the optimizer's. Buffers (running statistics) stay on the chip. popsim keeps the chosen
variables off the tiles and loads each into a tile buffer just before each use (``popsim.remote``).
Activations in streaming memory are the forward values the backward pass reads (``activation_spill``).

With ``useReplicatedTensorSharding(True)`` on the optimizer's location, each replica holds 1/replicas of its
streaming-memory optimizer state: popsim divides that state's streaming-memory bytes and transfer cycles by
the replicas, and the step's collectives become a gradient reduce-scatter and a weight all-gather
(``popsim.collectives.sharded_update``). The simulated replica still updates the whole tensors, which gives
the same numbers as each replica updating its shard (the updates are elementwise)."""

from popsim.remote import Spill
from poptorch import _blocks
from poptorch._optimizer_graph import state_name
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


def activation_spill(options):
    """The activations ``options`` send to streaming memory (a ``popsim.remote.Spill``, or None): a phased
    strategy's off-chip ``Liveness`` moves what it says, whatever their size; else
    ``setActivationLocation(useOnChipStorage(False))`` moves the forward activations that the backward pass
    reads, of at least its ``minElementsForOffChip`` elements, after their last forward reader."""
    mode = _blocks.spill_mode(options.execution_strategy)
    if mode is not None:
        return Spill(mode)
    min_elements = options.TensorLocations.streamed.get("Activation")
    return None if min_elements is None else Spill("backward", min_elements)


def sharded_variables(graphs, options, replicas):
    """{name: replicas} of the optimizer state in streaming memory that ``useReplicatedTensorSharding(True)``
    shards over ``replicas`` (those of every process): variables of at least ``minElementsForReplicatedTensorSharding``
    elements; none without replication (as PopART)."""
    min_elements = options.TensorLocations.sharded_optimizer
    if min_elements is None or replicas == 1:
        return {}
    remote = remote_variables(graphs, options)
    return {
        v.name: replicas
        for graph in graphs.values()
        for v in graph.inputs
        if v.name in remote and location_kind(v) == "Optimizer" and v.type.size >= min_elements
    }


def sharded_parameters(trained, sharded):
    """The parameters among ``trained`` whose optimizer state is in ``sharded``: each replica updates only its
    shard of them, so their gradients are reduce-scattered and their new values all-gathered."""
    return [p for p in trained if any(name.startswith(state_name(p, "")) for name in sharded)]
