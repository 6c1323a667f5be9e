"""What replication costs on the simulated IPUs: replicas run at the same time, then all-reduce gradients.

The replicas of one process are simulated one after another on one device (the numbers are the same);
the cycle figures treat them as ``replicationFactor x numProcesses`` sets of IPUs working in parallel: a
step costs one replica's micro-batches, the gradient all-reduce (``popsim.collectives``) and the optimizer.
"""

import collections
import contextlib
from dataclasses import astuple

import numpy as np
import torch

from popsim import collectives
from poptorch import _training
from poptorch._optimizer_graph import partial_norm_name, shard_size, summed_norm_name
from poptorch.enums import CommGroupType, MeanReductionStrategy, ReductionType, VariableRetrievalMode
from poptorch.errors import Error
from poptorch.options import replica_groups

FLOAT32_BYTES = 4


def global_replicas(options):
    """The replicas of every process: ``replicationFactor`` is the replicas of one process."""
    return options.replication_factor * options.Distributed.numProcesses


def all_reduce_cycles(exe, programs, options, groupings, spec=None):
    """Cycles of the gradient all-reduce of each training step (0 without one), recorded in the profile
    with one replica's work per step (inference: the replicas' runs of a call, no collective). A parameter
    grouped by ``groupings`` (its ``replicaGrouping``) is reduced within its groups only, over the links
    between its group's replicas. A parameter whose optimizer state is sharded over the replicas has its
    gradient reduce-scattered and its new value all-gathered, plus the all-reduce of the norms that optimizer
    ``spec`` (LAMB, gradient clipping) takes over the whole tensors."""
    replicas = global_replicas(options)
    if replicas == 1:
        return 0
    if programs.step is None:
        _profile_inference(exe, programs, options, replicas)
        return 0
    grouped = _groups_of(groupings, replicas)
    sharded = _sharded_parameters(programs, grouped, groupings)
    parts = {}  # (group size, stride) -> gradient bytes
    for name in programs.trained:
        if name in sharded:
            continue
        nbytes = programs.initial[_training.accumulator_name(name)].nbytes
        key = _group_shape(grouped[name]) if name in grouped else (replicas, 1)
        parts[key] = parts.get(key, 0) + nbytes
    # A pipelined or sharded replica spans several IPUs, each reducing the gradients of its own stages.
    target = exe.profile.target
    parts = [(nbytes, size, stride) for (size, stride), nbytes in parts.items()]
    reduce = collectives.grouped_all_reduce(target, parts, replicas, ipus_per_replica=target.num_ipus)
    if sharded:
        grad_bytes = sum(programs.initial[_training.accumulator_name(name)].nbytes for name in sharded)
        weight_bytes = sum(sharded.values())
        update = collectives.sharded_update(target, grad_bytes, weight_bytes, replicas, target.num_ipus)
        norms = collectives.all_reduce(target, _norm_bytes(spec, len(sharded)), replicas, target.num_ipus)
        levels = [collectives.Level("norms: " + level.name, *astuple(level)[1:]) for level in norms.levels]
        scatter = [level for level in update.levels if not level.after_update]
        gather = [level for level in update.levels if level.after_update]
        levels = (*reduce.levels, *scatter, *levels, *gather)
        reduce = collectives.AllReduce(replicas, reduce.nbytes + grad_bytes, levels)
    per_program = exe.profile.programs
    micro_batch = (programs.micro_batch, per_program[programs.micro_batch]["total_cycles"])
    runs = [micro_batch] * options.Training.gradient_accumulation
    optimizer = (programs.step, per_program[programs.step]["total_cycles"])
    exe.profile.add_replication(replicas, sum(cycles for _, cycles in runs), reduce, optimizer[1])
    # Which replica (of which process, on which IPUs) ran what, and the collectives between them.
    exe.profile.replication["timeline"] = collectives.replica_timeline(
        replicas, runs, reduce, optimizer, options.replication_factor, target.num_ipus
    )
    return reduce.cycles


