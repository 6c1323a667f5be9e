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
    sync = target.bsp_sync_cycles
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 100},
        {"name": "inter-ipu to 1", "stage": 1, "ipu": 1, "ipus": [0, 1], "role": "forward", "cycles": 10},
        {"stage": 1, "ipu": 1, "role": "forward", "cycles": 60},
        {"stage": 1, "ipu": 1, "role": "backward", "cycles": 90},
        # A gradient copy merged into the sender's exchange: it lands on IPU 0.
        {"name": "copy+inter-ipu to 0", "stage": 1, "ipu": 1, "ipus": [0, 1], "role": "backward", "cycles": 12},
        {"stage": 0, "ipu": 0, "role": "backward", "cycles": 120},
    ]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + sync for s in steps) + 50}
    schedule = popsim.step_schedule(program, target, 3, True)
    f0, f1, b1, b0, into1, into0 = (c + sync for c in (100, 60, 90, 120, 10, 12))
    assert (schedule.forward_cycles, schedule.backward_cycles) == ({0: f0, 1: f1}, {0: b0, 1: b1})
    timeline = popsim.Timeline()
    placed = popsim.place_pipeline(timeline, schedule, 0, [0, 1], not_before=10)
    # PopART's cycles: stage 0 runs forward t and backward t - 2, stage 1 forward and backward t - 1; each
    # cycle lasts as long as its busiest IPU, then its copies cross (both directions at once on the links).
    per_cycle = [f0 + into1, max(f0, f1 + b1) + max(into1, into0), max(f0 + b0, f1 + b1) + max(into1, into0)]
    per_cycle += [max(b0, f1 + b1) + into0, b0]
    assert schedule.total_cycles == sum(per_cycle) + 3 * 50 and timeline.makespan == 10 + schedule.total_cycles
    computed = [i for i in placed if "stage" in i.label and "transfer" not in i.label]
    work = {(i.label["stage"], i.label["pass"], i.label["micro_batch"]): i for i in computed}
    assert len(work) == 2 * 2 * 3
    for batch in range(3):
        assert work[(1, "forward", batch)].start >= work[(0, "forward", batch)].end
        assert work[(1, "backward", batch)].start >= work[(1, "forward", batch)].end
        assert work[(0, "backward", batch)].start >= work[(1, "backward", batch)].end
    # Stage 1's forward of micro-batch 0 overlaps stage 0's of micro-batch 1, on the other IPU.
    a, b = work[(1, "forward", 0)], work[(0, "forward", 1)]
    assert a.resources == (B,) and b.resources == (A,) and a.start == b.start == 10 + per_cycle[0]
    assert [e["start"] + 10 for e in schedule.timeline()] == sorted(i.start for i in work.values())
    # The copies hold the IPU they land on and the IPU-Link in their direction, after the cycle's work.
    copies = [i for i in placed if i.label.get("transfer") == "inter-IPU copy"]
    forward = [c for c in copies if c.label["pass"] == "forward"]
    assert [c.resources for c in forward] == [(B, popsim.link_lane(0, 0, 1))] * 3
    assert all(c.end - c.start == into1 for c in forward)
    assert all(c.start >= work[(0, "forward", c.label["micro_batch"])].end for c in forward)
    backward = [c for c in copies if c.label["pass"] == "backward"]
    assert [c.resources for c in backward] == [(A, popsim.link_lane(0, 1, 0))] * 3
    shown = schedule.as_dict()
    # Ramp-up until IPU 1 first computes; ramp-down from when IPU 1 has computed its last micro-batch.
    ramp_down = per_cycle[3] - (f1 + b1) + per_cycle[4]
    assert shown["ramp_up_cycles"] == per_cycle[0] and shown["ramp_down_cycles"] == ramp_down
    assert shown["main_cycles"] == sum(per_cycle) - per_cycle[0] - ramp_down
    # Each IPU's bubbles: the pipeline's cycles it spends neither computing nor receiving.
    span = sum(per_cycle)
    assert shown["bubble_cycles"] == {0: span - 3 * (f0 + b0 + into0), 1: span - 3 * (f1 + b1 + into1)}


