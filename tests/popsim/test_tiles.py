"""Tile placement is real: vertices touch only their own tile, wrong mappings are rejected, memory is per tile."""

import numpy as np
import pytest

import popir
import popsim
from popir import DType, ops
from popsim import _opcodes as oc
from popsim.planner import Lowerer


def _graph_with_tensor(target, mapping):
    dg = popsim.DeviceGraph(target)
    t = dg.add_tensor((64,), DType.float32, mapping, "t")
    return dg, t


def test_vertex_field_on_another_tile_is_rejected():
    target = popsim.Target.small(num_tiles=4)
    dg, t = _graph_with_tensor(target, popsim.TileMapping.on_tiles([32, 32], [0, 1]))
    out = dg.add_tensor((32,), DType.float32, popsim.TileMapping.on_tiles([32], [0]), "out")
    cs = dg.add_compute_set("neg")
    dg.add_vertex(cs, oc.UNARY, oc.UNARY_OPS["neg"], 0, 32, {"a": t.region(0, 32), "out": out.region(0, 32)}, 1)
    with pytest.raises(popsim.Error, match="field 'a'.*lives on tile 1"):
        dg.add_vertex(cs, oc.UNARY, oc.UNARY_OPS["neg"], 0, 32, {"a": t.region(32, 64), "out": out.region(0, 32)}, 1)
    with pytest.raises(popsim.Error, match="span tiles \\[0, 1\\]"):
        dg.add_vertex(cs, oc.UNARY, oc.UNARY_OPS["neg"], 0, 32, {"a": t.region(16, 48), "out": out.region(0, 32)}, 1)


def test_bad_mappings_are_rejected():
    target = popsim.Target.small(num_tiles=4)
    with pytest.raises(popsim.Error, match="cover"):
        popsim.TileMapping([0, 1], [0, 40], [32, 64], 64)
    with pytest.raises(popsim.Error, match="outside 0..3"):
        _graph_with_tensor(target, popsim.TileMapping.on_tiles([64], [7]))


def test_linear_mapping_uses_whole_grains_of_at_least_128_bytes():
    target = popsim.Target.ipu2()
    small = popsim.TileMapping.linear(10, 4, target)
    assert small.num_tiles_used == 1
    big = popsim.TileMapping.linear(1472 * 100, 4, target)
    sizes = big.stops - big.starts
    assert big.num_tiles_used == len(sizes) and sizes.max() * 4 >= 128 and sizes[:-1].min() % 32 == 0