def _norm_bytes(spec, sharded):
    """Bytes of the partial norms the replicas all-reduce when ``sharded`` parameters' updates are sharded: a
    float32 sum of squares for gradient clipping, and LAMB's two norms per parameter (weight and update)."""
    if spec is None:
        return 0
    return FLOAT32_BYTES * ((spec.max_grad_norm is not None) + (2 * sharded if spec.kind == "lamb" else 0))


def _sharded_parameters(programs, grouped, groupings):
    """{parameter: bytes} of the trained parameters whose optimizer state is sharded over the replicas. A
    parameter whose replicas hold different values (a ``replicaGrouping`` of several groups) is refused:
    PopTorch documents no sharding within a group, and PopART shards optimizer state over one sharding domain
    (every replica) and reduce-scatters the gradient over it, which would mix the groups' gradients."""
    both = sorted(set(programs.sharded) & set(grouped))
    if both:
        name = both[0]
        size = programs.graphs[programs.micro_batch].input(name).type.size
        raise Error(
            f"{_describe(name, groupings[name])} gives it {max(grouped[name]) + 1} groups of replicas holding "
            "different values, and its optimizer state is sharded over the replicas (useReplicatedTensorSharding): "
            "PopTorch documents no sharding within a parameter's groups (PopART shards optimizer state and "
            "reduce-scatters the gradient over every replica, across the groups), so the simulated IPU does not "
            "model it. Drop the replicaGrouping, or keep this parameter's state whole with "
            f"minElementsForReplicatedTensorSharding above its {size} elements"
        )
    graph = programs.graphs[programs.micro_batch]
    return {name: graph.input(name).type.nbytes for name in programs.sharded}


def _profile_inference(exe, programs, options, replicas):
    """The profile's replication section of an inference call: every replica runs its ``deviceIterations``
    micro-batches at the same time as the others; no collective joins them."""
    cycles = exe.profile.programs[programs.micro_batch]["total_cycles"]
    runs = [(programs.micro_batch, cycles)] * options.device_iterations
    exe.profile.add_replication(replicas, cycles * len(runs))
    exe.profile.replication["timeline"] = collectives.replica_timeline(
        replicas, runs, None, None, options.replication_factor, exe.profile.target.num_ipus
    )


def _group_shape(of_replica):
    """(replicas per group, distance between a group's consecutive replicas) of a grouping."""
    members = [replica for replica, group in enumerate(of_replica) if group == 0]
    return len(members), members[1] - members[0] if len(members) > 1 else 1


BROADCAST_BUFFERS = (
    "PopTorch does not support broadcasting buffers. If your model is able to tolerate buffers becoming out "
    "of sync between replicas, you can disable buffer broadcasting using poptorch.Options.broadcastBuffers(False)."
)


class ReplicaBuffers:
    """Each replica's own copy of the buffers the model updates (``Options.broadcastBuffers(False)``).

    The replicas of a process share one simulated device, so each replica's values are swapped in before
    its runs and out after them; between calls the device (and so the host, when it reads) holds replica
    0's values, as PopTorch reads a variable from the first replica. A value uploaded from the host reaches
    every replica.
    """

    def __init__(self, names, replicas):
        self.names = names
        self.replicas = replicas
        self.copies = None

    @classmethod
    def of(cls, captured, programs, options):
        """The per-replica buffers of a compiled model; raises PopTorch's error when the model updates
        buffers on replicas while ``broadcastBuffers`` is True."""
        graph = programs.graphs[programs.micro_batch]
        updated = {state.name for state in graph.updates}
        names = [name for name in captured.buffers if name in updated]
        replicas = options.replication_factor
        if names and replicas * options.Distributed.numProcesses > 1 and options.broadcast_buffers:
            raise Error(f"{BROADCAST_BUFFERS} (The model updates {', '.join(names)}.)")
        return cls(names if replicas > 1 else [], replicas)

    @contextlib.contextmanager
    def call(self, exe, uploaded):
        """One call's runs: the buffers in ``uploaded`` (written from the host since the last call, a set
        this empties) reach every replica; at the end the device holds replica 0's values."""
        if not self.names:
            yield
            return
        current = {name: np.array(exe.read_variable(name)) for name in self.names}
        if self.copies is None:
            self.copies = [dict(current) for _ in range(self.replicas)]
        for name in uploaded.intersection(self.names):
            for copies in self.copies:
                copies[name] = current[name]
        uploaded.difference_update(self.names)
        try:
            yield
        finally:
            for name, value in self.copies[0].items():
                exe.write_variable(name, value)

    @contextlib.contextmanager
    def replica(self, exe, replica):
        """A run of ``replica``: its buffers are on the device during the run and kept after it."""
        if not self.names:
            yield
            return
        for name, value in self.copies[replica].items():
            exe.write_variable(name, value)
        yield
        self.copies[replica] = {name: np.array(exe.read_variable(name)) for name in self.names}


