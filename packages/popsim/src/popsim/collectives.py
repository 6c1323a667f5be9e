"""Replicas as parallel simulated IPUs, and the cost of the collective that joins them.

R replicas of a model are R sets of IPUs running the same program at the same time, so a step costs one
replica's cycles, not R times them; what replication adds is the all-reduce of the gradients. Its cost
follows the IPU-POD's link hierarchy, as the Graphcore Communication Library runs it: a ring
reduce-scatter over the IPU-Links inside each IPU-M2000 (4 IPUs), then a ring all-reduce of those shards
between the machines of a POD64 (16 machines, machine-to-machine IPU-Links), then between PODs (over the
GW-Links), and an all-gather back down. Each level costs its bytes over its slowest link plus a latency per
ring step; the levels run one after the other.

Link figures (published): a Mk2 GC200 has 10 IPU-Links, 320 GB/s of chip-to-chip bandwidth (counted both
ways: 160 GB/s each way); an IPU-M2000 / Bow-2000 machine has IPU-Links of 512 Gbps (64 GB/s) to the other
machines of its POD and 2 x 100 Gbps GW-Links (25 GB/s) to other PODs (Graphcore's Colossus Mk2
announcement, July 2020; IPU-M2000 and Bow-2000 datasheets). The latency of one ring step, one BSP sync
across IPUs plus the exchange's fixed cost, is an *estimate*.
"""

import math
from dataclasses import astuple, dataclass

from popsim.errors import Error

IPUS_PER_MACHINE = 4  # GC200s in an IPU-M2000
MACHINES_PER_POD = 16  # IPU-M2000s in an IPU-POD64
IPU_LINK_BYTES_PER_SECOND = 320e9 / 2  # inside a machine, per IPU and direction
MACHINE_LINK_BYTES_PER_SECOND = 512e9 / 8  # a machine's IPU-Links to the rest of its POD
GW_LINK_BYTES_PER_SECOND = 2 * 100e9 / 8  # a machine's GW-Links to other PODs


@dataclass(frozen=True)
class Level:
    """One level of a hierarchical all-reduce: ``members`` taking part per group, the bytes the busiest
    link carries each way, and its cycles (bandwidth plus ring-step latency)."""

    name: str
    members: int
    link_bytes: int
    cycles: int
    after_update: bool = False  # an all-gather of updated weights: it runs after the optimizer step


@dataclass(frozen=True)
class AllReduce:
    """The cost of summing ``nbytes`` over ``replicas`` replicas: its levels and their total cycles."""

    replicas: int
    nbytes: int
    levels: tuple

    @property
    def cycles(self):
        return sum(level.cycles for level in self.levels)

    def to_dict(self):
        return {
            "replicas": self.replicas,
            "bytes": self.nbytes,
            "cycles": self.cycles,
            "levels": [level.__dict__ for level in self.levels],
        }


def _ring(name, target, members, link_bytes, bytes_per_second, passes=2):
    """A ring reduce-scatter plus all-gather among ``members`` (``passes`` 2), or either alone (1): ``passes``
    x (n - 1) steps, each moving 1/n of the data (``link_bytes`` in all over the busiest link)."""
    steps = passes * (members - 1)
    carried = math.ceil(link_bytes * steps / members)
    seconds = carried / bytes_per_second
    latency = steps * (target.sync_cycles_across_ipus + target.exchange_fixed_cycles)
    return Level(name, members, carried, math.ceil(seconds * target.clock_hz) + latency)


