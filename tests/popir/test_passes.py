"""popir.passes: one hand-written case per rewrite, and random graphs that every pass must leave equivalent."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opdb import OPDB

import popir
from popir import ops, passes

# log and sqrt of negative inputs are NaN on purpose: passes must keep NaNs where they were.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

AVAILABLE = popir.all_ops()
F32 = "float32"


def _needs(*names):
    missing = [n for n in names if n not in AVAILABLE]
    return pytest.mark.skipif(bool(missing), reason=f"ops not registered yet: {missing}")


def _apply(op, *inputs, **attrs):
    return inputs[0].graph.apply(op, inputs, attrs)[0]


def _graph(*shapes):
    g = popir.Graph("t")
    return g, [g.add_input(f"x{i}", s, F32) for i, s in enumerate(shapes)]


def _ops(graph):
    return [n.op for n in graph.nodes]


def _assert_same(actual, expected, what):
    """Equal, bit for bit except float sums: NumPy's matmul adds in an order that depends on memory layout
    (a folded constant is contiguous where the broadcast it replaces had zero strides), so floats may differ
    by rounding."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype.kind == "f":
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def _same_results(before, after, feeds):
    out_b, state_b = popir.interpreter.step(before, feeds)
    out_a, state_a = popir.interpreter.step(after, feeds)
    assert out_b.keys() == out_a.keys() and state_b.keys() == state_a.keys()
    for name in out_b:
        _assert_same(out_a[name], out_b[name], f"output {name}")
    for name in state_b:
        _assert_same(state_a[name], state_b[name], f"update of {name}")


def _feeds(graph, seed=0):
    rng = np.random.default_rng(seed)
    return {
        v.name: (rng.uniform(-2, 2, v.shape) if v.dtype.is_float else rng.integers(0, 3, v.shape)) for v in graph.inputs
    }


# -- structure kept by every pass ------------------------------------------------------------------


@pytest.mark.parametrize(
    "run",
    [
        passes.eliminate_dead_code,
        passes.eliminate_common_subexpressions,
        passes.fold_constants,
        passes.simplify,
        passes.infer_shapes,
        passes.optimize,
    ],
)
def test_every_pass_returns_a_new_graph_keeping_inputs_outputs_and_updates(run):
    g = popir.Graph("keep")
    x = g.add_input("x", (2, 3), F32)
    g.add_input("unused", (4,), "int32")
    w = g.add_input("w", (3,), F32, kind="parameter")
    b = g.add_input("b", (3,), F32, kind="buffer")
    g.add_input("m", (3,), F32, kind="optimizer_state")
    y = ops.reduce_sum(x * w, axes=(0,), keepdims=False)
    g.output("y", y)
    g.output("w_again", w)
    g.update(b, y * 1.0)
    data = g.to_bytes()
    out = run(g)
    assert out is not g and g.to_bytes() == data
    assert [(v.name, v.kind, v.type) for v in out.inputs] == [(v.name, v.kind, v.type) for v in g.inputs]
    assert list(out.outputs) == ["y", "w_again"] and [s.name for s in out.updates] == ["b"]
    assert out.outputs["w_again"] is out.input("w")
    out.verify()
    _same_results(g, out, _feeds(g))


# -- dead code -------------------------------------------------------------------------------------


def test_dce_drops_unused_nodes_but_keeps_unused_inputs():
    g, (x, unused) = _graph((3,), (2,))
    ops.exp(x)
    ops.neg(ops.exp(unused))
    g.output("y", -x)
    out = passes.eliminate_dead_code(g)
    assert _ops(out) == ["neg"] and [v.name for v in out.inputs] == ["x0", "x1"]


def test_dce_keeps_what_an_update_needs():
    g = popir.Graph()
    w = g.add_input("w", (3,), F32, kind="parameter")
    g.update(w, ops.exp(w))
    assert _ops(passes.eliminate_dead_code(g)) == ["exp"]


# -- common subexpressions -------------------------------------------------------------------------


def test_cse_merges_identical_nodes_and_commuted_operands():
    g, (a, b) = _graph((2, 3), (3,))
    g.output("y", ops.exp(a + b) * ops.exp(b + a))
    out = passes.eliminate_common_subexpressions(g)
    assert _ops(out).count("add") == 1 and _ops(out).count("exp") == 1
    _same_results(g, passes.eliminate_dead_code(out), _feeds(g))


