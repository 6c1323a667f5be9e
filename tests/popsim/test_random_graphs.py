"""Random popir graphs of the base ops give the interpreter's outputs, gradients and state updates on popsim."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import ops

BINARY = [ops.add, ops.sub, ops.mul]


@st.composite
def graphs(draw):
    """A graph of broadcasting arithmetic, exp, reshape and reductions over one input and one parameter."""
    rows = draw(st.integers(1, 9))
    cols = draw(st.integers(1, 300))
    g = popir.Graph("random")
    x = g.add_input("x", (rows, cols), "float32")
    w = g.add_input("w", (cols,), "float32", kind="parameter")
    values = [x, w]
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["binary", "exp", "neg", "reshape", "reduce", "div", "broadcast"]))
        a = draw(st.sampled_from(values))
        if kind == "binary":
            b = draw(st.sampled_from([v for v in values if v.shape in (a.shape, a.shape[-1:], ())] or [a]))
            values.append(draw(st.sampled_from(BINARY))(a, b))
        elif kind == "exp":
            values.append(ops.exp(a * 0.1))
        elif kind == "neg":
            values.append(-a)
        elif kind == "div":
            values.append(a / (ops.exp(a) + 1.0))
        elif kind == "reshape" and a.ndim == 2:
            values.append(ops.reshape(a, shape=(a.shape[1], a.shape[0])))
        elif kind == "broadcast" and a.ndim == 1:
            values.append(ops.broadcast_to(a, shape=(3,) + a.shape))
        elif kind == "reduce" and a.ndim >= 1:
            axes = draw(st.sampled_from([None, (0,), (a.ndim - 1,)]))
            values.append(ops.reduce_sum(a, axes=axes, keepdims=draw(st.booleans())))
    loss = ops.reduce_sum(values[-1] * values[-1], axes=None, keepdims=False)
    g.output("loss", loss)
    g.output("last", values[-1])
    (gw,) = popir.autodiff.grad(g, loss, [w])
    g.output("grad", gw)
    g.update(w, w - gw * 0.01)
    return g, rows, cols


@pytest.mark.parametrize("target", ["small", "ipu2"])
@settings(max_examples=15)
@given(case=graphs(), seed=st.integers(0, 2**16))
def test_random_graph_matches_interpreter_across_runs(target, case, seed):
    g, rows, cols = case
    rng = np.random.default_rng(seed)
    w = rng.uniform(-1, 1, cols).astype(np.float32)
    exe = popsim.compile(g, target)
    exe.write_variable("w", w)
    for _ in range(2):
        x = rng.uniform(-1, 1, (rows, cols)).astype(np.float32)
        expected, state = popir.interpreter.step(g, {"x": x, "w": w})
        got = exe.run({"x": x})
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(exe.read_variable("w"), state["w"], rtol=2e-4, atol=1e-5)
        w = state["w"]
