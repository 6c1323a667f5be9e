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
