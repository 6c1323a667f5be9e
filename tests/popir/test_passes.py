"""popir.passes: one hand-written case per rewrite, and random graphs that every pass must leave equivalent."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def _same_results(before, after, feeds):
    out_b, state_b = popir.interpreter.step(before, feeds)
    out_a, state_a = popir.interpreter.step(after, feeds)
    assert out_b.keys() == out_a.keys() and state_b.keys() == state_a.keys()
    for name in out_b:
        assert out_b[name].dtype == out_a[name].dtype
        np.testing.assert_array_equal(out_a[name], out_b[name], err_msg=f"output {name}")
    for name in state_b:
        np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=f"update of {name}")


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
    for b, needs in ((_select, ("where", "gt")), (_cast, ("cast",)), (_matmul, ("matmul",)))
    if set(needs) <= set(AVAILABLE)
]


@st.composite
def random_graphs(draw):
    """A random graph over the registered ops, with outputs, a state update and sometimes a gradient."""
    g = popir.Graph("random")
    pool = [g.add_input("x", (2, 3), F32), g.add_input("y", (3,), F32)]
    g.add_input("unused", (2,), "int32")
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
