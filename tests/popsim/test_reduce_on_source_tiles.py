"""A reduction whose source tiles hold several elements of an output row reduces them there first, as
popops::reduce does, when that costs fewer cycles by estimate: only partials are exchanged, at most one per
(row, source tile), never the elements themselves, and no element is sent twice.
Results equal NumPy's (sums at float tolerance, max/min exactly)."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import program as popsim_program

# Few tiles with large blocks, so each tile holds many elements of every output row.
NUM_TILES = 4
TARGET = popsim.Target.small(num_tiles=NUM_TILES)
REDUCE = {"sum": (ops.reduce_sum, np.sum), "max": (ops.reduce_max, np.max), "min": (ops.reduce_min, np.min)}


@pytest.fixture
def compiled(monkeypatch):
    """Compile a graph, recording each Copy's (name, source elements it sends across tiles, pairs sent twice,
    dtype)."""
    copies = []
    copy = popsim_program._Flattener.copy

    def record(self, step):
        if step.dst.size:
            src_tile = np.concatenate([self._addresses(s)[1] for s in step.srcs])[step.index]
            m = step.dst.storage.mapping
            across = src_tile != np.repeat(m.tiles, m.stops - m.starts)
            sent = popsim_program._storage_elements(step)[across]
            pairs = sent * self.target.num_tiles + np.repeat(m.tiles, m.stops - m.starts)[across]
            copies.append((step.name, int(across.sum()), pairs.size - np.unique(pairs).size, step.dst.dtype))
        return copy(self, step)

    monkeypatch.setattr(popsim_program._Flattener, "copy", record)
    return lambda g: (popsim.compile(g, TARGET), copies)


def _run(compiled, op, shape, axes, dtype):
    g = popir.Graph("reduce")
    x = g.add_input("x", shape, dtype)
    g.output("y", REDUCE[op][0](x, axes=axes, keepdims=False))
    exe, copies = compiled(g)
    xv = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    return xv, exe.run({"x": xv})["y"], copies


# (shape, axes): columns of a row-major matrix (a bias gradient: every tile holds a share of every column),
# rows of it (each row whole on one tile: read in place), and two axes of three.
CASES = {"columns": ((48, 40), (0,)), "rows": ((48, 40), (1,)), "outer": ((6, 9, 16), (0, 2))}


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("case", CASES)
def test_only_partials_cross_tiles_and_results_equal_numpy(compiled, op, case):
    shape, axes = CASES[case]
    xv, got, copies = _run(compiled, op, shape, axes, "float32")
    want = REDUCE[op][1](xv, axis=axes)
    if op == "sum":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert got.tobytes() == want.tobytes()
    rows = got.size
    across = sum(n for name, n, *_ in copies if name.startswith("reduce"))
    # At most one partial per (row, source tile); sending the elements would cross ~3/4 of x.size.
    assert across <= rows * NUM_TILES < xv.size * 3 // 4, copies
    assert all(twice == 0 for _, _, twice, _ in copies), copies


def test_rows_held_whole_by_a_tile_are_reduced_where_they_are(compiled):
    _, _, copies = _run(compiled, "sum", (48, 40), (1,), "float32")
    assert not [name for name, *_ in copies if name == "reduce-local"], copies


def test_float16_sums_keep_float32_partials(compiled):
    xv, got, copies = _run(compiled, "sum", (64, 24), (0,), "float16")
    assert got.dtype == np.float16
    assert {str(dtype) for name, _, _, dtype in copies if name == "reduce-gather"} == {"float32"}, copies
    np.testing.assert_allclose(got, xv.astype(np.float64).sum(axis=0), rtol=2e-3, atol=2e-3)


def test_rows_spread_one_element_per_tile_keep_the_one_stage_plan(compiled):
    # Each column of a (4, 64) matrix has one element per tile: partials would save nothing.
    xv, got, copies = _run(compiled, "sum", (NUM_TILES, 64), (0,), "float32")
    np.testing.assert_allclose(got, xv.sum(axis=0), rtol=1e-5, atol=1e-5)
    assert [name for name, *_ in copies if name.startswith("reduce")] == ["reduce-gather"], copies
