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


def _transfers_program():
    """Phases 0 and 1 forward then backward on IPU 0: each forward phase stores an activation, each backward
    phase loads it back before computing."""
    steps = [
        {"stage": 0, "role": "forward", "ipu": 0, "cycles": 100},
        {"stage": 0, "role": "forward", "ipu": 0, "cycles": 40, "name": "remote store a"},
        {"stage": 1, "role": "forward", "ipu": 0, "cycles": 200},
        {"stage": 1, "role": "forward", "ipu": 0, "cycles": 30, "name": "remote store b"},
        {"stage": 1, "role": "backward", "ipu": 0, "cycles": 50, "name": "remote load remote b"},
        {"stage": 1, "role": "backward", "ipu": 0, "cycles": 150},
        {"stage": 0, "role": "backward", "ipu": 0, "cycles": 60, "name": "remote load remote a"},
        {"stage": 0, "role": "backward", "ipu": 0, "cycles": 120},
    ]
    for step in steps:
        if "name" in step:
            step["transfer"] = "streaming memory"
    return {"steps": steps, "total_cycles": sum(_span(s["cycles"]) for s in steps)}


def test_overlapped_streaming_transfers_hide_under_the_neighbouring_phases_within_a_pass():
    program = _transfers_program()
    serial = popsim.phase_schedule(program, TARGET, set())
    overlapped = popsim.phase_schedule(program, TARGET, set(), overlap=True)
    assert serial["total_cycles"] == program["total_cycles"]
    # Phase 0's store runs while phase 1 computes forward, phase 0's load while phase 1 computes backward; the
    # last forward store and the first backward load are in the gap between the passes, beside no compute.
    assert overlapped["total_cycles"] == program["total_cycles"] - _span(40) - _span(60)
    timeline = popsim.Timeline()
    placed = popsim.place_phases(timeline, program, TARGET, set(), 0, [0], overlap=True)
    moved = [i for i in placed if i.label.get("transfer") == "streaming memory"]
    assert [i.resources for i in moved] == [("replica 0 IPU 0 streaming memory",)] * 4
    computed = {(i.label["phase"], i.label["pass"]): i for i in placed if "phase" in i.label and i not in moved}
    store_a, store_b, load_b, load_a = moved
    assert store_a.start == computed[(0, "forward")].end and store_a.end < computed[(1, "forward")].end
    assert load_b.start >= store_b.end and computed[(1, "backward")].start == load_b.end
    assert computed[(1, "backward")].start <= load_a.start and load_a.end <= computed[(1, "backward")].end
    assert computed[(0, "backward")].start >= load_a.end
