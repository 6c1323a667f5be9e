"""Node provenance: module path, frontend op, source line and role, through autodiff, passes and bytes."""

import pytest

import popir
from popir import IRError, ops


def _forward_graph():
    g = popir.Graph("g")
    x = g.add_input("x", (2, 3), "float32")
    w = g.add_input("w", (3, 4), "float32", kind="parameter")
    with g.annotate(source="model.py:7: y = x @ w", module="block/fc", aten="aten.mm.default", role="forward"):
        y = x @ w
    with g.annotate(module="block/act", aten="aten.relu.default", role="forward"):
        z = ops.relu(y)
    loss = ops.reduce_sum(z, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    return g, w, loss


def test_nodes_record_the_annotations_of_every_enclosing_scope():
    g = popir.Graph("g")
    x = g.add_input("x", (2,), "float32")
    with g.annotate(module="outer", role="forward"):
        with g.annotate(aten="aten.exp.default"):
            inner = ops.exp(x).producer
        outer = ops.neg(x).producer
    after = ops.neg(x).producer
    assert inner.annotations() == {
        "source": None,
        "module": "outer",
        "aten": "aten.exp.default",
        "role": "forward",
        "placement": None,
        "checkpoint": None,
        "available_memory": None,
        "conv_dithering": None,
        "partials_type": None,
    }
    assert (outer.module, outer.aten) == ("outer", None)
    assert after.annotations() == dict.fromkeys(popir.graph.ANNOTATIONS)


def test_unknown_annotations_and_roles_are_refused():
    g = popir.Graph("g")
    with pytest.raises(IRError, match="unknown node annotation"):
        g.annotate(layer="fc")
    with pytest.raises(IRError, match="role must be one of"):
        g.annotate(role="sideways")


def test_gradient_nodes_inherit_their_forward_node_provenance_as_backward():
    g, w, loss = _forward_graph()
    forward = len(g.nodes)
    (dw,) = popir.autodiff.grad(g, loss, [w])
    backward = g.nodes[forward:]
    assert backward and all(n.role == "backward" for n in backward)
    matmul_grads = [n for n in backward if n.module == "block/fc"]
    assert matmul_grads and all(
        (n.aten, n.source) == ("aten.mm.default", "model.py:7: y = x @ w") for n in matmul_grads
    )
    assert any(n.module == "block/act" for n in backward)
    assert dw.producer.role == "backward"


def test_passes_and_serialization_keep_provenance():
    g, w, loss = _forward_graph()
    popir.autodiff.grad(g, loss, [w])
    g.output("dw", g.nodes[-1].outputs[0])
    optimized = popir.passes.optimize(g)
    for graph in (optimized, popir.Graph.from_bytes(optimized.to_bytes())):
        assert {n.role for n in graph.nodes} >= {"forward", "backward"}
        assert {n.module for n in graph.nodes} >= {"block/fc", "block/act"}
        assert [n.annotations() for n in graph.nodes] == [n.annotations() for n in optimized.nodes]
