"""Hand-built Poplar programs: Repeat, If, Sync, Copy and StreamCopy steps run on the engine, cost what they run, and
keep loop-carried tensors alive."""

import numpy as np
import pytest

import popir
import popsim
from popir import DType
from popsim import _opcodes as oc
from popsim import cost

TARGET = popsim.Target.small(num_tiles=4)
N = 16


def _tensor(dg, name, dtype=DType.float32, category="temporary", value=None, size=N):
    blocks = [size // 2, size - size // 2] if size > 1 else [1]
    mapping = popsim.TileMapping.on_tiles(blocks, list(range(len(blocks))))
    return dg.add_tensor((size,), dtype, mapping, name, category, value)


def _binary(dg, name, op, a, b, out):
    """A compute set with one ``out = a <op> b`` vertex per tile block (operands share one mapping)."""
    cs = popsim.ComputeSet(name)
    m = out.mapping
    for tile, lo, hi in zip(m.tiles.tolist(), m.starts.tolist(), m.stops.tolist()):
        fields = {"a": a.region(lo, hi), "b": b.region(lo, hi), "out": out.region(lo, hi)}
        cycles = cost.elementwise_cycles(TARGET, hi - lo, a.dtype, op)
        dg.add_vertex(cs, oc.BINARY, oc.BINARY_OPS[op], tile, hi - lo, fields, cycles)
    return cs


def _counter_graph():
    """x and the compute sets inc (x += 1) and dbl (x += x), which cost the same."""
    dg = popsim.DeviceGraph(TARGET)
    x = _tensor(dg, "x", category="input")
    one = _tensor(dg, "one", category="constant", value=np.ones(N, np.float32))
    return dg, x, _binary(dg, "inc", "add", x, one, x), _binary(dg, "dbl", "add", x, x, x)


def _run(dg, program, feeds, inputs, outputs):
    dg.program = program
    exe = popsim.compile_device_graph(dg, inputs, outputs)
    return exe, exe.run(feeds)


def _device_cycles(exe):
    return exe.last_run_cycles - exe.profile.programs["main"]["host_cycles"]


X = np.arange(N, dtype=np.float32)


def test_repeat_adds_five_and_charges_five_bodies():
    dg, x, inc, _ = _counter_graph()
    once, out = _run(dg, [inc], {"x": X}, {"x": x}, {"x": x})
    np.testing.assert_array_equal(out["x"], X + 1)
    body = _device_cycles(once)
    assert body == once.profile.programs["main"]["total_cycles"] - once.profile.programs["main"]["host_cycles"]

    exe, out = _run(dg, [popsim.Repeat(5, popsim.Execute(inc))], {"x": X}, {"x": x}, {"x": x})
    np.testing.assert_array_equal(out["x"], X + 5)
    expected = 5 * (body + cost.CONTROL_CYCLES) + cost.CONTROL_CYCLES
    assert _device_cycles(exe) == expected
    prof = exe.profile.programs["main"]
    assert prof["total_cycles"] == exe.last_run_cycles
    assert prof["compute_cycles"] == 5 * once.profile.programs["main"]["compute_cycles"]
    np.testing.assert_array_equal(exe.run({"x": X})["x"], X + 5)  # counters restart on every run


def test_nested_repeat_and_zero_count():
    dg, x, inc, dbl = _counter_graph()
    program = popsim.Sequence([popsim.Repeat(3, [inc, popsim.Repeat(4, inc)]), popsim.Repeat(0, dbl)])
    exe, out = _run(dg, program, {"x": X}, {"x": x}, {"x": x})
    np.testing.assert_array_equal(out["x"], X + 15)
    body = exe.profile.programs["main"]["steps"][0]["cycles"] + TARGET.sync_cycles
    inner = 4 * (body + cost.CONTROL_CYCLES) + cost.CONTROL_CYCLES
    assert _device_cycles(exe) == 3 * (body + inner + cost.CONTROL_CYCLES) + cost.CONTROL_CYCLES


def test_if_on_a_device_computed_condition_takes_one_branch_and_charges_it():
    dg, x, inc, dbl = _counter_graph()
    s = _tensor(dg, "s", size=1, category="input")
    zero = _tensor(dg, "zero", size=1, category="constant", value=np.zeros(1, np.float32))
    flag = _tensor(dg, "flag", DType.bool, size=1)
    test = _binary(dg, "positive", "gt", s, zero, flag)
    dg.program = [test, popsim.If(flag, inc, [dbl, dbl])]
    exe = popsim.compile_device_graph(dg, {"x": x, "s": s}, {"x": x})
    np.testing.assert_array_equal(exe.run({"x": X, "s": np.array([2.0], np.float32)})["x"], X + 1)
    then_cycles = _device_cycles(exe)
    np.testing.assert_array_equal(exe.run({"x": X, "s": np.array([-2.0], np.float32)})["x"], 4 * X)
    else_cycles = _device_cycles(exe)

    steps = {s["name"]: s["cycles"] + TARGET.sync_cycles for s in exe.profile.programs["main"]["steps"]}
    decide = steps["positive"] + cost.branch_cycles(TARGET)
    assert then_cycles == decide + steps["inc"] + cost.CONTROL_CYCLES
    assert else_cycles == decide + 2 * steps["dbl"]
    assert then_cycles < else_cycles
    # The static figure is the worst case: the costlier branch.
    prof = exe.profile.programs["main"]
    assert prof["total_cycles"] - prof["host_cycles"] == else_cycles


def test_if_inside_a_repeat_reads_its_condition_on_every_iteration():
    dg, x, inc, _ = _counter_graph()
    limit = _tensor(dg, "limit", size=1, category="constant", value=np.array([2.5], np.float32))
    flag = _tensor(dg, "flag", DType.bool, size=1)
    test = popsim.ComputeSet("below")
    fields = {"a": x.region(0, 1), "b": limit.region(0, 1), "out": flag.region(0, 1)}
    dg.add_vertex(test, oc.BINARY, oc.BINARY_OPS["lt"], 0, 1, fields, cost.elementwise_cycles(TARGET, 1, x.dtype, "lt"))
    exe, out = _run(dg, [popsim.Repeat(4, [test, popsim.If(flag, inc)])], {"x": X}, {"x": x}, {"x": x})
    # x[0] goes 0 -> 1 -> 2 -> 3, and the fourth test finds it no longer below 2.5.
    np.testing.assert_array_equal(out["x"], X + 3)
    steps = {s["name"]: s["cycles"] + TARGET.sync_cycles for s in exe.profile.programs["main"]["steps"]}
    per_iteration = steps["below"] + cost.branch_cycles(TARGET) + cost.CONTROL_CYCLES
    assert _device_cycles(exe) == 4 * per_iteration + 3 * steps["inc"] + cost.CONTROL_CYCLES
    prof = exe.profile.programs["main"]
    assert prof["total_cycles"] - prof["host_cycles"] == _device_cycles(exe) + steps["inc"]


@pytest.mark.parametrize("value,expected", [(0, X), (256, X + 1), (-1, X + 1)])
def test_if_without_else_on_an_int32_condition(value, expected):
    dg, x, inc, _ = _counter_graph()
    n = _tensor(dg, "n", DType.int32, size=1, category="input")
    _, out = _run(dg, [popsim.If(n, inc)], {"x": X, "n": np.array([value], np.int32)}, {"x": x, "n": n}, {"x": x})
    np.testing.assert_array_equal(out["x"], expected)


def test_sync_adds_the_sync_cycles_and_moves_no_data():
    dg, x, inc, _ = _counter_graph()
    plain, out = _run(dg, [inc, inc], {"x": X}, {"x": x}, {"x": x})
    synced, out_synced = _run(dg, [inc, popsim.Sync(), inc], {"x": X}, {"x": x}, {"x": x})
    np.testing.assert_array_equal(out_synced["x"], out["x"])
    assert synced.last_run_cycles - plain.last_run_cycles == TARGET.sync_cycles
    p, s = plain.profile.programs["main"], synced.profile.programs["main"]
    assert s["sync_cycles"] - p["sync_cycles"] == TARGET.sync_cycles
    assert s["total_cycles"] == synced.last_run_cycles


def test_a_tensor_carried_across_loop_iterations_keeps_its_memory():
    # carry is written late in the body and read early in the next iteration; other is used only after
    # carry's last use in program order, so liveness that ignores the loop would give it carry's bytes.
    dg, x, _, _ = _counter_graph()
    out = _tensor(dg, "out", category="input")
    one = next(t for t in dg.tensors if t.name == "one")
    carry = _tensor(dg, "carry")
    other = _tensor(dg, "other")
    body = [
        _binary(dg, "acc_carry", "add", out, carry, out),
        _binary(dg, "step", "add", carry, one, carry),
        _binary(dg, "twice", "add", x, x, other),
        _binary(dg, "acc_other", "add", out, other, out),
    ]
    program = [popsim.Copy("init", carry, [x], np.arange(N)), popsim.Repeat(3, body)]
    feeds = {"x": X, "out": np.zeros(N, np.float32)}
    exe, result = _run(dg, program, feeds, {"x": x, "out": out}, {"out": out})
    # sum over k of (x + k) for k = 0..2, plus 3 * 2x.
    np.testing.assert_array_equal(result["out"], 9 * X + 3)
    carry_at = exe._block_base[carry.id]
    other_at = exe._block_base[other.id]
    assert not set(carry_at.tolist()) & set(other_at.tolist())


def test_bad_control_steps_are_rejected():
    dg, x, inc, _ = _counter_graph()
    with pytest.raises(popsim.Error, match="one bool or int32 element"):
        popsim.If(x, inc)
    with pytest.raises(popsim.Error, match="non-negative"):
        popsim.Repeat(-1, inc)
    dg.program = [popsim.Repeat(2, [inc, x])]
    with pytest.raises(popsim.Error, match="not a program step"):
        popsim.compile_device_graph(dg, {"x": x}, {"x": x})


def _stream_loop(x, inc, iterations):
    """Each iteration streams a fresh slice into x, adds one on the device and streams x back out."""
    return [popsim.Repeat(iterations, [popsim.StreamCopy("in", x), inc, popsim.StreamCopy("out", x, to_device=False)])]


def test_stream_copies_inside_a_repeat_move_one_slice_per_iteration():
    dg, x, inc, _ = _counter_graph()
    dg.program = _stream_loop(x, inc, 3)
    exe = popsim.compile_device_graph(dg)
    slices = np.arange(3 * N, dtype=np.float32).reshape(3, N) * 10
    out = exe.run({"in": slices})
    np.testing.assert_array_equal(out["out"], slices + 1)

    steps = {s["name"]: s["cycles"] for s in exe.profile.programs["main"]["steps"]}
    stream = cost.host_cycles(TARGET, N * 4)
    assert steps["stream-in in"] == steps["stream-out out"] == stream
    per_iteration = 2 * (stream + TARGET.sync_cycles) + steps["inc"] + TARGET.sync_cycles + cost.CONTROL_CYCLES
    assert exe.last_run_cycles == 3 * per_iteration + cost.CONTROL_CYCLES
    prof = exe.profile.programs["main"]
    assert prof["host_cycles"] == 6 * stream
    assert prof["total_cycles"] == exe.last_run_cycles


def test_a_device_to_host_stream_returns_only_the_slices_that_ran():
    dg, x, inc, _ = _counter_graph()
    n = _tensor(dg, "n", DType.int32, size=1, category="input")
    dg.program = [inc, popsim.If(n, popsim.StreamCopy("out", x, to_device=False))]
    exe = popsim.compile_device_graph(dg, {"x": x, "n": n})
    taken = exe.run({"x": X, "n": np.array([1], np.int32)})["out"]
    np.testing.assert_array_equal(taken, (X + 1)[None])
    assert exe.run({"x": X, "n": np.array([0], np.int32)})["out"].shape == (0, N)


def test_stream_errors_name_the_stream():
    dg, x, inc, _ = _counter_graph()
    dg.program = _stream_loop(x, inc, 3)
    exe = popsim.compile_device_graph(dg)
    with pytest.raises(popsim.Error, match="host stream 'in' ran dry after 2 slice"):
        exe.run({"in": np.zeros((2, N), np.float32)})
    with pytest.raises(popsim.Error, match="slices of shape"):
        exe.run({"in": np.zeros(N, np.float32)})
    with pytest.raises(popsim.Error, match=r"missing \['in'\]"):
        exe.run({})

    y = _tensor(dg, "y", DType.int32)
    dg.program = [popsim.StreamCopy("in", x), popsim.StreamCopy("in", y)]
    with pytest.raises(popsim.Error, match="'in' is used as host-to-device float32"):
        popsim.compile_device_graph(dg)
    dg.program = [popsim.StreamCopy("x", x)]
    with pytest.raises(popsim.Error, match="names both a host stream and an input"):
        popsim.compile_device_graph(dg, {"x": x})


def test_a_host_call_inside_a_repeat_pauses_the_engine_each_iteration_and_resumes_the_loop():
    calls = []

    def square_plus_one(values):
        calls.append(values.copy())
        return values * values + 1

    popir.ops.register_host_callback("test.square_plus_one", square_plus_one)
    dg, x, inc, _ = _counter_graph()
    y = _tensor(dg, "y")
    call = popsim.HostCall("sq", "test.square_plus_one", [x], [y])
    copy_back = popsim.Copy("y to x", x, [y], np.arange(N))
    exe, out = _run(dg, [popsim.Repeat(2, [inc, call, copy_back])], {"x": X}, {"x": x}, {"x": x})
    once = (X + 1) ** 2 + 1
    np.testing.assert_array_equal(out["x"], (once + 1) ** 2 + 1)
    assert len(calls) == 2
    np.testing.assert_array_equal(calls[1], once + 1)
    # Each call streams x out and y in (two host transfers of N floats per iteration, charged as such), and
    # the tiles wait while the host runs the callback on N elements into N (the host model, not a timing).
    prof = exe.profile.programs["main"]
    callback = cost.host_callback_cycles(TARGET, 2 * N)
    assert callback > cost.host_callback_cycles(TARGET, N) > 0
    transfers = 2 * 2 * cost.host_cycles(TARGET, N * 4)
    assert prof["host_cycles"] == transfers + 2 * callback + cost.host_cycles(TARGET, 2 * N * 4)
    step = next(s for s in prof["steps"] if s["name"] == "host-call test.square_plus_one")
    assert step["cycles"] == callback and step["transfer"] == "host callback"


def test_a_host_call_that_raises_stops_the_run():
    def broken(values):
        raise RuntimeError("disk full")

    popir.ops.register_host_callback("test.broken", broken)
    dg, x, _, _ = _counter_graph()
    y = _tensor(dg, "y")
    dg.program = [popsim.HostCall("broken", "test.broken", [x], [y])]
    exe = popsim.compile_device_graph(dg, {"x": x}, {"y": y})
    with pytest.raises(popsim.HostCallbackError, match="host callback 'test.broken' raised RuntimeError: disk full"):
        exe.run({"x": X})
    with pytest.raises(popsim.Error, match=r"\['broken.out0'\] are host-call streams"):
        exe.run({"x": X, "broken.out0": np.zeros((1, N), np.float32)})
    exe.host_callbacks = {"test.broken": lambda values: values - 1}  # the executable's own function wins
    np.testing.assert_array_equal(exe.run({"x": X})["y"], X - 1)
