"""The replicas' gradient all-reduce: its cost follows the IPU-POD's link hierarchy."""

import pytest

import popsim
from popsim import collectives

TARGET = popsim.Target.ipu2()
MEGABYTES = 64 * 2**20


def _level_names(replicas):
    return [level.name for level in collectives.all_reduce(TARGET, MEGABYTES, replicas).levels]


def test_one_replica_or_nothing_to_reduce_costs_nothing():
    assert collectives.all_reduce(TARGET, MEGABYTES, 1).cycles == 0
    assert collectives.all_reduce(TARGET, 0, 16).cycles == 0


def test_the_levels_follow_machines_and_pods():
    assert _level_names(2) == _level_names(4) == ["IPU-Links in an IPU-M2000"]
    assert _level_names(16) == ["IPU-Links in an IPU-M2000", "IPU-Links between machines"]
    assert _level_names(256)[-1] == "GW-Links between PODs"
    assert [level.members for level in collectives.all_reduce(TARGET, MEGABYTES, 64).levels] == [4, 16]


@pytest.mark.parametrize("replicas", [2, 4, 8, 16, 64, 128])
def test_no_level_beats_its_links(replicas):
    rates = {
        "IPU-Links in an IPU-M2000": collectives.IPU_LINK_BYTES_PER_SECOND,
        "IPU-Links between machines": collectives.MACHINE_LINK_BYTES_PER_SECOND,
        "GW-Links between PODs": collectives.GW_LINK_BYTES_PER_SECOND,
    }
    for level in collectives.all_reduce(TARGET, MEGABYTES, replicas).levels:
        # A ring moves 2 (n - 1) / n of the data over every link.
        assert level.cycles >= level.link_bytes / rates[level.name] * TARGET.clock_hz


def test_crossing_the_machine_boundary_costs_more_than_doubling_inside_it():
    cost = {r: collectives.all_reduce(TARGET, MEGABYTES, r).cycles for r in (2, 4, 8)}
    # Inside a machine a ring's bytes per link grow from 1 to 1.5 times the data; beyond it the slower
    # machine links add a whole level.
    assert cost[4] < 1.6 * cost[2]
    assert cost[8] > 2 * cost[4]


def test_bad_replica_counts_are_errors():
    with pytest.raises(popsim.Error, match="at least one replica"):
        collectives.all_reduce(TARGET, 4, 0)


def test_a_group_reduces_over_its_own_replicas_links():
    # 16 replicas in groups of 4: consecutive groups stay inside their machine, orthogonal ones (members 4
    # replicas apart) have one member per machine and cross the machine links.
    consecutive = collectives.all_reduce(TARGET, MEGABYTES, 4, stride=1)
    orthogonal = collectives.all_reduce(TARGET, MEGABYTES, 4, stride=4)
    assert [level.name for level in consecutive.levels] == ["IPU-Links in an IPU-M2000"]
    assert [level.name for level in orthogonal.levels] == ["IPU-Links between machines"]
    # A group inside a machine beats reducing all 16 replicas; the orthogonal groups' full-size shards
    # share each machine's links.
    assert consecutive.cycles < collectives.all_reduce(TARGET, MEGABYTES, 16).cycles < orthogonal.cycles


def test_grouped_sets_are_reduced_one_after_another():
    parts = [(MEGABYTES, 16, 1), (MEGABYTES, 4, 4)]
    reduce = collectives.grouped_all_reduce(TARGET, parts, 16)
    alone = [collectives.all_reduce(TARGET, MEGABYTES, size, stride=stride).cycles for _, size, stride in parts]
    assert reduce.cycles == sum(alone) and reduce.nbytes == 2 * MEGABYTES
    assert reduce.levels[-1].name == "groups of 4: IPU-Links between machines"


def test_the_timeline_shows_each_replica_then_the_collective():
    reduce = collectives.all_reduce(TARGET, MEGABYTES, 8)
    entries = collectives.replica_timeline(8, [("accumulate", 100)] * 2, reduce, ("apply", 30), 4, ipus_per_replica=2)
    lanes = {}
    for entry in entries:
        lanes.setdefault(entry["lane"], []).append(entry)
    assert len(lanes) == 9 and [e["start"] for e in lanes["replica 5"]] == [0, 100, 200 + reduce.cycles]
    assert lanes["replica 5"][0]["process"] == 1 and lanes["replica 5"][0]["ipus"] == [10, 11]
    collective = lanes["all-reduce"]
    assert [e["collective"] for e in collective] == [level.name for level in reduce.levels]
    assert collective[0]["start"] == 200 and sum(e["cycles"] for e in collective) == reduce.cycles


@pytest.mark.parametrize("replicas", [2, 16, 256])
def test_a_sharded_update_reduce_scatters_then_all_gathers_half_an_all_reduce_each(replicas):
    whole = collectives.all_reduce(TARGET, MEGABYTES, replicas)
    update = collectives.sharded_update(TARGET, MEGABYTES, MEGABYTES, replicas)
    names = [level.name for level in whole.levels]
    assert [level.name for level in update.levels] == [f"reduce-scatter: {n}" for n in names] + [
        f"all-gather: {n}" for n in names
    ]
    assert [level.after_update for level in update.levels] == [False] * len(names) + [True] * len(names)
    # A ring all-reduce is a reduce-scatter then an all-gather: the same cycles, give or take rounding.
    assert abs(update.cycles - whole.cycles) <= 2 * len(names)
