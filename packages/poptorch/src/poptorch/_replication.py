"""What replication costs on the simulated IPUs: replicas run at the same time, then all-reduce gradients.

The replicas of one process are simulated one after another on one device (the numbers are the same);
the cycle figures treat them as ``replicationFactor x numProcesses`` sets of IPUs working in parallel: a
step costs one replica's micro-batches, the gradient all-reduce (``popsim.collectives``) and the optimizer.
"""

from popsim import collectives
from poptorch import _training


def all_reduce_cycles(exe, programs, options):
    """Cycles of the gradient all-reduce of each training step (0 without one), recorded in the profile
    with one replica's work per step."""
    replicas = options.replication_factor * options.Distributed.numProcesses
    if programs.step is None or replicas == 1:
        return 0
    nbytes = sum(programs.initial[_training.accumulator_name(name)].nbytes for name in programs.trained)
    reduce = collectives.all_reduce(exe.profile.target, nbytes, replicas)
    per_program = exe.profile.programs
    replica_step = per_program[programs.micro_batch]["total_cycles"] * options.Training.gradient_accumulation
    exe.profile.add_replication(replicas, replica_step, reduce, per_program[programs.step]["total_cycles"])
    return reduce.cycles