def test_an_inference_pipeline_takes_a_cycle_per_micro_batch_and_stage():
    target = popsim.Target.small(num_tiles=4)
    steps = [{"stage": k, "ipu": k, "role": "forward", "cycles": 100 * (k + 1)} for k in range(3)]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + target.bsp_sync_cycles for s in steps)}
    schedule = popsim.step_schedule(program, target, 4, True)
    first, second, slowest = (c + target.bsp_sync_cycles for c in (100, 200, 300))
    # M + S - 1 cycles; from the third on, the slowest stage sets each cycle's length.
    assert schedule.total_cycles == first + second + 4 * slowest
    assert schedule.ramp_up_cycles == first + second
    # IPU 0 is done with micro-batch 3 early in the fourth cycle; the last two drain the pipeline.
    assert schedule.ramp_down_cycles == (slowest - first) + 2 * slowest


def test_a_run_s_host_transfers_callbacks_and_streaming_memory_are_intervals_on_their_lanes():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"name": "stream-in x", "kind": "host", "cycles": 30, "transfer": "host transfer"},
        {"name": "remote load w", "kind": "host", "cycles": 80, "transfer": "streaming memory"},
        {"name": "matmul", "kind": "compute", "cycles": 100},
        {"name": "stream-out cb.in0", "kind": "host", "cycles": 20, "transfer": "host transfer"},
        {"name": "host-call cb", "kind": "host", "cycles": 500, "transfer": "host callback"},
        {"name": "add", "kind": "compute", "cycles": 40},
    ]
    cycles = sum(s["cycles"] + sync for s in steps) + 25  # 25: control beyond the steps
    timeline = popsim.Timeline()
    placed = popsim.place_steps(timeline, {"steps": steps}, target, 0, [0], cycles, device_iteration=3)
    shown = [(i.resources, i.end - i.start, i.label.get("transfer")) for i in placed]
    assert shown == [
        ((A, popsim.transfer_lane(0, 0, "host transfer")), 30 + sync, "host transfer"),
        ((A, "replica 0 IPU 0 streaming memory"), 80 + sync, "streaming memory"),
        ((A,), 100 + sync, None),
        ((A, "replica 0 host link"), 20 + sync, "host transfer"),
        ((A, "replica 0 host"), 500 + sync, "host callback"),
        ((A,), 40 + sync, None),
        ((A,), 25, None),
    ]
    # One after another: the run's intervals add up to its cycles.
    assert all(a.end == b.start for a, b in zip(placed, placed[1:])) and timeline.makespan == cycles
    assert all(i.label["device_iteration"] == 3 for i in placed)


def test_a_phase_s_streaming_memory_load_is_a_piece_of_its_own():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {
            "name": "remote load w",
            "stage": 0,
            "ipu": 0,
            "role": "forward",
            "cycles": 70,
            "transfer": "streaming memory",
        },
        {"name": "matmul", "stage": 0, "ipu": 0, "role": "forward", "cycles": 40},
    ]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + sync for s in steps)}
    timeline = popsim.Timeline()
    placed = popsim.place_phases(timeline, program, target, set(), 0, [0])
    load, compute = placed[:2]
    assert load.resources == (A, "replica 0 IPU 0 streaming memory") and load.label["transfer"] == "streaming memory"
    assert load.end - load.start == 70 + sync and compute.start == load.end and compute.resources == (A,)
    assert timeline.makespan == program["total_cycles"]


def test_a_pipeline_stage_s_streaming_memory_load_is_an_interval_of_its_own():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    load = {"name": "remote load w", "kind": "host", "cycles": 70, "transfer": "streaming memory"}
    steps = [
        {**load, "stage": 0, "ipu": 0, "role": "forward"},
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 100},
        {"stage": 1, "ipu": 1, "role": "forward", "cycles": 60},
    ]
    program = {"steps": steps, "total_cycles": sum(s["cycles"] + sync for s in steps)}
    streamed = popsim.step_schedule(program, target, 2, True)
    unlabelled = [{k: v for k, v in s.items() if k != "transfer"} for s in steps]
    plain = popsim.step_schedule({**program, "steps": unlabelled}, target, 2, True)
    # The load is part of stage 0's forward: the same cycles, now on the streaming-memory lane too.
    assert streamed.total_cycles == plain.total_cycles and streamed.forward_cycles == plain.forward_cycles
    timeline = popsim.Timeline()
    placed = popsim.place_pipeline(timeline, streamed, 0, [0, 1])
    loads = [i for i in placed if i.label.get("transfer") == "streaming memory"]
    assert [i.resources for i in loads] == [(A, "replica 0 IPU 0 streaming memory")] * 2
    for i in loads:  # each micro-batch's load, then its compute on the IPU
        compute = next(c for c in placed if c.start == i.end and c.resources == (A,))
        assert i.end - i.start == 70 + sync and compute.label["micro_batch"] == i.label["micro_batch"]
    assert [(e["stage"], e["end"] - e["start"]) for e in streamed.timeline() if e["micro_batch"] == 0] == [
        (0, 170 + 2 * sync),
        (1, 60 + sync),
    ]


