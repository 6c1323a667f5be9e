"""Identical operands reach a tile once: a matmul reads the transposes, reshapes and broadcasts between it and
its operands as views (no copy of their own), a weight broadcast over the batch is one (batch * M) x K
product, and a batched product summed over the batch (that weight's gradient) folds the batch into K. Each
operand element then reaches a destination tile at most once per copy, and results equal NumPy."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import planner
from popsim import program as popsim_program

TARGET = popsim.Target.small(num_tiles=16)
B, M, K, N = 6, 5, 8, 7


def _repeats(flattener, step):
    """Elements of ``step`` (a Copy) delivered to a destination tile that copy already delivered them to; a
    block's zero padding (read from a one-element constant) is not an operand element."""
    src_tile = np.concatenate([flattener._addresses(s)[1] for s in step.srcs])[step.index]
    padding = np.concatenate([np.full(s.size, s.size == 1 and s.category == "constant") for s in step.srcs])
    m = step.dst.storage.mapping
    dst_tile = np.repeat(m.tiles, m.stops - m.starts)
    across = (src_tile != dst_tile) & ~padding[step.index]
    pairs = popsim_program._storage_elements(step)[across] * TARGET.num_tiles + dst_tile[across]
    return pairs.size - np.unique(pairs).size


@pytest.fixture
def compiled(monkeypatch):
    """Compile a graph recording each Copy's (name, repeated elements) and each matmul's index map shapes."""
    copies, products = [], []
    copy, matmul_index = popsim_program._Flattener.copy, planner.Lowerer.matmul_index

    def record_copy(self, step):
        copies.append((step.name, _repeats(self, step) if step.dst.size else 0))
        return copy(self, step)

    def record_matmul(self, a_srcs, a_index, b_srcs, b_index, dtype):
        products.append((a_index.shape, b_index.shape))
        return matmul_index(self, a_srcs, a_index, b_srcs, b_index, dtype)

    monkeypatch.setattr(popsim_program._Flattener, "copy", record_copy)
    monkeypatch.setattr(planner.Lowerer, "matmul_index", record_matmul)
    return lambda g: (popsim.compile(g, TARGET), copies, products)


def _broadcast_weight_graph():
    """y = x @ broadcast(w) over the batch, and dL/dw for L = sum(y * c): a batched product summed over it."""
    g = popir.Graph("bcast")
    x = g.add_input("x", (B, M, K), "float32")
    c = g.add_input("c", (B, M, N), "float32")
    w = g.add_input("w", (K, N), "float32", kind="parameter")
    y = ops.matmul(x, ops.broadcast_to(w, shape=(B, K, N)))
    loss = ops.reduce_sum(y * c, axes=(0, 1, 2), keepdims=False)
    g.output("y", y)
    (grad,) = popir.autodiff.grad(g, loss, [w])
    g.output("grad_w", grad)
    return g


def test_a_weight_broadcast_over_the_batch_is_read_once_and_its_gradient_is_one_product(compiled):
    exe, copies, products = compiled(_broadcast_weight_graph())
    rng = np.random.default_rng(0)
    w = rng.normal(size=(K, N)).astype(np.float32)
    feeds = {"x": rng.normal(size=(B, M, K)).astype(np.float32), "c": rng.normal(size=(B, M, N)).astype(np.float32)}
    exe.write_variable("w", w)
    out = exe.run(feeds)
    np.testing.assert_allclose(out["y"], feeds["x"] @ w, rtol=1e-5, atol=1e-5)
    want = np.einsum("bmk,bmn->kn", feeds["x"], feeds["c"])
    np.testing.assert_allclose(out["grad_w"], want, rtol=1e-5, atol=1e-4)
    # The forward product is one (B*M) x K x N matmul; the gradient one K x (B*M) x N matmul.
    assert ((1, B * M, K), (1, K, N)) in products
    assert ((1, K, B * M), (1, B * M, N)) in products
    assert all(a[0] == 1 for a, _ in products), products
    # Nothing materialises the broadcast weight, and no copy delivers an element to a tile twice.
    assert not [name for name, _ in copies if name == "broadcast"]
    assert [(name, n) for name, n in copies if n] == []


