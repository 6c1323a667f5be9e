"""Index-driven composites and cumprod cost memory linear in their positions and indices (no value of the
built graph, gradients included, is positions x indices), and still match their NumPy meaning."""

import numpy as np
import pytest

import popir
from popir import ops

N = 512  # positions along the indexed axis (and indices), so a positions x indices value has N * N elements
WIDTH = 2


def _largest_value(graph):
    return max(v.type.size for node in graph.nodes for v in node.outputs)


def _build(make, differentiable):
    g = popir.Graph("g")
    x = g.add_input("x", (N, WIDTH), "float32")
    index = g.add_input("index", (N,), "int32")
    out = make(x, index)
    g.output("out", out)
    if differentiable:
        loss = ops.reduce_sum(out, axes=None, keepdims=False)
        (grad,) = popir.autodiff.grad(g, loss, [x])
        g.output("grad", grad)
    return g


def _scatter_index(index):
    return ops.broadcast_to(ops.reshape(index, shape=(N, 1)), shape=(N, WIDTH))


CASES = {
    "bincount": (lambda x, i: ops.cast(ops.bincount(i, N), dtype="float32"), False),
    "index_fill": (lambda x, i: ops.index_fill(x, 0, i, 1.0), True),
    "index_reduce_sum": (lambda x, i: ops.index_reduce(x, 0, i, x * 2.0, "sum"), True),
    "index_reduce_mean": (lambda x, i: ops.index_reduce(x, 0, i, x, "mean", include_self=False), True),
    "scatter_reduce_mean": (lambda x, i: ops.scatter_reduce(x, 0, _scatter_index(i), x, "mean"), True),
    "embedding_bag_sum": (lambda x, i: ops.embedding_bag(x, i, i, mode="sum"), True),
    "embedding_bag_mean": (lambda x, i: ops.embedding_bag(x, i, i, mode="mean"), True),
    "cumprod": (lambda x, i: ops.cumprod(x, 0), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_value_grows_as_positions_times_indices(name):
    make, differentiable = CASES[name]
    graph = _build(make, differentiable)
    assert _largest_value(graph) < 4 * N * WIDTH, graph.to_text()


def test_cumprod_scan_matches_numpy_with_zeros_and_signs():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.5, 1.5, (7, 3)).astype(np.float32)
    x[2, 1] = 0.0
    for axis in (0, 1):
        g = popir.Graph("g")
        g.output("out", ops.cumprod(g.add_input("x", x.shape, "float32"), axis))
        got = popir.interpreter.run(g, {"x": x})["out"]
        np.testing.assert_allclose(got, np.cumprod(x, axis=axis), rtol=1e-6, atol=1e-7)


def test_embedding_bag_with_empty_bags_sums_each_bag():
    weight = np.arange(12, dtype=np.float32).reshape(6, 2)
    indices = np.array([5, 0, 2, 2, 1], np.int32)
    offsets = np.array([0, 0, 3, 5], np.int32)  # bags: [], [5, 0, 2], [2, 1], []
    g = popir.Graph("g")
    w, i, o = (g.add_input(n, a.shape, str(a.dtype)) for n, a in (("w", weight), ("i", indices), ("o", offsets)))
    g.output("sum", ops.embedding_bag(w, i, o, mode="sum"))
    g.output("max", ops.embedding_bag(w, i, o, mode="max"))
    got = popir.interpreter.run(g, {"w": weight, "i": indices, "o": offsets})
    bags = [[], [5, 0, 2], [2, 1], []]
    want_sum = np.stack([weight[b].sum(0) if b else np.zeros(2, np.float32) for b in bags])
    want_max = np.stack([weight[b].max(0) if b else np.zeros(2, np.float32) for b in bags])
    np.testing.assert_array_equal(got["sum"], want_sum)
    np.testing.assert_array_equal(got["max"], want_max)
