"""Every node records the (pipeline stage, IPU) it runs on; gradients run where their forward ran, and
passes and serialisation keep the placement."""

import numpy as np

import popir
from popir import DType, ops


def _placed_graph():
    g = popir.Graph("placed")
    x = g.add_input("x", (4, 3), DType.float32)
    w = g.add_input("w", (3, 2), DType.float32, kind="parameter")
    with g.placed((0, 0)):
        h = ops.relu(x @ w)
    with g.placed((1, 1)):
        loss = ops.reduce_sum(h * h, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    return g, w, loss


def test_nodes_record_their_placement_and_gradients_follow_the_forward():
    g, w, loss = _placed_graph()
    assert {n.placement for n in g.nodes} == {(0, 0), (1, 1)}
    forward = len(g.nodes)
    (grad,) = popir.autodiff.grad(g, loss, [w])
    backward = g.nodes[forward:]
    assert backward and {n.placement for n in backward} <= {(0, 0), (1, 1)}
    assert grad.producer.placement == (0, 0)  # the gradient of x @ w runs on the matmul's IPU
    assert "[stage 1, IPU 1]" in g.to_text()


def test_passes_and_serialisation_keep_placements():
    g, w, loss = _placed_graph()
    g.output("grad", popir.autodiff.grad(g, loss, [w])[0])
    optimised = popir.passes.optimize(g)
    assert {n.placement for n in optimised.nodes if n.op != "constant"} <= {(0, 0), (1, 1)}
    assert any(n.placement == (1, 1) for n in optimised.nodes)
    again = popir.Graph.from_bytes(optimised.to_bytes())
    assert [n.placement for n in again.nodes] == [n.placement for n in optimised.nodes]
    unplaced = popir.Graph.from_bytes(_unplaced().to_bytes())
    assert all(n.placement is None for n in unplaced.nodes)
    feeds = {"x": np.ones((4, 3), np.float32), "w": np.ones((3, 2), np.float32)}
    np.testing.assert_allclose(popir.interpreter.run(again, feeds)["loss"], 72.0)


def _unplaced():
    g = popir.Graph("plain")
    x = g.add_input("x", (2,), DType.float32)
    g.output("y", ops.relu(x))
    return g
