"""Convolution dithering: each convolution's tiles start at a column and run in a direction hashed from its
shape (the same for its forward and gradient passes), which spreads small convolutions' temporaries over
different tiles without changing any number."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import conv_plan
from popsim.planner import Lowerer

IPU = popsim.Target.ipu2()


def _convs(chans, hw=8, grad=False):
    """Padded 3x3 convs with relu from ``chans[0]`` through each of ``chans[1:]`` channels (and the input's
    gradient when ``grad``), with small-integer feeds and weights."""
    g = popir.Graph("convs")
    h = x = g.add_input("x", (2, chans[0], hw, hw), "float32")
    weights = []
    for i, (c, o) in enumerate(zip(chans, chans[1:])):
        weights.append(g.add_input(f"w{i}", (o, c, 3, 3), "float32", kind="parameter"))
        h = ops.relu(ops.conv2d(h, weights[-1], padding=1))
    g.output("y", h)
    if grad:
        loss = ops.reduce_sum(h * h, axes=(0, 1, 2, 3), keepdims=False)
        g.output("gx", popir.autodiff.grad(g, loss, [x])[0])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.integers(-2, 3, x.shape).astype(np.float32)}
    return g, feeds, {w.name: rng.integers(-1, 2, w.shape).astype(np.float32) for w in weights}


def _run(g, feeds, values, dithering):
    exe = popsim.compile(g, IPU, conv_dithering=dithering)
    for name, value in values.items():
        exe.write_variable(name, value)
    return exe.run(feeds), exe.profile.programs[g.name]


def test_dithering_lowers_the_busiest_tile_of_small_convolutions_and_changes_no_number():
    g, feeds, values = _convs([4, 4, 4, 4, 4])
    plain, plain_profile = _run(g, feeds, values, False)
    dithered, dithered_profile = _run(g, feeds, values, True)
    np.testing.assert_array_equal(dithered["y"], plain["y"])
    np.testing.assert_array_equal(dithered["y"], popir.interpreter.run(g, {**feeds, **values})["y"])
    busiest = {
        name: max(p["memory"]["tensors"]) for name, p in (("plain", plain_profile), ("dithered", dithered_profile))
    }
    assert busiest["dithered"] < busiest["plain"]


@pytest.fixture
def starts(monkeypatch):
    """(task count, first tile, step) of every plan's tiles, as lowered."""
    seen = []
    task_tiles = Lowerer.task_tiles

    def record(self, tasks):
        tiles = task_tiles(self, tasks)
        seen.append((tasks, int(tiles[0]), int(tiles[1] - tiles[0]) if tasks > 1 else 1, self.dither is not None))
        return tiles

    monkeypatch.setattr(Lowerer, "task_tiles", record)
    return seen


def test_each_convolution_starts_on_a_column_hashed_from_its_shape_in_every_pass(starts):
    g, feeds, values = _convs([4, 8, 4], grad=True)
    _run(g, feeds, values, True)
    convs = [s for s in starts if s[3]]
    assert convs and all(first % conv_plan.TILES_PER_COLUMN == 0 for _, first, _, _ in convs)
    # The 4 -> 8 and 8 -> 4 convolutions have one shape key (batch x channels x out channels, field): every
    # pass of both starts on one column and runs one way; a 4 -> 4 convolution hashes elsewhere.
    assert len({(first, step) for _, first, step, _ in convs}) == 1
    starts.clear()
    g, feeds, values = _convs([4, 4, 8, 4])
    _run(g, feeds, values, True)
    assert len({(first, step) for _, first, step, dithered in starts if dithered}) == 2


def test_without_dithering_no_plan_is_dithered(starts):
    g, feeds, values = _convs([4, 8, 4], grad=True)
    got, _ = _run(g, feeds, values, False)
    assert starts and not any(dithered for *_, dithered in starts)
    want = popir.interpreter.run(g, {**feeds, **values})
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)
