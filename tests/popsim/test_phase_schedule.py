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


HOST_LINK = "replica 0 host link"


def _streams(y_phase, ipu_of_phase_1):
    """x read in phase 0, y in phase ``y_phase`` (and by a unit the run does not have); ``early`` made by phase
    0, ``out`` by phase 1; ``seed`` read by no phase's node."""
    y_ipu = 0 if y_phase == 0 else ipu_of_phase_1
    return [
        ("x", True, 20, ((0, "forward", 0),)),
        ("y", True, 30, ((y_phase, "forward", y_ipu), (0, "backward", 0))),
        ("seed", True, 5, ()),
        ("early", False, 40, ((0, "forward", 0),)),
        ("out", False, 10, ((1, "forward", ipu_of_phase_1),)),
    ]


def _streamed_program(ipu_of_phase_1, control=25):
    """Phase 0 on IPU 0, then phase 1 on ``ipu_of_phase_1``; the run's total counts its host streams and
    ``control`` cycles of no phase."""
    program = _program((0, "forward", 0, 100), (1, "forward", ipu_of_phase_1, 300))
    program["total_cycles"] += sum(cycles for _, _, cycles, _ in _streams(1, 0)) + control
    return program


def _placed(program, streams, ipus):
    """The timeline of one run and its intervals by tensor, phase or "rest"."""
    timeline = popsim.Timeline()
    placed = popsim.place_phases(timeline, program, TARGET, set(), 0, ipus, streams=streams)
    return timeline, {i.label.get("tensor", i.label.get("phase", "rest")): i for i in placed}


def test_a_serial_run_s_streams_sit_at_their_program_positions_and_keep_its_cycles():
    program = _streamed_program(0)
    streams = _streams(1, 0)
    timeline, at = _placed(program, streams, [0])
    assert timeline.makespan == program["total_cycles"]  # nothing can overlap on one IPU
    assert at["seed"].start == 0 and at["x"].start == at["seed"].end and at[0].start == at["x"].end
    assert at["early"].start == at[0].end and at["y"].start == at["early"].end and at[1].start == at["y"].end
    assert at["out"].start == at[1].end and at["rest"].start == at["out"].end
    assert at["rest"].end - at["rest"].start == 25
    assert at["x"].resources == (HOST_LINK, "replica 0 IPU 0 compute")
    shown = {"phase": 0, "pass": "forward", "ipu": 0, "stream": "out", "transfer": "host transfer"}
    assert at["early"].label.items() >= shown.items()
    schedule = popsim.phase_schedule(program, TARGET, set(), streams=streams)
    assert schedule["total_cycles"] == program["total_cycles"]
    assert [(e["phase"], e["start"]) for e in schedule["timeline"]] == [(0, at[0].start), (1, at[1].start)]


def test_a_later_phase_s_ipu_works_while_an_earlier_output_streams_out():
    program = _streamed_program(1)
    timeline, at = _placed(program, _streams(0, 1), [0, 1])
    before = _placed(program, (), [0, 1])[0].makespan  # every stream in one block on every IPU at the end
    assert before == program["total_cycles"]
    # early streams out of IPU 0 while phase 1 computes on IPU 1: it costs no cycles.
    assert timeline.makespan == before - 40
    assert at["early"].resources == (HOST_LINK, "replica 0 IPU 0 compute") and at["early"].start == at[0].end
    assert at[1].start == at[0].end and at["out"].start == at[1].end and at["rest"].start == at["out"].end
    assert at["x"].end == at["y"].start and at[0].start == at["y"].end
    assert at["seed"].resources == (HOST_LINK, "replica 0 IPU 0 compute", "replica 0 IPU 1 compute")


def test_an_input_waits_for_the_host_link_an_earlier_output_holds():
    program = _streamed_program(1)
    timeline, at = _placed(program, _streams(1, 1), [0, 1])
    # y streams into IPU 1 for phase 1 once early is out: the link runs one stream at a time.
    assert at["y"].start == at["early"].end and at[1].start == at["y"].end
    assert timeline.makespan == program["total_cycles"]


def test_streams_beyond_the_run_s_cycles_stay_in_its_rest():
    program = _streamed_program(0, control=0)
    program["total_cycles"] -= 1
    timeline, _ = _placed(program, _streams(1, 0), [0])
    assert not any("tensor" in i.label for i in timeline.intervals)
    assert timeline.makespan == program["total_cycles"]


def test_steps_of_no_phase_run_on_every_ipu_at_their_program_positions():
    steps = [
        {"ipu": 0, "cycles": 15},
        {"stage": 0, "role": "forward", "ipu": 0, "cycles": 100},
        {"ipu": 0, "cycles": 50, "transfer": "host callback", "name": "host-call"},
        {"stage": 1, "role": "forward", "ipu": 1, "cycles": 300},
    ]
    program = {"steps": steps, "total_cycles": sum(_span(s["cycles"]) for s in steps) + 25}
    timeline = popsim.Timeline()
    placed = popsim.place_phases(timeline, program, TARGET, set(), 0, [0, 1])
    first, phase_0, call, phase_1, rest = placed
    both = ("replica 0 IPU 0 compute", "replica 0 IPU 1 compute")
    assert first.resources == both and first.start == 0 and phase_0.start == first.end
    assert call.resources == (*both, "replica 0 host") and call.label["transfer"] == "host callback"
    assert call.start == phase_0.end and phase_1.start == call.end and rest.start == phase_1.end
    assert rest.end - rest.start == 25 and timeline.makespan == program["total_cycles"]
