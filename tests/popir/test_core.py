"""Core graph building, interpretation, autodiff and serialization on the base primitives."""

import numpy as np
import pytest

import popir
from popir import ops


def _small_graph():
    g = popir.Graph("small")
    x = g.add_input("x", (2, 3), "float32")
    w = g.add_input("w", (3,), "float32", kind="parameter")
    loss = ops.reduce_sum(ops.exp(x * w) + 1.0, axes=None, keepdims=False)
    g.output("loss", loss)
    (gw,) = popir.autodiff.grad(g, loss, [w])
    g.update(w, w - gw * 0.5)
    return g


def test_step_matches_hand_written_gradient():
    g = _small_graph().verify()
    rng = np.random.default_rng(0)
    x, w = rng.random((2, 3), np.float32), rng.random(3, np.float32)
    outputs, state = popir.interpreter.step(g, {"x": x, "w": w})
    np.testing.assert_allclose(outputs["loss"], (np.exp(x * w) + 1).sum(), rtol=1e-6)
    np.testing.assert_allclose(state["w"], w - 0.5 * (np.exp(x * w) * x).sum(0), rtol=1e-6)


def test_round_trip_is_equal_and_hash_stable():
    g = _small_graph()
    again = popir.Graph.from_bytes(g.to_bytes())
    assert again == g and again.hash() == g.hash() == _small_graph().hash()
    assert again.to_bytes() == g.to_bytes()


def test_mismatched_shapes_name_the_node_and_shapes():
    g = popir.Graph()
    a, b = g.add_input("a", (2, 3), "float32"), g.add_input("b", (4,), "float32")
    with pytest.raises(popir.IRError, match=r"add\(.*float32\[2,3\].*float32\[4\].*do not broadcast"):
        ops.add(a, b)


def test_corrupt_bytes_raise_irerror():
    data = _small_graph().to_bytes()
    for bad in (b"", b"junk", data[: len(data) // 2], data[:20] + b"\xff" * 10 + data[30:]):
        with pytest.raises(popir.IRError, match="corrupt"):
            popir.Graph.from_bytes(bad)


def test_dtype_attributes_are_stored_by_name_and_round_trip():
    g = popir.Graph()
    x = g.add_input("x", (2,), "float32")
    g.output("y", ops.cast(x, dtype=popir.DType.float16))
    (node,) = g.nodes
    assert type(node.attrs["dtype"]) is str and "cast(%0, dtype='float16')" in g.to_text()
    again = popir.Graph.from_bytes(g.to_bytes())
    assert again.to_text() == g.to_text() and again.to_bytes() == g.to_bytes()
