"""What replication costs on the simulated IPUs: replicas run at the same time, then all-reduce gradients.

The replicas of one process are simulated one after another on one device (the numbers are the same);
the cycle figures treat them as ``replicationFactor x numProcesses`` sets of IPUs working in parallel: a
step costs one replica's micro-batches, the gradient all-reduce (``popsim.collectives``) and the optimizer.
"""

import contextlib

import numpy as np

from popsim import collectives
from poptorch import _training
from poptorch.enums import CommGroupType, VariableRetrievalMode
from poptorch.errors import Error
from poptorch.options import not_modelled


def all_reduce_cycles(exe, programs, options):
    """Cycles of the gradient all-reduce of each training step (0 without one), recorded in the profile
    with one replica's work per step."""
    replicas = options.replication_factor * options.Distributed.numProcesses
    if programs.step is None or replicas == 1:
        return 0
    nbytes = sum(programs.initial[_training.accumulator_name(name)].nbytes for name in programs.trained)
    # A pipelined or sharded replica spans several IPUs, each reducing the gradients of its own stages.
    target = exe.profile.target
    reduce = collectives.all_reduce(target, nbytes, replicas, ipus_per_replica=target.num_ipus)
    per_program = exe.profile.programs
    replica_step = per_program[programs.micro_batch]["total_cycles"] * options.Training.gradient_accumulation
    exe.profile.add_replication(replicas, replica_step, reduce, per_program[programs.step]["total_cycles"])
    return reduce.cycles


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


def grouping_methods(parameter, name):
    """Give the model's ``parameter`` (reached through a wrapper) PopTorch's ``replicaGrouping`` method (and
    its older name ``perReplica``)."""

    def replicaGrouping(comm_group_type, shards, variable_retrieval_mode):
        """Share this parameter within groups of replicas. Only one group of every replica (All, with
        OnePerGroup retrieval: PopTorch's default) is modelled."""
        comm_group_type = CommGroupType(comm_group_type)
        variable_retrieval_mode = VariableRetrievalMode(variable_retrieval_mode)
        if comm_group_type != CommGroupType.All or variable_retrieval_mode != VariableRetrievalMode.OnePerGroup:
            raise not_modelled(
                f"replicaGrouping(CommGroupType.{comm_group_type.name}, {shards}, "
                f"VariableRetrievalMode.{variable_retrieval_mode.name}) of parameter '{name}'",
                "replicas always share every parameter (CommGroupType.All, VariableRetrievalMode.OnePerGroup); "
                "split the parameter into per-group modules yourself",
            )

    parameter.replicaGrouping = replicaGrouping
    parameter.perReplica = replicaGrouping
    return parameter