def _streamed_program(target, steps, unplaced=0):
    sync = target.bsp_sync_cycles
    return {"steps": steps, "total_cycles": sum(s["cycles"] + sync for s in steps) + unplaced}


def test_a_one_stage_pipeline_s_step_is_the_sum_of_its_parts():
    """Nothing can overlap on one IPU and one host link: each micro-batch's input stream, forward, backward,
    output stream and unplaced work follow each other."""
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 100},
        {"stage": 0, "ipu": 0, "role": "backward", "cycles": 80},
    ]
    streams = [
        ("x", True, 30, ((0, "forward"),)),
        ("loss", False, 7, ((0, "forward"),)),
        ("y", True, 5, ((9, "forward"),)),
    ]
    # The streamed bytes are part of the program's cycles; "y" is read by no stage of the program.
    program = _streamed_program(target, steps, unplaced=30 + 7 + 5 + 40)
    schedule = popsim.step_schedule(program, target, 3, True, streams)
    assert [(s.name, s.stage, s.direction) for s in schedule.streams] == [("x", 0, "forward"), ("loss", 0, "forward")]
    assert schedule.outside_cycles == 5 + 40
    assert schedule.total_cycles == schedule.serial_cycles == 3 * (30 + 100 + sync + 7 + 80 + sync + 45)
    timeline = popsim.Timeline()
    placed = popsim.place_pipeline(timeline, schedule, 0, [0])
    spans = sorted((i.start, i.end) for i in placed if i.end > i.start)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert placed[-1].label["work"] == "outside stages" and placed[-1].end - placed[-1].start == 3 * 45


def test_a_pipeline_streams_each_micro_batch_s_tensors_around_the_passes_that_use_them():
    target = popsim.Target.small(num_tiles=4)
    steps = [
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 100},
        {"stage": 1, "ipu": 1, "role": "forward", "cycles": 60},
        {"stage": 1, "ipu": 1, "role": "backward", "cycles": 90},
        {"stage": 0, "ipu": 0, "role": "backward", "cycles": 120},
    ]
    # x is read by stage 0's forward and backward (it streams in before the first), the label by stage 1's
    # forward; the loss comes out of stage 1's forward.
    streams = [
        ("x", True, 30, ((0, "backward"), (0, "forward"))),
        ("label", True, 4, ((1, "forward"),)),
        ("loss", False, 2, ((1, "forward"),)),
    ]
    schedule = popsim.step_schedule(_streamed_program(target, steps, unplaced=36), target, 4, True, streams)
    assert schedule.outside_cycles == 0
    timeline = popsim.Timeline()
    placed = popsim.place_pipeline(timeline, schedule, 0, [0, 1])
    link = popsim.transfer_lane(0, 0, "host transfer")
    work = {
        (i.label["stage"], i.label["pass"], i.label["micro_batch"]): i
        for i in placed
        if "stage" in i.label and "transfer" not in i.label
    }
    moved = {(i.label["tensor"], i.label["micro_batch"]): i for i in placed if "tensor" in i.label}
    assert len(moved) == 3 * 4
    for batch in range(4):
        x, label, loss = (moved[(name, batch)] for name in ("x", "label", "loss"))
        assert x.resources == (A, link) and label.resources == loss.resources == (B, link)
        assert x.end <= work[(0, "forward", batch)].start and label.end <= work[(1, "forward", batch)].start
        assert loss.start >= work[(1, "forward", batch)].end and loss.end <= work[(1, "backward", batch)].start
        assert x.label["pipeline_cycle"] == work[(0, "forward", batch)].label["pipeline_cycle"]
    # One host link: the streams of all micro-batches and IPUs follow each other on it.
    spans = sorted((i.start, i.end) for i in moved.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # Streaming while the other IPU computes: the pipeline is shorter than its pieces run one after another.
    assert schedule.total_cycles < schedule.serial_cycles