def all_reduce(target, nbytes, replicas, ipus_per_replica=1, stride=1, passes=2):
    """The cost of an all-reduce of ``nbytes`` per replica over ``replicas`` replicas of
    ``ipus_per_replica`` IPUs each (each IPU reduces its own part of the bytes). ``passes`` 1 costs half of
    it: the reduce-scatter (or the all-gather) alone, over the same levels (see ``sharded_update``).

    ``stride`` > 1 is one group of a replica grouping whose members are ``stride`` replicas apart (the
    other ``stride - 1`` groups reduce at the same time over the replicas in between): fewer of a group's
    members share a machine, and every group's shards share the machines' links.
    """
    if replicas < 1 or ipus_per_replica < 1 or stride < 1:
        raise Error(
            f"an all-reduce needs at least one replica and one IPU each, and a stride of at least one, got "
            f"{replicas} x {ipus_per_replica} (stride {stride})"
        )
    if replicas == 1 or nbytes == 0:
        return AllReduce(replicas, nbytes, ())
    # Every replica of the grouping runs at once: the machines hold ``replicas x stride`` replicas.
    ipus = replicas * stride * ipus_per_replica
    # Replicas fill machines first; a replica's IPUs each carry their share of the bytes.
    replicas_per_machine = max(1, IPUS_PER_MACHINE // ipus_per_replica)
    in_machine = max(1, min(replicas, replicas_per_machine // stride))
    in_pod = min(math.ceil(replicas / in_machine), MACHINES_PER_POD)
    pods = math.ceil(replicas / (in_machine * in_pod))
    per_ipu = math.ceil(nbytes / ipus_per_replica)
    levels = []
    if in_machine > 1:
        levels.append(
            _ring("IPU-Links in an IPU-M2000", target, in_machine, per_ipu, IPU_LINK_BYTES_PER_SECOND, passes)
        )
    # After the reduce-scatter inside a machine each IPU holds 1/in_machine of its bytes; all the machine's
    # IPUs send their shards through the machine's links.
    machine_bytes = per_ipu * min(ipus, IPUS_PER_MACHINE) // in_machine
    if in_pod > 1:
        levels.append(
            _ring("IPU-Links between machines", target, in_pod, machine_bytes, MACHINE_LINK_BYTES_PER_SECOND, passes)
        )
    if pods > 1:
        pod_bytes = math.ceil(machine_bytes / in_pod)
        levels.append(_ring("GW-Links between PODs", target, pods, pod_bytes, GW_LINK_BYTES_PER_SECOND, passes))
    return AllReduce(replicas, nbytes, tuple(levels))


def grouped_all_reduce(target, parts, replicas, ipus_per_replica=1):
    """The cost of reducing several sets of gradients one after another: ``parts`` lists (nbytes, group
    size, stride) per set, each reduced within its groups of replicas (group size ``replicas`` and stride 1
    for gradients every replica shares). Levels of a grouped set are named after their group size."""
    levels = []
    for nbytes, size, stride in parts:
        reduce = all_reduce(target, nbytes, size, ipus_per_replica, stride)
        prefix = "" if size == replicas else f"groups of {size}: "
        levels.extend(Level(prefix + level.name, *astuple(level)[1:]) for level in reduce.levels)
    return AllReduce(replicas, sum(part[0] for part in parts), tuple(levels))


def sharded_update(target, grad_bytes, weight_bytes, replicas, ipus_per_replica=1):
    """The collectives of an optimizer update sharded over ``replicas`` (replicated tensor sharding): the
    gradients (``grad_bytes`` per replica) are reduce-scattered, so each replica sums only the shard it
    updates, and the updated weights (``weight_bytes``) are all-gathered back to every replica after the
    optimizer step. Each costs half an all-reduce of its bytes over the same link levels."""
    scatter = all_reduce(target, grad_bytes, replicas, ipus_per_replica, passes=1)
    gather = all_reduce(target, weight_bytes, replicas, ipus_per_replica, passes=1)
    levels = [Level("reduce-scatter: " + level.name, *astuple(level)[1:]) for level in scatter.levels]
    levels += [Level("all-gather: " + level.name, *astuple(level)[1:-1], True) for level in gather.levels]
    return AllReduce(replicas, grad_bytes, tuple(levels))


def replica_timeline(replicas, runs, all_reduce, optimizer, replicas_per_process, ipus_per_replica=1):
    """Who ran what in one training step of ``replicas`` replicas working at once, as timeline entries
    (``start`` and ``cycles`` from the step's start): every replica's ``runs`` (a list of (program, cycles),
    one per micro-batch) one after another, then the levels of the ``all_reduce`` over every replica, then
    each replica's ``optimizer`` (program, cycles), then the levels that gather updated weights. A replica
    entry names its process (``replicas_per_process`` replicas each) and the IPUs it occupies. Inference
    has no ``all_reduce`` nor ``optimizer`` (None)."""
    entries = []
    replica_cycles = sum(cycles for _, cycles in runs)
    levels = all_reduce.levels if all_reduce is not None else ()
    ends_at = replica_cycles + sum(level.cycles for level in levels if not level.after_update)
    for replica in range(replicas):
        place = {
            "lane": f"replica {replica}",
            "replica": replica,
            "process": replica // replicas_per_process,
            "ipus": list(range(replica * ipus_per_replica, (replica + 1) * ipus_per_replica)),
        }
        start = 0
        for micro_batch, (program, cycles) in enumerate(runs):
            entries.append({**place, "program": program, "micro_batch": micro_batch, "start": start, "cycles": cycles})
            start += cycles
        if optimizer is not None:
            entries.append({**place, "program": optimizer[0], "start": ends_at, "cycles": optimizer[1]})
    # Reductions run between the replicas' runs and the optimizer; an all-gather of updated weights after it.
    updated_at = ends_at + (optimizer[1] if optimizer is not None else 0)
    for after, start in ((False, replica_cycles), (True, updated_at)):
        for level in (level for level in levels if level.after_update == after):
            entries.append(
                {
                    "lane": "all-reduce",
                    "collective": level.name,
                    "members": level.members,
                    "start": start,
                    "cycles": level.cycles,
                }
            )
            start += level.cycles
    return entries
