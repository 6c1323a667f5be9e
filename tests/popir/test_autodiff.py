"""Reverse-mode autodiff: every VJP and whole models (MLP, conv net, attention block) against central finite
differences in float64, fan-out accumulation, pruning, stop_gradient and double backward. No torch here."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from opdb import OPDB, vjp_check

import popir
from popir import ops

DIFFERENTIABLE = [e.name for e in OPDB.values() if e.grad]


@pytest.mark.parametrize("name", DIFFERENTIABLE)
@settings(max_examples=min(settings.default.max_examples, 10))
@given(data=st.data())
def test_vjp_matches_finite_differences(name, data):
    entry = OPDB[name]
    sample = data.draw(entry.samples("float32"))
    wrt = [k for k in entry.grad if k in sample.inputs and sample.inputs[k].dtype.kind == "f"]
    graph, feeds = entry.make_graph(sample)
    if not wrt or not any(v.dtype.is_float for v in graph.outputs.values()):
        return
    with np.errstate(all="ignore"):
        outputs = popir.interpreter.run(graph, feeds)
    # Finite differences say nothing where the function itself is not finite (e.g. a mean over no targets).
    assume(all(np.all(np.isfinite(v)) for v in outputs.values() if v.dtype.kind == "f"))
    analytic, numeric = vjp_check(graph, feeds, wrt, seed=data.draw(st.integers(0, 99)))
    assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-6)


def _params(graph, rng, **shapes):
    values = {name: graph.add_input(name, shape, "float32", kind="parameter") for name, shape in shapes.items()}
    feeds = {name: rng.standard_normal(shape) * 0.5 for name, shape in shapes.items()}
    return values, feeds


def _check_model(graph, feeds, out):
    graph.output("out", out)
    wrt = [v.name for v in graph.inputs if v.dtype.is_float]
    analytic, numeric = vjp_check(graph, feeds, wrt)
    assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_mlp_gradients():
    rng = np.random.default_rng(0)
    g = popir.Graph("mlp")
    x = g.add_input("x", (4, 5), "float32")
    target = g.add_input("target", (4,), "int32")
    p, feeds = _params(g, rng, w1=(8, 5), b1=(8,), w2=(3, 8), b2=(3,))
    h = ops.relu(ops.linear(x, p["w1"], p["b1"]))
    loss = ops.cross_entropy(ops.linear(h, p["w2"], p["b2"]), target)
    feeds.update(x=rng.standard_normal((4, 5)), target=np.array([0, 2, 1, 2], np.int32))
    _check_model(g, feeds, loss)


def test_conv_net_gradients():
    rng = np.random.default_rng(1)
    g = popir.Graph("cnn")
    x = g.add_input("x", (2, 1, 8, 8), "float32")
    target = g.add_input("target", (2,), "int32")
    p, feeds = _params(g, rng, k1=(4, 1, 3, 3), gw=(4,), gb=(4,), k2=(4, 2, 3, 3), w=(3, 16), b=(3,))
    h = ops.relu(ops.conv2d(x, p["k1"], padding=1))
    h = ops.max_pool2d(ops.group_norm(h, 2, p["gw"], p["gb"]), 2)
    h = ops.relu(ops.conv2d(h, p["k2"], stride=2, padding=1, groups=2))
    logits = ops.linear(ops.flatten(h), p["w"], p["b"])
    loss = ops.nll_loss(ops.log_softmax(logits, axis=1), target)
    feeds.update(x=rng.standard_normal((2, 1, 8, 8)), target=np.array([1, 2], np.int32))
    _check_model(g, feeds, loss)


def test_attention_block_gradients():
    rng = np.random.default_rng(2)
    batch, seq, dim, heads, vocab = 2, 4, 8, 2, 11
    g = popir.Graph("attention")
    tokens = g.add_input("tokens", (batch, seq), "int32")
    seed = g.add_input("seed", (2,), "int32")
    p, feeds = _params(
        g,
        rng,
        emb=(vocab, dim),
        wqkv=(3 * dim, dim),
        wo=(dim, dim),
        ln_w=(dim,),
        ln_b=(dim,),
        w1=(16, dim),
        w2=(dim, 16),
    )
    x = ops.embedding(p["emb"], tokens)
    qkv = ops.linear(x, p["wqkv"])

    def heads_of(i):
        part = ops.slice(qkv, starts=(0, 0, i * dim), stops=(batch, seq, (i + 1) * dim))
        part = ops.reshape(part, shape=(batch, seq, heads, dim // heads))
        return ops.transpose(part, perm=(0, 2, 1, 3))

    q, k, v = heads_of(0), heads_of(1), heads_of(2)
    scores = ops.matmul(q, ops.transpose(k, perm=(0, 1, 3, 2))) * (1.0 / np.sqrt(dim // heads))
    causal = g.constant(np.triu(np.ones((seq, seq), bool), 1))
    attn = ops.dropout(ops.softmax(ops.masked_fill(scores, causal, -1e4), axis=-1), 0.1, seed)
    ctx = ops.reshape(ops.transpose(ops.matmul(attn, v), perm=(0, 2, 1, 3)), shape=(batch, seq, dim))
    h = ops.layer_norm(x + ops.linear(ctx, p["wo"]), (dim,), p["ln_w"], p["ln_b"])
    out = h + ops.linear(ops.gelu(ops.linear(h, p["w1"])), p["w2"])
    feeds.update(tokens=rng.integers(0, vocab, (batch, seq)).astype(np.int32), seed=np.array([3, 4], np.int32))
    _check_model(g, feeds, out)


def _grad_graph(build):
    g = popir.Graph()
    x = g.add_input("x", (3,), "float32")
    loss = build(g, x)
    (gx,) = popir.autodiff.grad(g, loss, [x])
    g.output("gx", gx)
    return g


def test_fan_out_accumulates():
    g = _grad_graph(lambda g, x: ops.reduce_sum(x * x + ops.exp(x) + x, axes=None, keepdims=False))
    x = np.array([0.5, -1.0, 2.0], np.float32)
    np.testing.assert_allclose(popir.interpreter.run(g, {"x": x})["gx"], 2 * x + np.exp(x) + 1, rtol=1e-6)


def test_unreachable_and_non_differentiable_paths_are_pruned():
    def build(g, x):
        unrelated = g.add_input("u", (3,), "float32")
        ops.exp(ops.exp(unrelated))  # a branch the loss never sees
        mask = ops.gt(x, g.constant(np.float32(0)))  # a boolean use of x: no gradient flows through it
        return ops.reduce_sum(ops.where(mask, x, x * 2.0), axes=None, keepdims=False)

    g = _grad_graph(build)
    forward_ops = ["constant", "exp", "exp", "constant", "gt", "constant", "mul", "where", "reduce_sum"]
    backward = [n.op for n in g.nodes[len(forward_ops) :]]
    assert "exp" not in backward and "gt" not in backward
    out = popir.interpreter.run(g, {"x": np.array([1.0, -1.0, 2.0]), "u": np.zeros(3)})
    np.testing.assert_allclose(out["gx"], [1.0, 2.0, 1.0])


def test_unconnected_gradient_is_zero():
    g = popir.Graph()
    x, y = g.add_input("x", (2,), "float32"), g.add_input("y", (2, 2), "float32")
    gy = popir.autodiff.grad(g, ops.reduce_sum(x, axes=None, keepdims=False), [y])[0]
    g.output("gy", gy)
    assert popir.interpreter.run(g, {"x": np.ones(2), "y": np.ones((2, 2))})["gy"].tolist() == [[0, 0], [0, 0]]


def test_unreached_none_marks_values_no_gradient_reaches():
    g = popir.Graph()
    x, y, z = (g.add_input(n, (2,), "float32") for n in "xyz")
    loss = ops.reduce_sum(x + ops.stop_gradient(y), axes=None, keepdims=False)
    gx, gy, gz = popir.autodiff.grad(g, loss, [x, y, z], unreached="none")
    assert gx is not None and gy is None and gz is None
    with pytest.raises(popir.IRError, match="unreached must be"):
        popir.autodiff.grad(g, loss, [x], unreached="skip")


def test_integer_loss_is_rejected():
    g = popir.Graph()
    x = g.add_input("x", (2,), "int32")
    with pytest.raises(popir.IRError, match="cannot differentiate"):
        popir.autodiff.grad(g, ops.reduce_sum(x, axes=None, keepdims=False), [x])


@pytest.mark.parametrize("layer", ["conv", "pool", "matmul"])
def test_double_backward_matches_finite_differences_of_the_gradient(layer):
    rng = np.random.default_rng(3)
    g = popir.Graph()
    x = g.add_input("x", (1, 2, 5, 5), "float32")
    w = g.add_input("w", (2, 2, 3, 3), "float32")
    if layer == "conv":
        y = ops.conv2d(x, w, stride=2, padding=1)
    elif layer == "pool":
        y = ops.max_pool2d(ops.conv2d(x, w, padding=1), 3, 2, 1, ceil_mode=True)
    else:
        y = ops.matmul(ops.sin(x), x) + ops.reduce_sum(w * w, axes=None, keepdims=False)
    loss = ops.reduce_sum(ops.tanh(y), axes=None, keepdims=False)
    gx, gw = popir.autodiff.grad(g, loss, [x, w])
    g.output("gx", gx)
    g.output("gw", gw)
    feeds = {"x": rng.standard_normal((1, 2, 5, 5)), "w": rng.standard_normal((2, 2, 3, 3))}
    analytic, numeric = vjp_check(g, feeds, ["x", "w"])
    assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-7)


def test_no_gradient_flows_through_stop_gradient_even_after_optimisation():
    g = popir.Graph()
    x = g.add_input("x", (3,), "float32")
    g.output("loss", ops.reduce_sum(ops.exp(ops.stop_gradient(x)), axes=None, keepdims=False))
    # Passes also run on forward graphs before autodiff, so they must keep the cut.
    g = popir.passes.optimize(g)
    (gx,) = popir.autodiff.grad(g, g.outputs["loss"], [g.input("x")])
    g.output("gx", gx)
    assert popir.interpreter.run(g, {"x": np.array([0.5, -1.0, 2.0])})["gx"].tolist() == [0, 0, 0]


def test_stop_gradient_cuts_only_its_own_path():
    g = _grad_graph(lambda g, x: ops.reduce_sum(x * ops.stop_gradient(x), axes=None, keepdims=False))
    x = np.array([0.5, -1.0, 2.0], np.float32)
    np.testing.assert_array_equal(popir.interpreter.run(g, {"x": x})["gx"], x)
    # After optimisation the gradient is the stop_gradient node itself: d/dx of x * c is c, not 2x.
    optimized = popir.passes.optimize(g)
    assert [n.op for n in optimized.nodes] == ["stop_gradient"]
    np.testing.assert_array_equal(popir.interpreter.run(optimized, {"x": x})["gx"], x)