class GroupingView:
    """What a wrapper gives for one of its model's parameters (``model.w``), as in PopTorch: the parameter's
    attributes plus ``replicaGrouping`` (and its older name ``perReplica``), which records the grouping in
    the wrapper's ``per_replica_params``. The parameter itself is left untouched, so it still pickles."""

    def __init__(self, parameter, name, groupings, compiled):
        self._parameter, self._name, self._groupings, self._compiled = parameter, name, groupings, compiled

    def replicaGrouping(self, comm_group_type, shards, variable_retrieval_mode):
        """Give this parameter one value per group of replicas (``comm_group_type`` with groups of
        ``shards`` replicas for Consecutive and Orthogonal): its host tensor holds the groups' values along
        a new first dimension (none when there is one group), the model sees one group's value, and gradients
        are reduced within a group. With ``VariableRetrievalMode.AllReplicas`` the host reads every replica's
        value instead (first dimension ``replicas``) and may write either form back."""
        settings = (comm_group_type, shards, variable_retrieval_mode)
        _check_grouping(self._name, settings)
        if self._compiled():
            raise Error(f"{_describe(self._name, settings)} must be called before the model is compiled or first run")
        self._groupings[self._name] = settings

    perReplica = replicaGrouping

    def __getattr__(self, attr):
        return getattr(self._parameter, attr)


def _describe(name, settings):
    kind, shards, mode = settings
    return (
        f"replicaGrouping(CommGroupType.{CommGroupType(kind).name}, {shards}, "
        f"VariableRetrievalMode.{VariableRetrievalMode(mode).name}) of parameter '{name}'"
    )


def _check_grouping(name, settings):
    """The (CommGroupType, shards) of a parameter's (type, shards, retrieval mode) settings."""
    kind, shards, mode = settings
    VariableRetrievalMode(mode)  # a ValueError names an unknown mode
    kind = CommGroupType(kind)
    if kind in (CommGroupType.Consecutive, CommGroupType.Orthogonal) and not (isinstance(shards, int) and shards > 0):
        raise Error(f"{_describe(name, settings)}: shards (the group size) must be a positive int, got {shards!r}")
    return kind, shards


def _all_replicas(settings):
    return VariableRetrievalMode(settings[2]) == VariableRetrievalMode.AllReplicas


def grouped_names(groupings, options):
    """The parameters ``groupings`` gives more than one group over every process's replicas."""
    return set(_groups_of(groupings, global_replicas(options)))


