"""Repeated layers' reductions reuse the (row, tile) pairs and parts planned for their first instance
(``Lowerer._reused_local_pairs``, keyed on the index map's content and the sources' sizes, placements and
dtypes), and the executable is byte for byte the one planned afresh for every reduction."""

import numpy as np

import popir
import popsim
from popir import ops
from popsim import planner

# Few tiles with large blocks, so each tile holds several elements of a reduction's rows.
TARGET = popsim.Target.small(num_tiles=4)
BATCH, WIDTH, LAYERS = 16, 24, 3


def _layers():
    """LAYERS identical layers each normalising its activations over the batch (reductions over axis 0), with
    the weights' gradients, so the backward pass's reductions repeat too."""
    g = popir.Graph("layers")
    h = g.add_input("x", (BATCH, WIDTH), "float32")
    weights = [g.add_input(f"w{i}", (WIDTH, WIDTH), "float32", kind="parameter") for i in range(LAYERS)]
    for w in weights:
        h = h @ w
        h = ops.relu(h - ops.reduce_sum(h, axes=(0,), keepdims=True) * (1.0 / BATCH))
    loss = ops.reduce_sum(h * h, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    for w, grad in zip(weights, popir.autodiff.grad(g, loss, weights)):
        g.output(f"grad_{w.name}", grad)
    return g


def _compile(monkeypatch, reuse):
    """The executable of ``_layers`` and how many reductions' pairs were worked out."""
    planned = []
    local_pairs = planner.Lowerer._local_pairs
    monkeypatch.setattr(planner.Lowerer, "_local_pairs", lambda self, *a: planned.append(1) or local_pairs(self, *a))
    if not reuse:  # every key distinct: each reduction is planned from scratch
        monkeypatch.setattr(planner, "_index_key", lambda index: object())
    return popsim.compile(_layers(), TARGET), len(planned)


def test_repeated_reductions_reuse_their_pairs_and_compile_to_the_same_bytes(monkeypatch):
    reused, reused_count = _compile(monkeypatch, reuse=True)
    monkeypatch.undo()
    fresh, fresh_count = _compile(monkeypatch, reuse=False)
    assert reused_count < fresh_count
    assert reused.to_bytes() == fresh.to_bytes()
    rng = np.random.default_rng(0)
    for name, t in reused.variables.items():
        value = rng.normal(0, 0.3, t.shape).astype(np.float32)
        reused.write_variable(name, value)
        fresh.write_variable(name, value)
    feeds = {"x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32)}
    got = reused.run(feeds)
    want = popir.interpreter.run(_layers(), {**feeds, **{n: reused.read_variable(n) for n in reused.variables}})
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(got[name], fresh.run(feeds)[name])


def test_a_reused_plans_arrays_are_read_only():
    """A plan shared by several reductions cannot be changed through one of them."""
    lw = planner.Lowerer(popsim.DeviceGraph(TARGET))
    x = lw.new((64, 16), popir.DType.float32)
    index = np.arange(x.size).reshape(64, 16).T  # x's columns: each tile holds 16 elements of each
    grain = max(64, TARGET.min_bytes_per_tile // 4)
    out = popsim.TileMapping.linear(16, 4, TARGET)
    pairs = lw._reused_local_pairs([x], index, out, grain, 1)
    assert pairs is not None and pairs is lw._reused_local_pairs([x], index.copy(), out, grain, 1)
    assert not any(array.flags.writeable for array in pairs)
