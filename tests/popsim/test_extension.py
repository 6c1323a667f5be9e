"""popsim's public extension API: register_lowering (the custom op example end to end), supported_ops agreeing
with popir's registry, and compile optimising graphs by default."""

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import lowerings

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_the_custom_op_example_trains_on_popsim_as_the_interpreter():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_op.py")], capture_output=True, text=True, timeout=300, check=True
    )
    losses = re.findall(r"loss on popsim ([\d.]+), interpreter ([\d.]+)", done.stdout)
    assert len(losses) == 5
    assert float(losses[-1][0]) < float(losses[0][0])  # it trains
    assert float(done.stdout.rsplit(" ", 1)[-1]) < 1e-5


def test_supported_ops_are_exactly_popirs_primitives():
    assert popsim.supported_ops() == set(popir.all_ops())


def test_register_lowering_needs_a_popir_op():
    with pytest.raises(popsim.Error, match="popir has no op 'no_such_op'; define it with popir.defop"):
        popsim.register_lowering("no_such_op")


def test_register_lowering_refuses_to_replace_silently(monkeypatch):
    with pytest.raises(popsim.Error, match="'exp' already has a lowering; pass replace=True"):
        popsim.register_lowering("exp")
    monkeypatch.setitem(lowerings.LOWERINGS, "exp", lowerings.LOWERINGS["exp"])

    @popsim.register_lowering("exp", replace=True)
    def _exp_as_tanh(lw, node, x):  # a deliberately different lowering, to see it is the one used
        return lw.elementwise("tanh", [x], x.shape, x.dtype)

    g = popir.Graph("g")
    x = g.add_input("x", (4,), "float32")
    g.output("y", ops.exp(x))
    value = np.linspace(-1, 1, 4).astype(np.float32)
    np.testing.assert_allclose(popsim.compile(g, "small").run({"x": value})["y"], np.tanh(value), rtol=1e-6)


def _graph_with_unused_gradient():
    g = popir.Graph("g")
    x = g.add_input("x", (16, 8), "float32")
    w = g.add_input("w", (8, 4), "float32", kind="parameter")
    loss = ops.reduce_sum(ops.tanh(x @ w), axes=None, keepdims=False)
    dw, _ = popir.autodiff.grad(g, loss, [w, x])  # the input's gradient is never used
    g.output("loss", loss)
    g.update(w, w - dw)
    return g


def test_compile_optimises_by_default_and_can_opt_out():
    feeds = {"x": np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)}
    results, steps = [], []
    for optimize in (True, False):
        exe = popsim.compile(_graph_with_unused_gradient(), "small", optimize=optimize)
        exe.write_variable("w", np.full((8, 4), 0.1, np.float32))
        results.append((exe.run(feeds)["loss"], exe.read_variable("w")))
        steps.append(sum(s["kind"] == "compute" for s in exe.profile.programs["g"]["steps"]))
    assert steps[0] < steps[1]
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)