def test_cse_merges_equal_constants_only():
    g, (x,) = _graph((3,))
    same = [g.constant(np.array([1.0, 2.0, 3.0], np.float32)) for _ in range(2)]
    negzero, zero = g.constant(np.float32(-0.0)), g.constant(np.float32(0.0))
    other = g.constant(np.array([1.0, 2.0, 4.0], np.float32))
    g.output("y", (x * same[0] + x * same[1]) / (x * other) + negzero + zero)
    out = passes.eliminate_dead_code(passes.eliminate_common_subexpressions(g))
    assert _ops(out).count("constant") == 4 and _ops(out).count("mul") == 2


def test_cse_keeps_nodes_with_different_attributes():
    g, (x,) = _graph((2, 3))
    g.output("a", ops.reduce_sum(x, axes=(0,), keepdims=False))
    g.output("b", ops.reduce_sum(x, axes=(1,), keepdims=False))
    g.output("c", ops.reduce_sum(x, axes=(0,), keepdims=False))
    out = passes.eliminate_common_subexpressions(g)
    assert _ops(out).count("reduce_sum") == 2 and out.outputs["a"] is out.outputs["c"]


def test_cse_keeps_identical_nodes_on_different_placements_apart():
    """Merging them would make one IPU compute the value and copy it over the IPU-Links to the other."""
    g, (x,) = _graph((3,))
    made = {}
    for placement in ((0, 0), (1, 1), (1, 1)):
        with g.placed(placement):
            made.setdefault(placement, []).append(ops.exp(x) * g.constant(np.float32(2.0)))
    g.output("y", made[(0, 0)][0] + made[(1, 1)][0] + made[(1, 1)][1])
    for out in (passes.eliminate_common_subexpressions(g), passes.optimize(g)):
        kept = [(n.op, n.placement) for n in out.nodes if n.op in ("exp", "constant")]
        assert sorted(kept) == [("constant", (0, 0)), ("constant", (1, 1)), ("exp", (0, 0)), ("exp", (1, 1))]
    _same_results(g, passes.optimize(g), _feeds(g))


# -- constant folding ------------------------------------------------------------------------------


def test_folding_evaluates_constant_subgraphs_and_records_their_source():
    g, (x,) = _graph((3,))
    with g.source_line("model.py:7 in forward"):
        c = ops.reduce_sum(ops.exp(g.constant(np.array([0.0, 1.0, 2.0], np.float32))), axes=None, keepdims=False)
    g.output("y", x * c)
    out = passes.eliminate_dead_code(passes.fold_constants(g))
    assert _ops(out) == ["constant", "mul"]
    (const,) = [n for n in out.nodes if n.op == "constant"]
    np.testing.assert_array_equal(const.attrs["value"], np.float32(np.exp(np.float32([0, 1, 2])).sum()))
    assert const.source == "model.py:7 in forward"
    _same_results(g, out, _feeds(g))


def test_folding_keeps_a_scalar_broadcast_to_a_big_shape():
    g = popir.Graph()
    x = g.add_input("x", (64, 128), F32)
    big = ops.broadcast_to(g.constant(np.float32(2.0)), shape=x.shape)
    small = ops.broadcast_to(g.constant(np.float32(3.0)), shape=(4,))
    g.output("big", x + big)
    g.output("small", small)
    out = passes.fold_constants(g)
    assert _ops(out).count("broadcast_to") == 1
    assert max(n.attrs["value"].size for n in out.nodes if n.op == "constant") == 4
    assert x.shape[0] * x.shape[1] > passes.MAX_FOLDED_ELEMENTS


def test_folding_leaves_graph_inputs_alone():
    g, (x,) = _graph((3,))
    g.output("y", ops.exp(x))
    assert _ops(passes.fold_constants(g)) == ["exp"]


def test_host_calls_run_at_run_time_once_per_node_whatever_the_passes():
    calls = []
    ops.register_host_callback("test.count", lambda v: calls.append(1) or v + 1)
    g, (x,) = _graph((3,))
    out_types = (((3,), "float32"),)
    twice = [ops.host_call(x, callback="test.count", out_types=out_types) for _ in range(2)]
    on_constant = ops.host_call(g.constant(np.ones(3, np.float32)), callback="test.count", out_types=out_types)
    g.output("y", twice[0] + twice[1] + on_constant)
    out = passes.optimize(g)
    assert calls == [] and _ops(out).count("host_call") == 3
    _same_results(g, out, _feeds(g))


