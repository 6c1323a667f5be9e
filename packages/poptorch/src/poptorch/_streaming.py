"""Which device variables live in streaming memory (``Options.TensorLocations.set*Location`` with
``useOnChipStorage(False)``): parameters are weights, ``_accum.`` state is gradient accumulators, other
optimizer state is the optimizer's. Buffers (running statistics) stay on the chip. popsim keeps the chosen
variables off the tiles and loads each into a tile buffer just before each use (``popsim.remote``).
Activations in streaming memory are the forward values the backward pass reads (``activation_spill``).

With ``useReplicatedTensorSharding(True)`` on the optimizer's location (in tile or streaming memory), the
optimizer state of each large enough parameter is sharded over the replicas: each replica's step program holds
and updates only its shard (``_training.build_training``, ``_replication.ShardedState``), its gradient is
reduce-scattered and the updated weight all-gathered (``popsim.collectives.sharded_update``)."""

from popsim.remote import Spill
from poptorch import _blocks
from poptorch._optimizer_graph import SHARD_PREFIX, state_name
from poptorch._training import ACCUMULATOR_PREFIX


def location_kind(value):
    """The ``set*Location`` kind governing graph input ``value``, or None for inputs, buffers and the
    replicas' shards of sharded updates (tile memory: the collectives' buffers)."""
    if value.kind == "parameter":
        return "Weight"
    if value.kind == "optimizer_state" and not value.name.startswith(SHARD_PREFIX):
        return "Accumulator" if value.name.startswith(ACCUMULATOR_PREFIX) else "Optimizer"
    return None


def remote_variables(graphs, options):
    """Names of the variables of ``graphs`` ({program: popir.Graph}) that ``options`` put in streaming memory:
    of a streamed kind and at least that kind's ``minElementsForOffChip`` elements (a sharded optimizer
    state counts the elements of its whole tensor, as PopART decides before sharding)."""
    streamed = options.TensorLocations.streamed
    inputs = {v.name: v for graph in graphs.values() for v in graph.inputs}
    names = set()
    for v in inputs.values():
        kind = location_kind(v)
        if kind in streamed and _whole_size(v, inputs) >= streamed[kind]:
            names.add(v.name)
    return names


def activation_spill(options):
    """The activations ``options`` send to streaming memory (a ``popsim.remote.Spill``, or None): a phased
    strategy's off-chip ``Liveness`` moves what it says, whatever their size; else
    ``setActivationLocation(useOnChipStorage(False))`` moves the forward activations that the backward pass
    reads, of at least its ``minElementsForOffChip`` elements, after their last forward reader."""
    mode = _blocks.spill_mode(options.execution_strategy)
    if mode is not None:  # OffChipAfterFwd numbers the phases adjacently: a value read in two stays on chip
        return Spill(mode, keep_adjacent=_blocks.overlaps_streaming(options.execution_strategy))
    min_elements = options.TensorLocations.streamed.get("Activation")
    return None if min_elements is None else Spill("backward", min_elements)


def _whole_size(variable, inputs):
    """Elements of the whole tensor ``variable`` holds a part of: for a parameter's optimizer state (shaped like
    the parameter, or one replica's shard of it when sharded) the parameter's, else its own."""
    param = variable.name.partition(".")[2].rpartition(".")[0]  # _opt.<param>.<slot>
    if variable.name == state_name(param, variable.name.rpartition(".")[2]) and param in inputs:
        return inputs[param].type.size
    return variable.type.size


def sharded_parameters(sizes, options, replicas):
    """{parameter: replicas} of the parameters (``sizes``: {name: elements}) whose optimizer state
    ``useReplicatedTensorSharding(True)`` shards over ``replicas`` (those of every process): at least
    ``minElementsForReplicatedTensorSharding`` elements; none without replication (as PopART)."""
    min_elements = options.TensorLocations.sharded_optimizer
    if min_elements is None or replicas == 1:
        return {}
    return {name: replicas for name, size in sizes.items() if size >= min_elements}
