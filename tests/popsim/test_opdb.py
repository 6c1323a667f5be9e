"""Every op of the shared op database runs on popsim's tiles with the interpreter's results, gradients included."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opdb import OPDB

import popir
import popsim
from popir import ops


def _compare(entry, got, expected, dtype):
    rtol, atol = (entry.fp16_rtol, entry.fp16_atol) if dtype == "float16" else (max(entry.rtol, 1e-4), 1e-4)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        if value.dtype == np.int32 and entry.name in ("argmax", "argmin"):
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=f"{entry.name} {name}")


def _with_grads(entry, graph, feeds):
    """Add the gradients of sum(out0 * c) w.r.t. the entry's differentiable inputs as outputs."""
    out = graph.outputs.get("out0")
    wrt = [graph.input(name) for name in entry.grad if name in feeds]
    if out is None or not out.dtype.is_float or not wrt:
        return
    weights = np.linspace(-1, 1, out.type.size).reshape(out.shape).astype(out.dtype.numpy)
    loss = ops.reduce_sum(out * graph.constant(weights), axes=None, keepdims=False)
    for name, grad in zip(entry.grad, popir.autodiff.grad(graph, loss, wrt)):
        if grad is not None:
            graph.output(f"grad_{name}", grad)


def _check(name, data, target):
    entry = OPDB[name]
    dtype = data.draw(st.sampled_from(entry.dtypes))
    sample = data.draw(entry.samples(dtype))
    graph, feeds = entry.make_graph(sample)
    _with_grads(entry, graph, feeds)
    expected = popir.interpreter.run(graph, feeds)
    exe = popsim.compile(graph, target)
    _compare(entry, exe.run(feeds), expected, dtype)


@pytest.mark.parametrize("name", sorted(OPDB))
@settings(max_examples=5)
@given(data=st.data())
def test_op_matches_interpreter_on_small_target(name, data):
    _check(name, data, "small")


@pytest.mark.parametrize("name", sorted(OPDB))
@settings(max_examples=2)
@given(data=st.data())
def test_op_matches_interpreter_on_full_ipu2(name, data):
    _check(name, data, "ipu2")
