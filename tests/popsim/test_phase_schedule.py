"""popsim.phase_schedule: a phase's IPUs run at the same time unless one reads another's values; IPUs that read
each other both ways, and the phases themselves, run one after another."""

import popsim

TARGET = popsim.Target.small(num_tiles=4)


def _program(*work):
    """A profile entry with one step per (phase, pass, ipu, cycles) of ``work``."""
    steps = [{"stage": p, "role": r, "ipu": i, "cycles": c} for p, r, i, c in work]
    total = sum(c + TARGET.bsp_sync_cycles for *_, c in work)
    return {"steps": steps, "total_cycles": total}


def _span(cycles):
    return cycles + TARGET.bsp_sync_cycles


def test_independent_ipus_of_a_phase_overlap_and_phases_follow_each_other():
    program = _program((0, "forward", 0, 100), (0, "forward", 1, 300), (1, "forward", 0, 50))
    schedule = popsim.phase_schedule(program, TARGET, set())
    assert schedule["serial_cycles"] == program["total_cycles"]
    assert schedule["total_cycles"] == _span(300) + _span(50)
    starts = {(e["phase"], e["ipu"]): e["start"] for e in schedule["timeline"]}
    assert starts == {(0, 0): 0, (0, 1): 0, (1, 0): _span(300)}


def test_a_read_orders_the_ipus_and_a_cycle_of_reads_is_serial():
    program = _program((0, "forward", 0, 100), (0, "forward", 1, 300), (0, "backward", 0, 70), (0, "backward", 1, 90))
    chain = popsim.phase_schedule(program, TARGET, {(0, "forward", 0, 1)})
    assert chain["total_cycles"] == _span(100) + _span(300) + _span(90)
    both_ways = {(0, "backward", 0, 1), (0, "backward", 1, 0)}
    serial = popsim.phase_schedule(program, TARGET, both_ways)
    assert serial["total_cycles"] == _span(300) + _span(70) + _span(90)
