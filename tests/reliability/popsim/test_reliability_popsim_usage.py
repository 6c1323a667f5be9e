"""Catalogue (popsim, no torch): bad feeds, variables, targets and settings are popsim.Errors naming the cause,
and the executable still runs right afterwards."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops

error = pytest.mark.outcome("clear error")
TARGET = popsim.Target.small(num_tiles=4)
X = np.arange(6, dtype=np.float32).reshape(2, 3)


def _graph(name="g", w_shape=(2, 3)):
    g = popir.Graph(name)
    x = g.add_input("x", (2, 3), "float32")
    w = g.add_input("w", w_shape, "float32", kind="parameter")
    g.output("y", x * ops.reshape(w, shape=(2, 3)))
    return g


@pytest.fixture(scope="module")
def exe():
    exe = popsim.compile(_graph(), TARGET)
    exe.write_variable("w", np.full((2, 3), 2.0, np.float32))
    return exe


def _still_runs(exe):
    np.testing.assert_array_equal(exe.run({"x": X})["y"], 2 * X)
    np.testing.assert_array_equal(exe.read_variable("w"), np.full((2, 3), 2.0, np.float32))


BAD_RUNS = {
    "no_feeds": ({}, None, r"feeds: missing \['x'\], unknown \[\]"),
    "unknown_feed": ({"x": X, "q": X}, None, r"missing \[\], unknown \['q'\]"),
    "wrong_shape": ({"x": X.T}, None, r"feed 'x': expected shape \(2, 3\), got \(3, 2\)"),
    "string_feed": ({"x": "abc"}, None, "feed 'x': expected an array of numbers, got str"),
    "none_feed": ({"x": None}, None, "feed 'x': expected an array of numbers, got NoneType"),
    "object_feed": ({"x": np.full((2, 3), object())}, None, "feed 'x': expected an array of numbers"),
    "unknown_program": ({"x": X}, "nope", "no program 'nope'; compiled programs: g"),
}


@error
@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_run(exe, case):
    feeds, program, message = BAD_RUNS[case]
    with pytest.raises(popsim.Error, match=message):
        exe.run(feeds, program=program)
    _still_runs(exe)


BAD_VARIABLE_USE = {
    "read_unknown": (lambda e: e.read_variable("nope"), "no variable 'nope'; variables: w"),
    "write_unknown": (lambda e: e.write_variable("nope", 1), "no variable 'nope'"),
    "write_wrong_shape": (lambda e: e.write_variable("w", np.ones(3)), r"variable 'w' has shape \(2, 3\), got \(3,\)"),
    "write_string": (lambda e: e.write_variable("w", "abc"), "variable 'w': expected an array of numbers"),
}


@error
@pytest.mark.parametrize("case", sorted(BAD_VARIABLE_USE))
def test_bad_variable_use(exe, case):
    action, message = BAD_VARIABLE_USE[case]
    with pytest.raises(popsim.Error, match=message):
        action(exe)
    _still_runs(exe)


BAD_COMPILES = {
    "unknown_target": (lambda: popsim.compile(_graph(), "ipu9"), "unknown target 'ipu9'"),
    "no_graphs": (lambda: popsim.compile({}, TARGET), "compile needs at least one graph"),
    "bad_partials": (lambda: popsim.compile(_graph(), TARGET, partials_type="int8"), "partials_type must be"),
    "device_of_no_ipus": (lambda: popsim.Device(popsim.Target.ipu2(), 0), "a Device needs at least one IPU"),
    "device_of_a_device": (
        lambda: popsim.Device(popsim.Device(popsim.Target.ipu2(), 2).graph_target, 2),
        "a Device is built from a one-IPU target",
    ),
    "variable_of_two_shapes": (
        lambda: popsim.compile({"a": _graph("a"), "b": _graph("b", (6,))}, TARGET),
        r"variable 'w' is float32\[2, 3\] in one program and float32\[6\] in another",
    ),
    "tiny_tiles": (
        lambda: popsim.compile(_graph(), popsim.Target.small(num_tiles=1, tile_bytes=16)),
        "needs at least 48 bytes of tile memory",
    ),
}


@error
@pytest.mark.parametrize("case", sorted(BAD_COMPILES))
def test_bad_compile(case):
    action, message = BAD_COMPILES[case]
    with pytest.raises(popsim.Error, match=message):
        action()


@error
@pytest.mark.parametrize("value", ["0", "zero", "-2"])
def test_bad_thread_count(monkeypatch, value):
    monkeypatch.setenv("POPSIM_NUM_THREADS", value)
    with pytest.raises(popsim.Error, match="POPSIM_NUM_THREADS must be a positive integer"):
        popsim.compile(_graph(), TARGET)


@error
def test_gather_index_out_of_range_counts_the_bad_indices():
    g = popir.Graph("g")
    x = g.add_input("x", (4,), "float32")
    i = g.add_input("i", (3,), "int32")
    g.output("y", ops.gather(x, i, axis=0))
    exe = popsim.compile(g, TARGET)
    with pytest.raises(popsim.Error, match="2 gather/scatter index"):
        exe.run({"x": np.arange(4, dtype=np.float32), "i": np.array([1, 9, -9], np.int32)})
    out = exe.run({"x": np.arange(4, dtype=np.float32), "i": np.array([3, 0, -1], np.int32)})["y"]
    np.testing.assert_array_equal(out, [3, 0, 3])


@error
def test_arena_views_are_bounds_checked():
    arena = popsim.TileArena(2, 64)
    with pytest.raises(IndexError, match="tile 5 is not in 0..1"):
        arena.view(5, 0, 1)
    with pytest.raises(IndexError, match=r"bytes \[60, 70\) are outside tile 1's 64 bytes"):
        arena.view(1, 60, 10)