def test_every_tensor_byte_lives_in_its_tiles_range_of_the_arena():
    g = popir.Graph("g")
    x = g.add_input("x", (40, 50), "float32")
    g.output("y", ops.exp(x) + 1.0)
    exe = popsim.compile(g, popsim.Target.small(num_tiles=8, tile_bytes=65536))
    xv = np.random.default_rng(0).standard_normal((40, 50)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})["y"], np.exp(xv) + 1, rtol=1e-6)
    # Zero one tile's memory: reading the output back from the tiles changes exactly the elements it holds.
    (flat, _, outs, _, outputs) = exe._programs["g"]
    host_off, arena_off, nbytes = outs["y"]
    tile = int(arena_off[0] // exe.arena.tile_bytes)
    exe.arena.buffer[tile * exe.arena.tile_bytes : (tile + 1) * exe.arena.tile_bytes] = 0
    y = exe._read(outputs["y"], outs["y"])
    zeroed = np.flatnonzero(y.reshape(-1) == 0)
    owner = outputs["y"].mapping
    held = np.concatenate([np.arange(a, b) for t, a, b in zip(owner.tiles, owner.starts, owner.stops) if t == tile])
    assert np.array_equal(zeroed, held)


def test_out_of_memory_names_tile_and_tensors_and_relax_compiles():
    g = popir.Graph("big")
    x = g.add_input("x", (64, 1024), "float32")
    w = g.add_input("w", (1024, 1024), "float32", kind="parameter")
    g.output("y", x @ w)
    # Room for w and x in all (a smaller target is refused from sizes alone, before planning), but not for the
    # matmul's partials on each tile.
    target = popsim.Target.small(num_tiles=18, tile_bytes=256 * 1024)
    with pytest.raises(
        popsim.OutOfMemoryError, match=r"out of memory on tile \d+: \d+ bytes needed, \d+ available.* w "
    ):
        popsim.compile(g, target)
    exe = popsim.compile(g, target, relax_memory=True)
    prof = exe.profile.programs["big"]
    assert prof["relax_memory"] and prof["tiles_over_budget"]
    assert "over budget" in exe.profile.summary()
    xv = np.ones((64, 1024), np.float32)
    exe.write_variable("w", np.full((1024, 1024), 0.5, np.float32))
    np.testing.assert_allclose(exe.run({"x": xv})["y"], np.full((64, 1024), 512.0))


def test_elementwise_updates_write_their_variable_in_place_unless_the_old_value_is_still_needed():
    g = popir.Graph("sgd")
    w = g.add_input("w", (300,), "float32", kind="parameter")
    m = g.add_input("m", (300,), "float32", kind="optimizer_state")
    prev = g.add_input("prev", (300,), "float32", kind="buffer")
    grad = g.add_input("grad", (300,), "float32")
    new_m = m * 0.9 + grad
    g.update(m, new_m)
    g.update(w, w - new_m * 0.1)
    g.update(prev, w)  # prev takes the old w after every node has run: w cannot be overwritten early
    g.output("old_m_doubled", m * 2.0)  # a node after new_m reads the old m: m cannot be either
    exe = popsim.compile(g, "small")
    names = " ".join(step["name"] for step in exe.profile.programs["sgd"]["steps"])
    assert "update w" in names and "update m" in names and "update prev" in names
    values = {"w": np.arange(300, dtype=np.float32), "m": np.ones(300, np.float32), "prev": np.zeros(300, np.float32)}
    feeds = {"grad": np.full(300, 0.5, np.float32)}
    for name, value in values.items():
        exe.write_variable(name, value)
    outputs, updates = popir.interpreter.step(g, {**values, **feeds})
    np.testing.assert_array_equal(exe.run(feeds)["old_m_doubled"], outputs["old_m_doubled"])
    for name, value in updates.items():
        np.testing.assert_array_equal(exe.read_variable(name), value)

    # Alone, the same update of w is written in place, with no copy into the variable.
    g2 = popir.Graph("sgd")
    w = g2.add_input("w", (300,), "float32", kind="parameter")
    g2.update(w, w - g2.add_input("grad", (300,), "float32") * 0.1)
    exe = popsim.compile(g2, "small")
    assert not any(s["name"].startswith("update") for s in exe.profile.programs["sgd"]["steps"])
    exe.write_variable("w", values["w"])
    exe.run(feeds)
    np.testing.assert_array_equal(exe.read_variable("w"), values["w"] - np.float32(0.5) * np.float32(0.1))


def test_a_state_reset_to_one_repeated_value_is_written_in_place_unless_it_reads_the_state():
    # A gradient accumulator's reset: the scalar's broadcast goes straight into the variable, with no buffer.
    # Two accumulators of one shape share the zeros (CSE): each is filled, neither copied from the other.
    g = popir.Graph("reset")
    accs = [g.add_input(f"acc{i}", (8, 300), "float32", kind="optimizer_state") for i in range(2)]
    g.output("sum", ops.reduce_sum(accs[0] + accs[1], axes=(0,), keepdims=False))
    zeros = ops.broadcast_to(g.constant(np.float32(0.0)), shape=(8, 300))
    for acc in accs:
        g.update(acc, zeros)
    exe = popsim.compile(g, "small", optimize=False)  # as given: folding would make the zeros one constant
    assert not any(s["name"].startswith(("update", "stage")) for s in exe.profile.programs["reset"]["steps"])
    assert max(exe.profile.programs["reset"]["memory_by_category"].get("temporaries", [0])) < 8 * 300 * 4
    for i in range(2):
        exe.write_variable(f"acc{i}", np.ones((8, 300), np.float32))
    np.testing.assert_array_equal(exe.run({})["sum"], np.full(300, 16.0, np.float32))
    for i in range(2):
        np.testing.assert_array_equal(exe.read_variable(f"acc{i}"), np.zeros((8, 300), np.float32))

    # Folded into a constant of one repeated value, the reset moves that value from a scalar: no tensor of
    # constants; a constant of several values (-0.0 is not 0.0) is still written whole.
    for value in (np.float32(0.0), np.float32(-0.0)):
        for fill in (np.full((8, 300), value, np.float32), np.concatenate([np.zeros(300), [value] * 2100])):
            g3 = popir.Graph("fill")
            acc = g3.add_input("acc", (8, 300), "float32", kind="optimizer_state")
            g3.update(acc, g3.constant(fill.astype(np.float32).reshape(8, 300)))
            exe = popsim.compile(g3, "small", optimize=False)
            constants = sum(exe.profile.programs["fill"]["memory_by_category"].get("constants", [0]))
            assert (constants < 8 * 300 * 4) == bool(np.all(np.signbit(fill) == np.signbit(value)))
            exe.write_variable("acc", np.ones((8, 300), np.float32))
            exe.run({})
            got = exe.read_variable("acc")
            np.testing.assert_array_equal(got, fill.reshape(8, 300))
            np.testing.assert_array_equal(np.signbit(got), np.signbit(fill.reshape(8, 300)))

    # A broadcast of the state's own first row moves its elements about: it needs a buffer of its own.
    g2 = popir.Graph("spread")
    state = g2.add_input("state", (8, 300), "float32", kind="optimizer_state")
    g2.update(state, ops.broadcast_to(ops.slice(state, starts=(0, 0), stops=(1, 300)), shape=(8, 300)))
    exe = popsim.compile(g2, "small", optimize=False)
    start = np.arange(8 * 300, dtype=np.float32).reshape(8, 300)
    exe.write_variable("state", start)
    exe.run({})
    np.testing.assert_array_equal(exe.read_variable("state"), np.broadcast_to(start[:1], (8, 300)))


@pytest.mark.parametrize("view", ["reshape", "stop_gradient", "reduce_sum_of_one"])
def test_a_view_of_a_state_read_after_its_update_keeps_the_old_value(view):
    # A reshape (or any lowering that hands back its input) shares the variable's memory: an output or a later
    # read of it must see the value before the step, so the update cannot overwrite the variable early.
    g = popir.Graph("view")
    w = g.add_input("w", (1,), "float32", kind="parameter")
    seen = {
        "reshape": lambda: ops.reshape(w, shape=()),
        "stop_gradient": lambda: ops.stop_gradient(w),
        "reduce_sum_of_one": lambda: ops.reduce_sum(w, axes=(0,), keepdims=False),
    }[view]()
    g.output("seen", seen)
    g.update(w, w - w * 0.02)
    exe = popsim.compile(g, "small")
    exe.write_variable("w", np.array([0.5], np.float32))
    outputs, updates = popir.interpreter.step(g, {"w": np.array([0.5], np.float32)})
    np.testing.assert_array_equal(exe.run({})["seen"], outputs["seen"])
    np.testing.assert_array_equal(exe.read_variable("w"), updates["w"])


def test_programs_share_variables_by_name():
    train = popir.Graph("train")
    w = train.add_input("w", (300,), "float32", kind="parameter")
    train.update(w, w + 1.0)
    infer = popir.Graph("infer")
    w2 = infer.add_input("w", (300,), "float32", kind="parameter")
    infer.output("y", w2 * 2.0)
    exe = popsim.compile({"train": train, "infer": infer}, "small")
    exe.write_variable("w", np.arange(300, dtype=np.float32))
    exe.run(program="train")
    exe.run(program="train")
    np.testing.assert_array_equal(exe.run(program="infer")["y"], (np.arange(300) + 2.0) * 2)
    with pytest.raises(popsim.Error, match="name one"):
        exe.run()
    bad = popir.Graph("bad")
    bad.add_input("w", (3,), "float32", kind="parameter")
    with pytest.raises(popsim.Error, match="variable 'w'"):
        popsim.compile({"train": train, "bad": bad}, "small")


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_scalar_operands_reach_each_tile_once_and_vertices_broadcast_them(dtype):
    g = popir.Graph("scalars")
    x = g.add_input("x", (40, 30), dtype)
    s = g.add_input("s", (), dtype)
    flag = g.add_input("flag", (), "bool")
    g.output("x_times_s", x * s)
    g.output("s_minus_x", s - x)
    g.output("s_max_x", ops.maximum(s, x))
    g.output("pick_s", ops.where(ops.gt(x, s), x, s))
    g.output("pick_by_flag", ops.where(flag, x, s))
    exe = popsim.compile(g, popsim.Target.small(num_tiles=8, tile_bytes=65536))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.integers(-9, 9, (40, 30)).astype(dtype), "s": np.array(3, dtype), "flag": np.array(False)}
    got, want = exe.run(feeds), popir.interpreter.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    steps = exe.profile.programs["scalars"]["steps"]
    scalar_steps = [st for st in steps if set(st["name"].split("+")) == {"broadcast-scalar"}]
    # s and flag each travel once, however many ops read them: later uses find them on their tiles.
    assert len(scalar_steps) == 2
    # Only the scalars travel, a few bytes per tile (a tensor-sized broadcast would be 150 elements per tile).
    assert all(st["busiest_tile_bytes"] <= 8 for st in scalar_steps), scalar_steps

    # A unary vertex broadcasts a scalar operand too (the planner's elementwise takes any size-1 input so).
    dg = popsim.DeviceGraph(popsim.Target.small(num_tiles=8, tile_bytes=65536))
    scalar = dg.add_tensor((), DType(dtype), popsim.TileMapping.on_tiles([1], [5]), "s", "input")
    out = Lowerer(dg).elementwise("neg", [scalar], (40, 30), DType(dtype))
    exe = popsim.compile_device_graph(dg, {"s": scalar}, {"out": out})
    np.testing.assert_array_equal(exe.run({"s": np.array(3, dtype)})["out"], np.full((40, 30), -3, dtype))


def test_an_arena_beyond_what_exchange_rows_address_is_a_clear_error(monkeypatch):
    g = popir.Graph("g")
    g.output("y", g.add_input("x", (4096,), "float32") * 2.0)
    monkeypatch.setattr(popsim.executable, "MAX_ARENA_BYTES", 1000)
    with pytest.raises(popsim.Error, match=r"at most 1,000 bytes of tile memory.*busiest tile over 16 tiles"):
        popsim.compile(g, "small")


def test_a_scalar_constant_is_placed_on_each_tile_at_load_time_not_exchanged():
    g = popir.Graph("affine")
    x = g.add_input("x", (40, 30), "float32")
    g.output("y", x * 2.5 + 1.0)
    exe = popsim.compile(g, popsim.Target.small(num_tiles=8, tile_bytes=65536))
    assert not [st for st in exe.profile.programs["affine"]["steps"] if st["kind"] == "exchange"]
    xv = np.random.default_rng(2).standard_normal((40, 30)).astype(np.float32)
    np.testing.assert_array_equal(exe.run({"x": xv})["y"], popir.interpreter.run(g, {"x": xv})["y"])
