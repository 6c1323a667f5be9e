"""A convolution run as a matmul over im2col columns (forward, weight gradient and input gradient) takes its
result straight from the matmul's partials into its own layout (NCHW, or the weight's): one gather or
reduction of the partials, no second exchange reordering the product. Results equal the interpreter (the
partials are summed in the same order whichever layout they land in)."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import conv_plan

TARGET = popsim.Target.small(num_tiles=16)
X, W = (2, 3, 7, 6), (4, 3, 3, 3)


@pytest.fixture
def im2col(monkeypatch):
    """Every convolution runs as a matmul over im2col columns, whatever the planner estimates."""
    monkeypatch.setattr(conv_plan, "direct_is_faster", lambda *args: False)


def _graph():
    g = popir.Graph("conv")
    x = g.add_input("x", X, "float32")
    w = g.add_input("w", W, "float32", kind="parameter")
    y = ops.conv2d(x, w, stride=(2, 1), padding=(1, 2))
    g.output("y", y)
    loss = ops.reduce_sum(y * y, axes=(0, 1, 2, 3), keepdims=False)
    gx, gw = popir.autodiff.grad(g, loss, [x, w])
    g.output("gx", gx)
    g.output("gw", gw)
    return g


def test_an_im2col_convolution_writes_its_layout_from_the_partials_in_one_exchange(im2col):
    g = _graph()
    exe = popsim.compile(g, TARGET)
    rng = np.random.default_rng(0)
    # Small integers: every partial sum is exact in float32, so the results are the interpreter's bit for bit.
    x = rng.integers(-3, 4, X).astype(np.float32)
    w = rng.integers(-3, 4, W).astype(np.float32)
    exe.write_variable("w", w)
    got = exe.run({"x": x})
    want = popir.interpreter.run(g, {"x": x, "w": w})
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    steps = [s["name"] for s in exe.profile.programs["conv"]["steps"] if s["kind"] == "exchange"]
    copies = {name for step in steps for name in step.split("+")}
    assert "matmul-lhs" in copies  # the convolutions did run as matmuls
    assert not {c for c in copies if c.startswith("conv-")}, copies
