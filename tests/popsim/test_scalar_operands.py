"""A computed scalar, or a scalar variable a program updates, reaches each tile once per program: its first
use as an elementwise operand exchanges it to every tile of the IPU and later uses read the copy on their own
tile, so each parameter's update needs no exchange of its own. A scalar variable only the host writes (an
optimizer hyper-parameter such as a learning rate) has its copies on the tiles written at load and with each
host write, so no run exchanges it. The results stay exact, and a value written between runs is what the next
run uses."""

import numpy as np

import popir
import popsim

SMALL = popsim.Target.small(num_tiles=8, tile_bytes=65536)
SHAPES = [(40, 30), (7,), (3, 5)]  # parameters on different tiles


def _updates():
    """Each parameter minus lr times its gradient, and a computed scalar (lr * 2) read by every update."""
    g = popir.Graph("updates")
    lr = g.add_input("lr", (), "float32", kind="optimizer_state")
    twice = lr * 2.0
    for i, shape in enumerate(SHAPES):
        p = g.add_input(f"p{i}", shape, "float32")
        grad = g.add_input(f"g{i}", shape, "float32")
        g.output(f"new{i}", p - grad * lr)
        g.output(f"other{i}", grad * twice)
    return g


def _feeds():
    rng = np.random.default_rng(0)
    feeds = {}
    for i, shape in enumerate(SHAPES):
        feeds[f"p{i}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"g{i}"] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _exchanges(exe, program):
    return [s["name"] for s in exe.profile.programs[program]["steps"] if s["kind"] == "exchange"]


def test_a_computed_scalar_is_exchanged_once_a_host_written_variable_never_and_results_are_exact():
    g = _updates()
    exe = popsim.compile(g, SMALL)
    feeds = _feeds()
    for lr in (0.25, 0.125):  # a new value written between runs is used by every update
        exe.write_variable("lr", np.array(lr, np.float32))
        got = exe.run(feeds)
        want = popir.interpreter.run(g, {**feeds, "lr": np.array(lr, np.float32)})
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    copies = [name for step in _exchanges(exe, "updates") for name in step.split("+")]
    assert copies.count("broadcast-scalar") == 1  # lr * 2; lr itself is on every tile from the host writes


def _scaled(kind):
    """x * s for an x spread over every tile of SMALL, s a scalar variable of ``kind``."""
    g = popir.Graph("scaled")
    s = g.add_input("s", (), "float32", kind=kind)
    x = g.add_input("x", (8, 2048), "float32")
    g.output("y", x * s)
    return g, s


def test_writing_a_host_written_scalar_updates_its_copy_on_every_tile_also_after_reloading():
    g, _ = _scaled("optimizer_state")
    exe = popsim.compile(g, SMALL)
    profile = exe.profile.programs["scaled"]
    assert not [s for s in profile["steps"] if s["kind"] == "exchange"]
    output_tiles = {
        run[0] + i
        for t in profile["tensors"]
        if t["category"] == "activations"
        for run in t["tile_runs"]
        for i in range(run[1])
    }
    assert output_tiles == set(range(SMALL.num_tiles))  # every tile reads its own copy of s
    # The copies are resident tile memory, one per tile.
    copies = [t for t in profile["tensors"] if t["name"].startswith("s on tiles")]
    assert [c["tile_runs"] for c in copies] == [[[0, SMALL.num_tiles, 4]]]
    x = np.random.default_rng(2).standard_normal((8, 2048)).astype(np.float32)
    for value in (0.5, -3.0):  # every tile's copy follows each host write
        exe.write_variable("s", np.array(value, np.float32))
        np.testing.assert_array_equal(exe.run({"x": x})["y"], x * np.float32(value))
    reloaded = popsim.Executable.from_bytes(exe.to_bytes())
    np.testing.assert_array_equal(reloaded.run({"x": x})["y"], x * np.float32(-3.0))
    reloaded.write_variable("s", np.array(7.0, np.float32))
    np.testing.assert_array_equal(reloaded.run({"x": x})["y"], x * np.float32(7.0))


def test_a_scalar_variable_a_program_updates_is_exchanged_in_each_run():
    g, s = _scaled("optimizer_state")
    g.update(s, s + 1.0)  # a step counter: the program writes it, so its copies cannot be placed at load
    exe = popsim.compile(g, SMALL)
    x = np.random.default_rng(3).standard_normal((8, 2048)).astype(np.float32)
    exe.write_variable("s", np.array(2.0, np.float32))
    for step in (2.0, 3.0, 4.0):
        np.testing.assert_array_equal(exe.run({"x": x})["y"], x * np.float32(step))
    assert "broadcast-scalar" in _exchanges(exe, "scaled")


def test_a_host_written_scalar_read_on_two_ipus_is_written_to_both_and_never_crosses():
    g = popir.Graph("two")
    s = g.add_input("s", (), "float32", kind="optimizer_state")
    with g.placed((0, 0)):
        a = g.add_input("a", (8, 2048), "float32") * s
    with g.placed((1, 1)):
        g.output("y", a - s)
    exe = popsim.compile(g, popsim.Device(SMALL, 2))
    names = _exchanges(exe, "two")
    assert not [n for n in names if "broadcast-scalar" in n]
    assert len([n for n in names if "inter-ipu" in n]) == 1  # the activation a, not s
    a = np.random.default_rng(4).standard_normal((8, 2048)).astype(np.float32)
    for value in (0.5, -3.0):
        exe.write_variable("s", np.array(value, np.float32))
        want = popir.interpreter.run(g, {"a": a, "s": np.array(value, np.float32)})["y"]
        np.testing.assert_array_equal(exe.run({"a": a})["y"], want)


def test_a_host_written_scalar_has_copies_only_on_the_tiles_that_read_it():
    """Each tile whose vertices read a hyper-parameter holds one copy; the others hold none, and a host
    write costs the bytes of the variable and of those copies only."""
    g = popir.Graph("narrow")
    s = g.add_input("s", (), "float32", kind="optimizer_state")
    x = g.add_input("x", (2, 32), "float32")  # on 2 of the 8 tiles of SMALL
    g.output("y", x * s)
    exe = popsim.compile(g, SMALL)
    profile = exe.profile.programs["narrow"]
    tiles_of = {t["name"]: {run[0] + i for run in t["tile_runs"] for i in range(run[1])} for t in profile["tensors"]}
    (copy,) = [name for name in tiles_of if name.startswith("s on tiles")]
    (output,) = [t["name"] for t in profile["tensors"] if t["category"] == "activations"]
    assert tiles_of[copy] == tiles_of[output] and len(tiles_of[copy]) < SMALL.num_tiles
    x = np.random.default_rng(5).standard_normal((2, 32)).astype(np.float32)
    for value in (0.5, -3.0):
        exe.write_variable("s", np.array(value, np.float32))
        np.testing.assert_array_equal(exe.run({"x": x})["y"], x * np.float32(value))
    written = 4 * (1 + len(tiles_of[copy]))  # the variable and its copies
    assert exe.last_write_cycles == exe.write_cycles("s") == popsim.cost.host_cycles(SMALL, written) > 0
    reloaded = popsim.Executable.from_bytes(exe.to_bytes())
    reloaded.write_variable("s", np.array(7.0, np.float32))
    np.testing.assert_array_equal(reloaded.run({"x": x})["y"], x * np.float32(7.0))
