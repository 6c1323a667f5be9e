"""A scalar that is not a constant (a variable hyper-parameter such as a learning rate, or a computed scalar)
reaches each tile once per program: its first use as an elementwise operand exchanges it to every tile of
the IPU and later uses read the copy on their own tile, so each parameter's update needs no exchange of its
own; the results stay exact, and a value written between runs is what the next run uses."""

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


def test_a_variable_and_a_computed_scalar_are_exchanged_once_each_and_results_are_exact():
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
    assert copies.count("broadcast-scalar") == 2