# -- algebraic simplification ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda x, c: x * c(1.0),
        lambda x, c: c(1.0) * x,
        lambda x, c: x + c(0.0),
        lambda x, c: c(0.0) + x,
        lambda x, c: x - c(0.0),
        lambda x, c: x / c(1.0),
        lambda x, c: x * ops.broadcast_to(c(1.0), shape=x.shape),
        lambda x, c: x + ops.reshape(c(np.zeros((1, 3))), shape=(3,)),
    ],
    ids=["x*1", "1*x", "x+0", "0+x", "x-0", "x/1", "x*broadcast(1)", "x+reshape(0)"],
)
def test_identity_operands_disappear(build):
    g, (x,) = _graph((2, 3))
    g.output("y", build(x, lambda v: g.constant(np.asarray(v, np.float32))))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert out.nodes == [] and out.outputs["y"] is out.input("x0")


def test_an_identity_operand_that_broadcasts_leaves_a_broadcast():
    g, (x,) = _graph((3,))
    g.output("y", x * g.constant(np.ones((2, 3), np.float32)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["broadcast_to"] and out.outputs["y"].shape == (2, 3)
    _same_results(g, out, _feeds(g))


def test_non_identities_stay():
    g, (x,) = _graph((3,))
    g.output("a", g.constant(np.float32(0.0)) - x)
    g.output("b", g.constant(np.float32(1.0)) / x)
    g.output("c", x * g.constant(np.float32(0.0)))
    g.output("d", x * g.constant(np.array([1.0, 1.0, 2.0], np.float32)))
    assert _ops(passes.eliminate_dead_code(passes.simplify(g))).count("constant") == 4


def test_reshape_chains_collapse_and_reshape_to_the_same_shape_vanishes():
    g, (x,) = _graph((2, 3, 4))
    chain = ops.reshape(ops.reshape(ops.reshape(x, shape=(6, 4)), shape=(24,)), shape=(4, 6))
    g.output("chain", chain)
    g.output("same", ops.reshape(x, shape=(2, 3, 4)))
    g.output("back", ops.reshape(ops.reshape(x, shape=(24,)), shape=(2, 3, 4)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["reshape"] and out.nodes[0].inputs[0] is out.input("x0")
    assert out.outputs["same"] is out.outputs["back"] is out.input("x0")
    _same_results(g, out, _feeds(g))


def test_broadcast_chains_collapse_and_broadcast_to_the_same_shape_vanishes():
    g, (x,) = _graph((3,))
    g.output("chain", ops.broadcast_to(ops.broadcast_to(x, shape=(1, 3)), shape=(5, 2, 3)))
    g.output("same", ops.broadcast_to(x, shape=(3,)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["broadcast_to"] and out.nodes[0].inputs[0] is out.input("x0")
    assert out.outputs["same"] is out.input("x0")
    _same_results(g, out, _feeds(g))


def test_reduce_sum_over_unit_axes_is_a_reshape_or_nothing():
    g, (x,) = _graph((2, 1, 3))
    g.output("kept", ops.reduce_sum(x, axes=(1,), keepdims=True))
    g.output("dropped", ops.reduce_sum(x, axes=(1,), keepdims=False))
    g.output("real", ops.reduce_sum(x, axes=(0, 1), keepdims=False))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["reshape", "reduce_sum"] and out.outputs["kept"] is out.input("x0")
    _same_results(g, out, _feeds(g))


def test_reshape_of_a_reduce_sum_to_its_keepdims_shape_is_a_keepdims_reduce_sum():
    g, (x,) = _graph((2, 3, 4))
    g.output("y", ops.reshape(ops.reduce_sum(x, axes=(1,), keepdims=False), shape=(2, 1, 4)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["reduce_sum"] and out.nodes[0].attrs == {"axes": (1,), "keepdims": True}
    _same_results(g, out, _feeds(g))


@_needs("where", "gt")
def test_elementwise_ops_absorb_explicit_broadcasts():
    g, (x, y) = _graph((2, 3), (3,))
    g.output("mul", x * ops.broadcast_to(y, shape=(2, 3)))
    g.output("kept", ops.broadcast_to(y, shape=(4, 3)) + 1.5)
    zero = ops.broadcast_to(g.constant(np.float32(0.0)), shape=(2, 3))
    g.output("where", _apply("where", _apply("gt", x, zero), x, zero))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert [n.inputs[1] for n in out.nodes if n.op == "mul"] == [out.input("x1")]
    assert _ops(out).count("broadcast_to") == 1 and out.nodes[-1].inputs[2].shape == ()
    _same_results(g, out, _feeds(g))


@_needs("slice", "pad", "concat")
def test_slices_pads_and_concats_that_change_nothing_vanish():
    g, (x,) = _graph((2, 3))
    g.output("all", _apply("slice", x, starts=(0, -5), stops=(2, 99), steps=(1, 1)))
    g.output("part", _apply("slice", x, starts=(0, 1), stops=(2, 3), steps=None))
    g.output("pad0", _apply("pad", x, pads=((0, 0), (0, 0)), value=1.0))
    g.output("one", _apply("concat", x, axis=0))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["slice"]
    assert out.outputs["all"] is out.outputs["pad0"] is out.outputs["one"] is out.input("x0")


@_needs("transpose")
def test_transposes_compose_and_identity_transposes_vanish():
    g, (x,) = _graph((2, 3, 4))
    g.output("composed", _apply("transpose", _apply("transpose", x, perm=(1, 2, 0)), perm=(1, 2, 0)))
    g.output("undone", _apply("transpose", _apply("transpose", x, perm=(2, 0, 1)), perm=(1, 2, 0)))
    g.output("identity", _apply("transpose", x, perm=(0, 1, 2)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["transpose"] and out.nodes[0].attrs["perm"] == (2, 0, 1)
    assert out.outputs["undone"] is out.outputs["identity"] is out.input("x0")
    _same_results(g, out, _feeds(g))


def _transposed_elements(graph):
    return sum(int(np.prod(n.inputs[0].shape)) for n in graph.nodes if n.op == "transpose")


def test_matrix_transposes_move_to_the_smaller_side_of_a_matmul():
    # A linear layer's pattern: y = x W^T, and the gradient dW = (x^T g)^T as autodiff writes it.
    g, (x, w, grad) = _graph((4, 64), (32, 64), (4, 32))
    g.output("y", _apply("matmul", x, _apply("transpose", w, perm=(1, 0))))
    g.output("dw", _apply("transpose", _apply("matmul", _apply("transpose", x, perm=(1, 0)), grad), perm=(1, 0)))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert all(n.inputs[0].name != "x1" for n in out.nodes if n.op == "transpose"), "W itself is never transposed"
    assert _transposed_elements(out) < _transposed_elements(g) // 4
    _same_results(g, out, _feeds(g))


def test_matmul_transposes_stay_when_moving_them_would_copy_more():
    g, (a, b) = _graph((64, 48), (8, 48))
    g.output("y", _apply("matmul", a, _apply("transpose", b, perm=(1, 0))))
    g.output("z", _apply("transpose", _apply("matmul", a, _apply("transpose", b, perm=(1, 0))), perm=(1, 0)))
    out = passes.eliminate_dead_code(passes.optimize(g))
    # b^T (8 x 48) is smaller than a^T plus the result would be, and z = b a^T would transpose all of a
    # (64 x 48) to save a 64 x 8 transpose: both stay, and z is the transpose of y.
    assert _transposed_elements(out) == 8 * 48 + 64 * 8
    _same_results(g, out, _feeds(g))


@_needs("cast")
def test_cast_to_the_same_dtype_vanishes():
    g, (x,) = _graph((3,))
    g.output("same", _apply("cast", x, dtype="float32"))
    g.output("half", _apply("cast", x, dtype="float16"))
    out = passes.eliminate_dead_code(passes.simplify(g))
    assert _ops(out) == ["cast"] and out.outputs["same"] is out.input("x0")


def test_rewritten_nodes_keep_the_source_of_the_node_they_replace():
    g, (x,) = _graph((2, 3, 4))
    with g.source_line("a.py:1"):
        inner = ops.reshape(x, shape=(6, 4))
    with g.source_line("a.py:2"):
        outer = ops.reshape(inner, shape=(24,))
    g.output("y", outer)
    (node,) = passes.optimize(g).nodes
    assert node.source == "a.py:2"


# -- shape inference -------------------------------------------------------------------------------


def test_infer_shapes_reproduces_a_correct_graph():
    g, (x, y) = _graph((2, 3), (3,))
    g.output("z", ops.reduce_sum(x * y, axes=(1,), keepdims=True))
    assert passes.infer_shapes(g).to_text() == g.to_text()


def test_infer_shapes_rejects_a_node_whose_rule_fails():
    g, (x, y) = _graph((2, 3), (3,))
    node = g.apply("add", (x, y), {})[0].producer
    node.inputs[1] = g.add_input("bad", (4,), F32)
    g.output("z", node.outputs[0])
    with pytest.raises(popir.IRError, match="do not broadcast"):
        passes.infer_shapes(g)


# -- optimize --------------------------------------------------------------------------------------


def test_optimize_cleans_up_a_training_step():
    g = popir.Graph("step")
    x = g.add_input("x", (4, 3), F32)
    w = g.add_input("w", (3,), F32, kind="parameter")
    loss = ops.reduce_sum(ops.exp(x * w) * 1.0 + ops.exp(w * x), axes=None, keepdims=False)
    g.output("loss", loss)
    (gw,) = popir.autodiff.grad(g, loss, [w])
    g.update(w, w - gw * 0.1)
    out = passes.optimize(g)
    assert len(out.nodes) < len(g.nodes) and _ops(out).count("exp") == 1
    assert passes.optimize(out) == out
    _same_results(g, out, _feeds(g))


def test_optimize_reports_a_rule_that_never_settles(monkeypatch):
    from popir.passes import pipeline

    def restless(builder, op, inputs, attrs, types):
        builder.changes += 1
        return builder.emit(op, inputs, attrs, types)

    monkeypatch.setattr(pipeline, "simplify_rule", restless)
    g, (x,) = _graph((3,))
    g.output("y", ops.exp(x))
    with pytest.raises(popir.IRError, match="no fixed point"):
        passes.optimize(g)


# -- random graphs ---------------------------------------------------------------------------------

# Every shape here broadcasts with every other to one of them, so any two pool values combine.
SHAPES = [(), (3,), (1, 3), (2, 1), (2, 3)]
UNARY = [op for op in ("neg", "exp", "tanh", "sigmoid", "abs", "relu", "sin", "log", "sqrt") if op in AVAILABLE]
BINARY = [op for op in ("add", "sub", "mul", "div", "maximum", "minimum") if op in AVAILABLE]


def _fit(draw, x):
    """``x`` reshaped to a pool shape of the same size (maybe its own)."""
    size = x.type.size
    return ops.reshape(x, shape=draw(st.sampled_from([s for s in SHAPES if int(np.prod(s)) == size])))


def _constant(draw, g, pool):
    shape = draw(st.sampled_from(SHAPES))
    fill = draw(st.sampled_from([0.0, 1.0, 2.0, -0.5, None]))
    if fill is None:
        return g.constant(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 1.0)
    scalar = g.constant(np.float32(fill))
    return ops.broadcast_to(scalar, shape=shape) if draw(st.booleans()) else scalar


def _unary(draw, g, pool):
    return _apply(draw(st.sampled_from(UNARY)), draw(st.sampled_from(pool)))


def _binary(draw, g, pool):
    a, b = draw(st.sampled_from(pool)), draw(st.sampled_from(pool))
    return _apply(draw(st.sampled_from(BINARY)), *((b, a) if draw(st.booleans()) else (a, b)))


def _reduce(draw, g, pool):
    x = draw(st.sampled_from(pool))
    axes = draw(st.sampled_from([None, *[(i,) for i in range(x.ndim)], tuple(range(x.ndim))]))
    return _fit(draw, ops.reduce_sum(x, axes=axes, keepdims=draw(st.booleans())))


def _movement(draw, g, pool):
    x = draw(st.sampled_from(pool))
    for _ in range(draw(st.integers(1, 4))):
        if "transpose" in AVAILABLE and x.ndim > 1 and draw(st.booleans()):
            x = _apply("transpose", x, perm=tuple(draw(st.permutations(range(x.ndim)))))
        else:
            x = ops.reshape(x, shape=draw(st.sampled_from([(x.type.size,), (1, x.type.size), x.shape])))
    return _fit(draw, x)


def _broadcast(draw, g, pool):
    x = draw(st.sampled_from(pool))
    targets = [s for s in SHAPES if len(s) >= x.ndim and np.broadcast_shapes(x.shape, s) == s]
    return ops.broadcast_to(x, shape=draw(st.sampled_from(targets)))


def _select(draw, g, pool):
    a, b = draw(st.sampled_from(pool)), draw(st.sampled_from(pool))
    return _apply("where", _apply("gt", a, b), a, b)


def _cast(draw, g, pool):
    x = draw(st.sampled_from(pool))
    return _apply("cast", _apply("cast", x, dtype=draw(st.sampled_from(["float32", "float16"]))), dtype="float32")


def _matmul(draw, g, pool):
    a = ops.reshape(draw(st.sampled_from([v for v in pool if v.type.size == 6])), shape=(2, 3))
    b = ops.reshape(draw(st.sampled_from([v for v in pool if v.type.size == 3])), shape=(3, 1))
    return _apply("matmul", a, b)


def _window(draw, g, pool):
    """A slice, pad or concat round trip back to the pool shape (sometimes a no-op one)."""
    x = ops.broadcast_to(draw(st.sampled_from(pool)), shape=(2, 3))
    kind = draw(st.sampled_from([k for k in ("slice", "pad", "concat") if k in AVAILABLE]))
    if kind == "slice":
        lo = draw(st.sampled_from([0, 2]))  # leaves 6 or 2 elements, sizes that pool shapes have
        return _fit(draw, _apply("slice", x, starts=(0, lo), stops=(2, 3), steps=None))
    if kind == "pad":
        padded = _apply("pad", x, pads=((0, 0), (draw(st.integers(0, 1)), 0)), value=draw(st.sampled_from([0.0, -1.5])))
        return _apply("slice", padded, starts=(0, padded.shape[1] - 3), stops=(2, 3 + padded.shape[1]), steps=None)
    parts = draw(st.lists(st.sampled_from([x, draw(st.sampled_from(pool))]), min_size=1, max_size=2))
    joined = _apply("concat", *[ops.reshape(ops.broadcast_to(p, shape=(2, 3)), shape=(6,)) for p in parts], axis=0)
    return _fit(draw, _apply("slice", joined, starts=(0,), stops=(6,), steps=None))


def _random(draw, g, pool):
    """Uniform noise from a constant seed (foldable when small) or from the seed input."""
    seed = g.constant(np.array([draw(st.integers(0, 9)), 7], np.int32)) if draw(st.booleans()) else g.input("seed")
    return _apply("random_uniform", seed, shape=draw(st.sampled_from(SHAPES)), dtype=F32)


def _composite(draw, g, pool):
    """A composite from popir.ops: softmax, GELU, layer_norm or dropout."""
    x = ops.broadcast_to(draw(st.sampled_from(pool)), shape=(2, 3))
    kind = draw(st.sampled_from(["softmax", "gelu", "layer_norm", "dropout"]))
    if kind == "softmax":
        return ops.softmax(x, axis=draw(st.sampled_from([0, -1])))
    if kind == "gelu":
        return ops.gelu(x, approximate=draw(st.sampled_from(["none", "tanh"])))
    if kind == "layer_norm":
        return ops.layer_norm(x, (3,), draw(st.sampled_from(pool[1:2] + [None])), None)
    return ops.dropout(x, draw(st.sampled_from([0.0, 0.5])), g.input("seed"))


def _repeat(draw, g, pool):
    """A node that repeats an earlier one exactly (work for CSE)."""
    nodes = [n for n in g.nodes if len(n.outputs) == 1 and n.outputs[0] in pool]
    if not nodes:
        return _constant(draw, g, pool)
    node = draw(st.sampled_from(nodes))
    return g.apply(node.op, node.inputs, node.attrs)[0]


BUILDERS = [_constant, _unary, _binary, _reduce, _movement, _broadcast, _repeat]
BUILDERS += [
    b
    for b, needs in (
        (_select, ("where", "gt")),
        (_cast, ("cast",)),
        (_matmul, ("matmul",)),
        (_window, ("slice",)),
        (_random, ("random_uniform",)),
        (_composite, ("random_uniform", "where", "ge", "reduce_max", "erf", "tanh", "rsqrt")),
    )
    if set(needs) <= set(AVAILABLE)
]


@st.composite
def random_graphs(draw):
    """A random graph over the registered ops, with outputs, a state update and sometimes a gradient."""
    g = popir.Graph("random")
    pool = [g.add_input("x", (2, 3), F32), g.add_input("y", (3,), F32)]
    g.add_input("unused", (2,), "int32")
    g.add_input("seed", (2,), "int32")
    w = g.add_input("w", (2, 3), F32, kind="parameter")
    pool.append(w)
    for step in range(draw(st.integers(1, 14))):
        builder = draw(st.sampled_from(BUILDERS))
        with g.source_line(f"model.py:{step}"):
            pool.append(builder(draw, g, pool))
    picks = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
    for i, value in enumerate(picks):
        g.output(f"out{i}", value)
    if draw(st.booleans()):
        loss = ops.reduce_sum(picks[-1], axes=None, keepdims=False)
        (grad,) = popir.autodiff.grad(g, loss, [w])
        g.update(w, w - grad * 0.25)
    else:
        g.update(w, ops.broadcast_to(draw(st.sampled_from(pool)), shape=w.shape))
    return g


PASSES = [
    passes.eliminate_dead_code,
    passes.eliminate_common_subexpressions,
    passes.fold_constants,
    passes.simplify,
    passes.infer_shapes,
    passes.optimize,
]


@pytest.mark.parametrize("run", PASSES, ids=lambda p: p.__name__)
@given(graph=random_graphs(), seed=st.integers(0, 2**16))
def test_passes_keep_every_output_and_update_of_random_graphs(run, graph, seed):
    out = run(graph).verify()
    assert len(out.nodes) <= len(graph.nodes)
    _same_results(graph, out, _feeds(graph, seed))


@given(graph=random_graphs())
def test_optimize_reaches_a_fixed_point_and_keeps_only_known_sources(graph):
    out = passes.optimize(graph)
    assert passes.optimize(out) == out
    assert {n.source for n in out.nodes} <= {n.source for n in graph.nodes}
    # Pool shapes are tiny, so every node of constants must have been folded.
    for node in out.nodes:
        assert not node.inputs or not all(v.producer is not None and v.producer.op == "constant" for v in node.inputs)


# -- every op of the op database -------------------------------------------------------------------


def _twice_with_gradient(entry, sample):
    """The entry's op applied twice to the same inputs (work for CSE), plus input gradients when it has them."""
    graph, feeds = entry.make_graph(sample)
    inputs = graph.inputs or [graph]
    again = entry.apply(*inputs, **sample.attrs)
    for i, value in enumerate(v for v in (again if isinstance(again, (tuple, list)) else [again]) if v is not None):
        graph.output(f"again{i}", value)
    wrt = [graph.input(k) for k in entry.grad if k in sample.inputs and graph.input(k).dtype.is_float]
    floats = [v for v in graph.outputs.values() if v.dtype.is_float]
    if wrt and floats:
        loss = ops.reduce_sum(floats[0], axes=None, keepdims=False)
        for value, grad in zip(wrt, popir.autodiff.grad(graph, loss, wrt)):
            graph.output(f"grad_{value.name}", grad)
    return graph, feeds


def _with_constant_inputs(entry, sample):
    """The entry's op applied to constants holding the sample's arrays."""
    graph = popir.Graph(entry.name)
    consts = [graph.constant(array) for array in sample.inputs.values()]
    result = entry.apply(*(consts or [graph]), **sample.attrs)
    for i, value in enumerate(v for v in (result if isinstance(result, (tuple, list)) else [result]) if v is not None):
        graph.output(f"out{i}", value)
    return graph


@pytest.mark.parametrize("name", sorted(OPDB))
@settings(max_examples=min(settings.default.max_examples, 4))
@given(data=st.data())
def test_optimize_keeps_every_op_of_the_database(name, data):
    entry = OPDB[name]
    sample = data.draw(entry.samples())
    graph, feeds = _twice_with_gradient(entry, sample)
    optimized = passes.optimize(graph)
    assert len(optimized.nodes) <= len(graph.nodes)
    _same_results(graph, optimized, feeds)

    plain, _ = entry.make_graph(sample)
    expected = popir.interpreter.run(plain, feeds)
    folded = passes.optimize(_with_constant_inputs(entry, sample))
    for key, value in popir.interpreter.run(folded, {}).items():
        _assert_same(value, expected[key], f"folded output {key}")
