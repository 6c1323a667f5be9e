"""popsim.Timeline: an interval starts once its resources are free, the intervals it depends on have ended and
not before its given cycle; work on different resources overlaps; the makespan is the last end."""

import pytest

import popsim

A, B, IO = popsim.compute_lane(0, 0), popsim.compute_lane(0, 1), popsim.io_lane(0, 0)


def test_intervals_on_one_resource_follow_each_other_and_others_overlap():
    timeline = popsim.Timeline()
    first = timeline.add([A], 100, step="a")
    second = timeline.add([A], 50)
    other = timeline.add([B], 70)
    assert (first.start, first.end, second.start, second.end) == (0, 100, 100, 150)
    assert (other.start, other.end) == (0, 70)
    assert timeline.makespan == 150


def test_dependencies_and_a_start_cycle_delay_an_interval():
    timeline = popsim.Timeline()
    load = timeline.add([IO], 300)
    compute = timeline.add([A], 100, after=[load])
    late = timeline.add([B], 10, not_before=1000)
    both = timeline.add([A, IO], 5)
    assert compute.start == 300 and late.start == 1000
    assert both.start == max(compute.end, load.end) == 400
    assert timeline.free_at([A, B]) == 1010 == timeline.makespan


def test_as_dict_lists_lanes_and_labelled_intervals_without_empty_ones():
    timeline = popsim.Timeline()
    timeline.add([IO], 20, tensor="x")
    timeline.add([A, B], 0)
    timeline.add([A, B], 30, after=[], program="step")
    shown = timeline.as_dict()
    assert shown["makespan"] == 30 and shown["lanes"] == [IO, A, B]
    assert shown["intervals"] == [
        {"lanes": [IO], "start": 0, "end": 20, "tensor": "x"},
        {"lanes": [A, B], "start": 0, "end": 30, "program": "step"},
    ]
    with pytest.raises(ValueError, match="cannot last -1 cycles"):
        timeline.add([A], -1)


def test_a_sharded_run_places_each_stage_on_its_ipu_in_program_order():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 10},
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 5},
        {"stage": 1, "ipu": 1, "ipus": [0, 1], "role": "forward", "cycles": 4},  # an inter-IPU copy into IPU 1
        {"stage": 1, "ipu": 1, "role": "forward", "cycles": 20},
        {"cycles": 7},
        {"stage": 0, "ipu": 0, "role": "backward", "cycles": 30},
    ]
    staged = sum(s["cycles"] + sync for s in steps)
    timeline = popsim.Timeline()
    placed = popsim.place_steps(timeline, {"steps": steps}, target, 0, [0, 1], staged + 100)
    shown = [(i.resources, i.end - i.start, i.label.get("stage"), i.label.get("pass")) for i in placed]
    assert all(i.label["replica"] == 0 for i in placed)
    assert shown == [
        ((A,), 15 + 2 * sync, 0, "forward"),
        ((B, popsim.link_lane(0, 0, 1)), 4 + sync, 1, "forward"),
        ((B,), 20 + sync, 1, "forward"),
        ((A, B), 7 + sync, None, None),
        ((A,), 30 + sync, 0, "backward"),
        ((A, B), 100, None, None),
    ]
    assert all(a.end == b.start for a, b in zip(placed, placed[1:])) and timeline.makespan == staged + 100
    assert popsim.place_steps(popsim.Timeline(), {"steps": steps}, target, 0, [0, 1], staged - 1) is None


def test_a_phase_copy_into_an_ipu_holds_its_link_and_the_phase_spans_its_pieces():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 40},
        {"stage": 0, "ipu": 1, "ipus": [0, 1], "role": "forward", "cycles": 6},
        {"stage": 0, "ipu": 1, "role": "forward", "cycles": 30},
    ]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + sync for s in steps)}
    timeline = popsim.Timeline()
    placed = popsim.place_phases(timeline, program, target, {(0, "forward", 0, 1)}, 0, [0, 1])
    link = popsim.link_lane(0, 0, 1)
    copy = next(i for i in placed if link in i.resources)
    assert copy.resources == (B, link) and copy.start == 40 + sync and copy.end - copy.start == 6 + sync
    schedule = popsim.phase_schedule(program, target, {(0, "forward", 0, 1)})
    spans = {e["ipu"]: (e["start"], e["end"]) for e in schedule["timeline"]}
    assert spans == {0: (0, 40 + sync), 1: (40 + sync, 76 + 3 * sync)}
    assert schedule["total_cycles"] == timeline.makespan == program["total_cycles"]


def test_a_pipeline_runs_cycle_by_cycle_each_stage_after_the_one_before_on_its_micro_batch():
    target = popsim.Target.small(num_tiles=4)
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 100},
        {"stage": 1, "ipu": 1, "role": "forward", "cycles": 60},
        {"stage": 1, "ipu": 1, "role": "backward", "cycles": 90},
        {"stage": 0, "ipu": 0, "role": "backward", "cycles": 120},
    ]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + target.bsp_sync_cycles for s in steps) + 50}
    schedule = popsim.step_schedule(program, target, 3, True)
    timeline = popsim.Timeline()
    placed = popsim.place_pipeline(timeline, schedule, 0, [0, 1], not_before=10)
    assert timeline.makespan == 10 + schedule.total_cycles
    work = {(i.label["stage"], i.label["pass"], i.label["micro_batch"]): i for i in placed if "stage" in i.label}
    assert len(work) == 2 * 2 * 3
    for batch in range(3):
        assert work[(1, "forward", batch)].start >= work[(0, "forward", batch)].end
        assert work[(0, "backward", batch)].start >= work[(1, "backward", batch)].end
    # Stage 1's forward of micro-batch 0 overlaps stage 0's of micro-batch 1, on the other IPU.
    a, b = work[(1, "forward", 0)], work[(0, "forward", 1)]
    assert a.resources == (B,) and b.resources == (A,) and a.start == b.start == 10 + schedule.forward_slot
    assert [e["start"] + 10 for e in schedule.timeline()] == sorted(i.start for i in work.values())