def test_a_transpose_keeping_the_last_axis_is_read_in_place_by_its_matmul(compiled):
    """(S, B, K) -> (B, S, K) keeps each row contiguous: the matmul gathers its blocks straight from x."""
    g = popir.Graph("seq_first")
    x = g.add_input("x", (M, B, K), "float32")
    w = g.add_input("w", (B, K, N), "float32")
    g.output("y", ops.matmul(ops.transpose(x, perm=(1, 0, 2)), w))
    exe, copies, _ = compiled(g)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.normal(size=(M, B, K)).astype(np.float32), "w": rng.normal(size=(B, K, N)).astype(np.float32)}
    np.testing.assert_allclose(exe.run(feeds)["y"], feeds["x"].transpose(1, 0, 2) @ feeds["w"], rtol=1e-5, atol=1e-5)
    assert "transpose" not in [name for name, _ in copies]


def test_a_transpose_of_the_last_axis_is_still_gathered_before_its_matmul(compiled):
    """A view whose rows are not runs of consecutive elements would be read element by element: it is
    gathered into a tensor of its own first, as before."""
    g = popir.Graph("transposed")
    a = g.add_input("a", (K, M), "float32")
    b = g.add_input("b", (K, N), "float32")
    g.output("y", ops.matmul(ops.transpose(a, perm=(1, 0)), b))
    exe, copies, _ = compiled(g)
    rng = np.random.default_rng(2)
    feeds = {"a": rng.normal(size=(K, M)).astype(np.float32), "b": rng.normal(size=(K, N)).astype(np.float32)}
    np.testing.assert_allclose(exe.run(feeds)["y"], feeds["a"].T @ feeds["b"], rtol=1e-5, atol=1e-5)
    assert "transpose" in [name for name, _ in copies]


def test_a_state_read_through_a_view_is_not_overwritten_in_place_before_its_matmul_reads_it(compiled):
    """The view of ``w`` is made before ``w``'s update and read by a matmul after it: the matmul must see the
    old ``w`` (the update may not write ``w`` in place before the view's reader runs)."""
    g = popir.Graph("update")
    x = g.add_input("x", (B, M, K), "float32")
    w = g.add_input("w", (K, N), "float32", kind="parameter")
    seen = ops.broadcast_to(w, shape=(B, K, N))
    g.update(w, w * g.constant(np.float32(0.5)))
    g.output("y", ops.matmul(x, seen))
    exe, _, _ = compiled(g)
    rng = np.random.default_rng(3)
    w0, feeds = rng.normal(size=(K, N)).astype(np.float32), {"x": rng.normal(size=(B, M, K)).astype(np.float32)}
    exe.write_variable("w", w0)
    np.testing.assert_allclose(exe.run(feeds)["y"], feeds["x"] @ w0, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(exe.read_variable("w"), w0 * np.float32(0.5))


@pytest.mark.parametrize("axes, keepdims", [((1,), False), ((0,), True), ((0, 1), False)])
def test_a_product_summed_over_some_batch_axes_is_one_matmul_per_kept_batch_index(compiled, axes, keepdims):
    g = popir.Graph("summed")
    a = g.add_input("a", (2, 3, M, K), "float32")
    b = g.add_input("b", (2, 3, K, N), "float32")
    g.output("y", ops.reduce_sum(ops.matmul(a, b), axes=axes, keepdims=keepdims))
    exe, _, products = compiled(g)
    rng = np.random.default_rng(5)
    feeds = {
        "a": rng.normal(size=(2, 3, M, K)).astype(np.float32),
        "b": rng.normal(size=(2, 3, K, N)).astype(np.float32),
    }
    want = np.sum(feeds["a"] @ feeds["b"], axis=axes, keepdims=keepdims)
    np.testing.assert_allclose(exe.run(feeds)["y"], want, rtol=1e-5, atol=1e-4)
    summed = int(np.prod([(2, 3)[i] for i in axes]))
    assert products == [((6 // summed, M, summed * K), (6 // summed, summed * K, N))]
