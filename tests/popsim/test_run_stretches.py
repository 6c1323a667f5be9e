"""``run_stretches`` groups a run's consecutive steps holding the same resources; a step of no stage and no
transfer holds only compute tiles, whatever else it records."""

import popsim
from popsim.timeline import HOST_TRANSFER, STREAMING_MEMORY


def test_stretches_merge_consecutive_steps_of_the_same_resources():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"cycles": 3, "name": "plain"},
        {"cycles": 4},
        {"cycles": 5, "transfer": HOST_TRANSFER},
        {"cycles": 6, "transfer": HOST_TRANSFER},
        {"cycles": 7, "transfer": None},  # no transfer after all: compute tiles only
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 8},
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 9, "transfer": STREAMING_MEMORY},
        {"cycles": 10},
    ]
    host_link = popsim.transfer_lane(1, 0, HOST_TRANSFER)
    memory = popsim.transfer_lane(1, 0, STREAMING_MEMORY)
    assert popsim.run_stretches({"steps": steps}, target, 1) == [
        ((None, None, None, (), None), 7 + 2 * sync),
        ((None, None, None, (host_link,), HOST_TRANSFER), 11 + 2 * sync),
        ((None, None, None, (), None), 7 + sync),
        ((0, "forward", 0, (), None), 8 + sync),
        ((0, "forward", 0, (memory,), STREAMING_MEMORY), 9 + sync),
        ((None, None, None, (), None), 10 + sync),
    ]


def _stage(stage, ipu, cycles, lanes=()):
    return ((stage, "forward", ipu, lanes, None), cycles)


def test_streams_sit_at_their_program_positions_on_the_host_link():
    link = popsim.transfer_lane(0, 0, HOST_TRANSFER)
    stretches = [_stage(0, 0, 100), _stage(1, 1, 10, (popsim.link_lane(0, 0, 1),)), _stage(1, 1, 100)]
    streams = [
        ("x", True, 5, ((1, "forward"), (0, "forward"))),  # read by both stages: in before the first
        ("early", False, 7, ((0, "forward"),)),
        ("out", False, 2, ((1, "forward"),)),
        ("unread", True, 4, ()),
        ("made off stage", False, 1, ()),
    ]
    merged = popsim.stream_stretches(stretches, streams, 0)
    order = [entry[2]["tensor"] if len(entry) > 2 else entry[0][:3] for entry in merged]
    assert order == [
        "x",
        "unread",
        (0, "forward", 0),
        "early",
        (1, "forward", 1),
        (1, "forward", 1),
        "out",
        "made off stage",
    ]
    streamed = {entry[2]["tensor"]: entry for entry in merged if len(entry) > 2}
    assert streamed["x"] == ((0, "forward", 0, (link,), HOST_TRANSFER), 5, {"tensor": "x", "stream": "in"})
    assert streamed["early"][0][:3] == (0, "forward", 0) and streamed["early"][2]["stream"] == "out"
    assert streamed["out"][0][:3] == (1, "forward", 1)
    assert streamed["unread"][0] == (None, None, None, (link,), HOST_TRANSFER)


def _placed(stretches, streams, rest=3):
    merged = popsim.stream_stretches(stretches, streams, 0)
    cycles = sum(entry[1] for entry in merged) + rest
    timeline = popsim.Timeline()
    target = popsim.Target.small(num_tiles=4)
    intervals = popsim.place_steps(timeline, {"steps": []}, target, 0, [0, 1], cycles, stretches=merged)
    return timeline, intervals, cycles


def test_a_run_whose_streams_cannot_overlap_keeps_its_cycles():
    stretches = [_stage(0, 0, 100), _stage(1, 1, 100)]
    streams = [("x", True, 5, ((0, "forward"),)), ("out", False, 7, ((1, "forward"),)), ("u", True, 2, ())]
    timeline, intervals, cycles = _placed(stretches, streams)
    assert timeline.makespan == cycles
    assert all(a.end == b.start for a, b in zip(intervals, intervals[1:]))


def test_another_ipus_work_goes_on_while_an_output_streams_out():
    stretches = [_stage(0, 0, 100), _stage(1, 1, 100)]
    timeline, intervals, cycles = _placed(stretches, [("early", False, 7, ((0, "forward"),))])
    early = next(i for i in intervals if i.label.get("tensor") == "early")
    second = next(i for i in intervals if i.label.get("stage") == 1)
    assert early.resources == (popsim.compute_lane(0, 0), popsim.transfer_lane(0, 0, HOST_TRANSFER))
    assert second.start == early.start < early.end
    assert timeline.makespan == cycles - 7
    assert intervals[-1].start >= early.end  # the run ends after its streams