def _gradient_scale(name, of_replica, options):
    """Per group, the factor turning grouped parameter ``name``'s reduced accumulator into its group's
    gradient.

    The step treats an accumulator as every replica's: with Post it divides the sum by every replica's
    micro-batches, where a group's sum comes from its own (a factor of the group count); with Running each
    process's accumulator is the mean over its micro-batches of the group (the group's own count) and the
    step divides their sum by the process count, of which only the processes running the group's replicas
    contribute.
    """
    groups = max(of_replica) + 1
    if options.Training.accumulation_and_replication_reduction_type != ReductionType.Mean:
        return np.ones(groups)
    if options.Training.mean_reduction_strategy != MeanReductionStrategy.Running:
        return np.full(groups, float(groups))
    local = options.replication_factor
    scale = np.empty(groups)
    for group in range(groups):
        per_process = collections.Counter(r // local for r, g in enumerate(of_replica) if g == group)
        if len(set(per_process.values())) > 1:
            # Averaging the processes' running means would weigh their replicas unequally.
            raise Error(
                f"Parameter '{name}' has a replicaGrouping whose group {group} spreads unevenly over the "
                f"processes (replicas per process: {dict(per_process)}): with MeanReductionStrategy.Running "
                "every process running a group's replicas must run as many of them as the others. Choose a "
                "group size and replicationFactor that divide evenly, or use MeanReductionStrategy.Post"
            )
        scale[group] = options.Distributed.numProcesses / len(per_process)
    return scale


def _groups_of(groupings, replicas):
    """Parameter name -> the group index of each replica, for the parameters not shared by every replica."""
    groups = {}
    for name, settings in groupings.items():
        kind, shards = _check_grouping(name, settings)
        of_replica = replica_groups(f"parameter '{name}' replicaGrouping", kind, shards, replicas)
        if max(of_replica) > 0:
            groups[name] = of_replica
    return groups


@contextlib.contextmanager
def per_replica_parameters(model, groupings, replicas):
    """While capturing ``model``: each grouped parameter (host shape ``[groups, *shape]``) is seen as one
    group's value; yields {stand-in: host parameter} so the capture's tensors can be mapped back."""
    stand_ins = {}
    restore = []
    try:
        for name, of_replica in _groups_of(groupings, replicas).items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            host = owner._parameters[leaf]
            count = max(of_replica) + 1
            # AllReplicas: a tensor read back from the device holds every replica's value.
            rows = {count, len(of_replica)} if _all_replicas(groupings[name]) else {count}
            if host.dim() == 0 or host.shape[0] not in rows:
                raise Error(
                    f"Parameter '{name}' has replicaGrouping with {count} groups, so its first dimension must hold "
                    f"one value per group: expected shape [{count}, ...], got {list(host.shape)}"
                )
            stand_in = torch.nn.Parameter(host.detach()[0].clone(), requires_grad=host.requires_grad)
            owner._parameters[leaf] = stand_in
            restore.append((owner, leaf, host))
            stand_ins[stand_in] = host
        yield stand_ins
    finally:
        for owner, leaf, host in restore:
            owner._parameters[leaf] = host


class GroupedParameters:
    """The per-group device values of parameters with a ``replicaGrouping``.

    The replicas of a process share one simulated device, so each grouped variable (the parameter, its
    gradient accumulator and its optimizer state) keeps every group's value on the host and the device holds
    the value of the group ``loaded`` last: a replica's run first loads its group's values. The optimizer step
    runs once per group on that group's values and gradients; everything else it updates keeps the first
    run's result.
    """

    def __init__(self, of_replica, scale, settings=None, first_replica=0):
        self.of_replica = of_replica  # device variable -> group index of each replica of every process
        self.settings = dict(settings or {})  # the per_replica_params compiled with
        self.scale = scale  # accumulator -> per group, the factor turning its reduced value into the step's
        self.first_replica = first_replica  # this process's replica 0 among every process's replicas
        self.values = {}
        self.loaded = dict.fromkeys(of_replica, 0)
        # Variables the host reads per replica (VariableRetrievalMode.AllReplicas), not per group.
        self.all_replicas = set()

    @classmethod
    def of(cls, groupings, captured, programs, options, slots):
        """The grouped parameters of a compiled model (groups span the replicas of every process)."""
        groups = _groups_of(groupings, global_replicas(options))
        for name in groups:
            if name not in captured.parameters:
                raise Error(f"replicaGrouping was called on '{name}', which the compiled model does not use")
        graph = programs.graphs[programs.micro_batch]
        of_replica, scale, initial = {}, {}, {}
        for name, groups_of_name in groups.items():
            of_replica[name] = groups_of_name
            initial[name] = np.zeros(graph.input(name).shape, dtype=graph.input(name).dtype.numpy)
            if name in programs.trained:
                accumulator = _training.accumulator_name(name)
                scale[accumulator] = _gradient_scale(name, groups_of_name, options)
                count = _training.running_count_name(name)
                variables = [accumulator, *slots.get(name, {}).values()]
                if count in programs.initial:  # MeanReductionStrategy.Running: the group counts its micro-batches
                    variables.append(count)
                for variable in variables:
                    of_replica[variable] = groups_of_name
                    initial[variable] = programs.initial[variable]
        first = options.Distributed.processId * options.replication_factor
        grouped = cls(of_replica, scale, groupings, first)
        for name in groups:
            if _all_replicas(groupings[name]):
                grouped.all_replicas.update([name, *slots.get(name, {}).values()])
        for variable, value in initial.items():
            grouped.values[variable] = np.stack([value] * (max(of_replica[variable]) + 1))
        return grouped

    def check_unchanged(self, groupings):
        """Refuse a run after ``per_replica_params`` changed since compiling (it would be ignored)."""
        if groupings != self.settings:
            raise Error(
                f"per_replica_params changed after the model was compiled (from {self.settings} to {groupings}): "
                "set parameters' replicaGrouping before the first run, or destroy() the model to compile it again"
            )

    def __contains__(self, name):
        return name in self.of_replica

    def write(self, exe, name, value):
        """The host's value of every group (first dimension) of the grouped variable ``name``, or one value
        for every group; with AllReplicas retrieval also every replica's value (the replicas of a group
        must agree)."""
        value = np.asarray(value)
        of_replica = np.asarray(self.of_replica[name])
        shape = self.values[name].shape
        if name in self.all_replicas and value.ndim == len(shape) and value.shape[0] == len(of_replica) != shape[0]:
            value = self._one_per_group(name, value, of_replica)
        self.values[name] = np.array(np.broadcast_to(value, shape), dtype=self.values[name].dtype)
        exe.write_variable(name, self.values[name][self.loaded[name]])

    @staticmethod
    def _one_per_group(name, value, of_replica):
        """Each group's value from a tensor of every replica's values."""
        first = [int(np.argmax(of_replica == group)) for group in range(of_replica.max() + 1)]
        if not np.array_equal(value, value[first][of_replica]):
            raise Error(
                f"'{name}' holds one value per replica (VariableRetrievalMode.AllReplicas), but the replicas of a "
                "group hold different values: the replicas of a group share one value, so give each group's "
                f"replicas the same value, or one value per group (first dimension {len(first)})"
            )
        return value[first]

    def read(self, exe, name):
        """Every group's current value of the grouped variable ``name``, stacked (every replica's with
        AllReplicas retrieval)."""
        values = self.stacked(exe, name)
        return values[np.asarray(self.of_replica[name])] if name in self.all_replicas else values.copy()

    def _load(self, exe, variable, group):
        current = self.loaded[variable]
        if current != group:
            self.values[variable][current] = np.array(exe.read_variable(variable))
            exe.write_variable(variable, self.values[variable][group])
            self.loaded[variable] = group

    @contextlib.contextmanager
    def replica(self, exe, replica):
        """A run of ``replica``: its group's values are on the device."""
        for variable, of_replica in self.of_replica.items():
            self._load(exe, variable, of_replica[self.first_replica + replica])
        yield

    def step(self, exe, run, updated):
        """Run the optimizer step ``run`` once per group of the grouped parameters, each time on that
        group's values and from the same state of the others; ``updated`` (the step's updates) that are not
        grouped keep their first run's values."""
        if not self.of_replica:
            run()
            return
        counts = {variable: max(of_replica) + 1 for variable, of_replica in self.of_replica.items()}
        others = [name for name in updated if name not in counts]
        before = {name: np.array(exe.read_variable(name)) for name in others}
        after = None
        for group in range(max(counts.values())):
            for variable, count in counts.items():
                if group < count:
                    self._load(exe, variable, group)
                    factor = self.scale[variable][group] if variable in self.scale else 1
                    if factor != 1:
                        exe.write_variable(variable, np.array(exe.read_variable(variable)) * factor)
            done = {v: np.array(exe.read_variable(v)) for v, count in counts.items() if group >= count and v in updated}
            for name, value in before.items() if after is not None else ():
                exe.write_variable(name, value)
            run()
            for variable, value in done.items():
                exe.write_variable(variable, value)
            if after is None:
                after = {name: np.array(exe.read_variable(name)) for name in others}
        for name, value in after.items():
            exe.write_variable(name, value)

    def reset_accumulators(self, exe):
        """A step cut short: every group's accumulated gradients (and micro-batch counts) restart from zero."""
        for variable in self.of_replica:
            if variable.startswith(_training.ACCUMULATOR_PREFIX):
                self.values[variable][:] = 0
                exe.write_variable(variable, self.values[variable][self.loaded[variable]])

    def stacked(self, exe, name):
        """Every group's current value of the grouped variable ``name``, as the host keeps it."""
        self.values[name][self.loaded[name]] = np.array(exe.read_variable(name))
        return self.values[name]

    def replace(self, exe, name, value):
        """Set every group's value of the grouped variable ``name`` (shaped as ``stacked`` gives it)."""
        self.values[name] = np.array(value, dtype=self.values[name].dtype).reshape(self.values[name].shape)
        exe.write_variable(name, self.values[name][self.loaded[name]])


class ShardedState:
    """The replicas' shards of the optimizer state sharded over them (replicated tensor sharding).

    Each replica's step program holds and updates only its shard: ``shard_size`` elements of its parameters'
    flattened weight, gradient and optimizer state, padded as PopART does (every shard ceil(n / replicas)
    elements, the last ones ending with one zero; see ``_split``). The replicas share one simulated device, so the
    host keeps every replica's state shards and runs the step once per replica: it first places the replica's
    weight and gradient shards where the step reads them (``replica_shard``: the step slices them out of the
    whole weight and gradient variables, which every replica holds anyway, and writes the updated weight shard
    back in place), and afterwards joins the replicas' updated shards into the new weights (the all-gather).
    Norms over sharded tensors (LAMB, gradient clipping) need every replica's partial sum (the all-reduce): the
    replicas then run the step again with the sums of the previous run's partial norms until those sums are
    the run's own.
    """

    def __init__(self, replicas=1, shapes=None, state=None, norms=0):
        self.replicas = replicas
        self.shapes = dict(shapes or {})  # sharded parameter -> its shape
        self.state = dict(state or {})  # state variable -> its parameter
        self.norms = norms
        self.values = {}  # state variable -> [replicas, shard] of every replica's shard
        self.joined = {}  # step output (an anchor) carrying a sharded parameter's update -> that parameter

    @classmethod
    def of(cls, programs, slots):
        """The sharded optimizer state of a compiled model; ``slots`` is {parameter: {slot: variable}}."""
        graph = programs.graphs[programs.micro_batch]
        shapes = {name: graph.input(name).shape for name in programs.sharded}
        replicas = max(programs.sharded.values(), default=1)
        state = {variable: name for name in shapes for variable in slots.get(name, {}).values()}
        norms = sum(1 for name in programs.initial if name.startswith(partial_norm_name("")))
        sharded = cls(replicas, shapes, state, norms)
        for variable in state:
            sharded.values[variable] = np.stack([programs.initial[variable]] * replicas)
        if programs.step is not None:
            step = programs.graphs[programs.step]
            updates = {step.updates.get(step.input(name)): name for name in shapes}
            sharded.joined = {out: updates[v] for out, v in step.outputs.items() if v in updates}
        return sharded

    def __contains__(self, name):
        return name in self.values

    def write(self, name, value):
        """The host's value of state variable ``name``: a whole tensor, or one shard's value for every replica
        (its initial value)."""
        value = np.asarray(value)
        shards = self.values[name]
        if value.shape == shards.shape[1:] and value.shape != self.shapes[self.state[name]]:
            shards[:] = value
        else:
            shards[:] = _split(value.astype(shards.dtype), self.replicas)

    def read(self, name):
        """The whole tensor of state variable ``name``, joined from the replicas' shards."""
        return _join(self.values[name], self.shapes[self.state[name]])

    def step(self, exe, run, updated):
        """Run the optimizer step ``run`` once per replica (in passes while norms over sharded tensors are not
        yet exact), each on that replica's shards and from the same values of the rest; ``updated`` are the
        step's updates."""
        if not self.shapes:
            run()
            return
        kept = {n: np.array(exe.read_variable(n)) for n in updated if n not in self.values and n not in self._own()}
        # Every replica's shard of each sharded weight and gradient.
        weights = {name: _split(np.array(exe.read_variable(name)), self.replicas) for name in self.shapes}
        grads = {name: _split(kept[_training.accumulator_name(name)], self.replicas) for name in self.shapes}
        new_weights = {name: np.empty_like(shards) for name, shards in weights.items()}
        new_state = {name: np.empty_like(values) for name, values in self.values.items()}
        summed = np.zeros(self.norms, np.float32)
        # A pass is exact when the sums it was given are those of its partial norms; each pass makes one more
        # level of a chain of norms exact (LAMB's over gradients clipped by their global norm): at most all.
        for _ in range(self.norms + 1):
            partial = np.zeros(self.norms, np.float32)
            # Replica 0 runs last: the device is left with its view (what anchors and later reads see).
            for replica in reversed(range(self.replicas)):
                self._place(exe, replica, kept, weights, grads, summed)
                run()
                for name in self.shapes:
                    new_weights[name][replica] = _own_elements(exe.read_variable(name), self.replicas)
                for variable in self.values:
                    new_state[variable][replica] = exe.read_variable(variable)
                partial += [np.float32(exe.read_variable(partial_norm_name(i))) for i in range(self.norms)]
            if np.array_equal(partial, summed, equal_nan=True):
                break
            summed = partial
        self.values = new_state
        for name, shards in new_weights.items():
            exe.write_variable(name, _join(shards, self.shapes[name]))

    def joined_outputs(self, exe):
        """{step output: value} for the outputs carrying a sharded parameter's update: the joined new weight
        (after ``step``), not the one replica's view the step program's run produced."""
        return {out: np.array(exe.read_variable(name)) for out, name in self.joined.items()}

    def _own(self):
        return {partial_norm_name(i) for i in range(self.norms)}

    def _place(self, exe, replica, kept, weights, grads, summed):
        """Before ``replica``'s step: the step's other updated variables as before the step, its shard of each
        sharded weight and gradient where the step reads it, its state shards, and the summed norms."""
        for name, value in kept.items():
            exe.write_variable(name, value)
        for name, shards in weights.items():
            accumulator = _training.accumulator_name(name)
            exe.write_variable(name, _placed(kept[name], shards[replica], self.replicas))
            exe.write_variable(accumulator, _placed(kept[accumulator], grads[name][replica], self.replicas))
        for variable, shards in self.values.items():
            exe.write_variable(variable, shards[replica])
        for i, total in enumerate(summed):
            exe.write_variable(summed_norm_name(i), np.float32(total))


def _split(whole, replicas):
    """[replicas, shard]: each replica's shard of ``whole`` flattened, replica r holding elements r, r +
    replicas, r + 2 x replicas...: shards of ceil(n / replicas) elements, the last ones ending with a zero of
    padding (PopART's counts; the element order is the simulator's, invisible to the host)."""
    flat = whole.reshape(-1)
    shards = np.zeros((replicas, shard_size(flat.size, replicas)), flat.dtype)
    for replica in range(replicas):
        own = flat[replica::replicas]
        shards[replica, : own.size] = own
    return shards


def _join(shards, shape):
    """The whole tensor of ``shape`` from every replica's shard, padding dropped."""
    whole = np.empty(int(np.prod(shape, dtype=np.int64)), shards.dtype)
    for replica, shard in enumerate(shards):
        own = whole[replica :: len(shards)]
        own[:] = shard[: own.size]
    return whole.reshape(shape)


def _placed(whole, shard, replicas):
    """``whole`` with a replica's ``shard`` (padded) at elements 0, replicas, 2 x replicas... of it flattened,
    where the step program reads a weight's or gradient's shard (``replica_shard``): replica 0's own elements."""
    flat = whole.reshape(-1).copy()
    flat[::replicas] = shard
    return flat.reshape(whole.shape)


def _own_elements(whole, replicas):
    """The shard ``_placed`` put into ``whole`` (``shard_size`` elements), as the step left it."""
    return np.asarray(whole).reshape(-1)[::replicas]
