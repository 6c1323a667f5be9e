"""A repeated layer (same shapes, dtypes and placements) reuses the matmul plan of its first instance, and the
reused plan gives exactly what a fresh plan gives: the same results, cycles and steps."""

import numpy as np

import popir
import popsim
from popir import ops
from popsim import planner

TARGET = popsim.Target.small(num_tiles=16)
BATCH, WIDTH, LAYERS = 6, 24, 3


def _stack():
    """LAYERS identical dense layers (matmul + relu), trained one SGD step, so the backward pass repeats too."""
    g = popir.Graph("stack")
    h = x = g.add_input("x", (BATCH, WIDTH), "float32")
    weights = [g.add_input(f"w{i}", (WIDTH, WIDTH), "float32", kind="parameter") for i in range(LAYERS)]
    for w in weights:
        h = ops.relu(h @ w)
    loss = ops.reduce_sum(h * h, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    for w, grad in zip(weights, popir.autodiff.grad(g, loss, weights)):
        g.output(f"grad_{w.name}", grad)
    return g, x, weights


def _compile_and_run(monkeypatch, reuse):
    planned = []
    plan = planner.Lowerer._plan_matmul
    monkeypatch.setattr(planner.Lowerer, "_plan_matmul", lambda self, *a: planned.append(1) or plan(self, *a))
    if not reuse:  # every key distinct: each matmul is planned from scratch
        monkeypatch.setattr(planner, "_index_key", lambda index: object())
    g, _, weights = _stack()
    exe = popsim.compile(g, TARGET)
    rng = np.random.default_rng(0)
    for w in weights:
        exe.write_variable(w.name, rng.normal(0, 0.3, (WIDTH, WIDTH)).astype(np.float32))
    feeds = {"x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32)}
    return exe.run(feeds), exe.profile.programs["stack"], len(planned), g, feeds, exe


def test_repeated_layers_reuse_the_plan_and_match_a_fresh_plan_exactly(monkeypatch):
    reused, reused_profile, reused_plans, g, feeds, exe = _compile_and_run(monkeypatch, reuse=True)
    monkeypatch.undo()
    fresh, fresh_profile, fresh_plans, *_ = _compile_and_run(monkeypatch, reuse=False)
    matmuls = sum(node.op == "matmul" for node in popir.passes.optimize(g).nodes)
    assert fresh_plans == matmuls and reused_plans < matmuls
    for name in fresh:
        np.testing.assert_array_equal(reused[name], fresh[name])
    assert reused_profile["steps"] == fresh_profile["steps"]
    assert reused_profile["total_cycles"] == fresh_profile["total_cycles"]
    want = popir.interpreter.run(g, {**feeds, **{w: exe.read_variable(w) for w in exe.variables}})
    for name, value in want.items():
        np.testing.assert_allclose(reused[name], value, rtol=1e-4, atol=1e-4)


def _reference_runs(srcs, index):
    """Rows read row by row: a scan of each row of ``index`` that starts a new row wherever the next element
    is not the next one of the same source tile block (blocks found by a search per element)."""
    offsets = np.cumsum([0] + [s.size for s in srcs])
    bases = np.cumsum([0] + [len(s.mapping.tiles) for s in srcs])

    def block(e):
        if e < 0 or e >= offsets[-1]:
            return -1
        i = int(np.searchsorted(offsets, e, side="right")) - 1
        return int(bases[i] + srcs[i].mapping.block_of(np.array([e - offsets[i]]))[0])

    rows = 0
    for row in index.reshape(-1, index.shape[-1]).tolist():
        rows += 1 + sum(b != a + 1 or block(b) != block(a) for a, b in zip(row, row[1:]))
    return rows


def test_the_run_counts_a_plan_compares_match_a_scan_of_each_row_and_of_each_column():
    """The transpose decision reads each element's block once for both directions: both counts equal a plain
    scan of the index map and of its transpose, over several sources with padding (-1) entries."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        dg = popsim.DeviceGraph(TARGET)
        srcs = []
        for n in rng.integers(1, 40, int(rng.integers(1, 4))).tolist():
            mapping = popsim.TileMapping.linear(n, 4, TARGET) if rng.random() < 0.5 else None
            if mapping is None:
                cuts = np.sort(rng.choice(np.arange(1, n), min(n - 1, 3), replace=False)) if n > 1 else []
                starts = np.r_[0, cuts].astype(np.int64)
                mapping = popsim.TileMapping(rng.integers(0, 16, starts.size), starts, np.r_[cuts, n], n)
            srcs.append(dg.add_tensor((n,), popir.DType.float32, mapping, f"s{len(srcs)}"))
        total = sum(s.size for s in srcs)
        shape = tuple(rng.integers(1, 6, 3).tolist())
        index = (
            rng.integers(-1, total, shape) if rng.random() < 0.5 else np.arange(np.prod(shape)).reshape(shape) % total
        )
        expected = (_reference_runs(srcs, index), _reference_runs(srcs, index.transpose(0, 2, 1)))
        assert planner._runs_both_ways(srcs, index) == expected


def test_an_index_maps_key_tells_apart_what_a_plan_depends_on():
    """Equal maps key alike however they are laid out in memory; another value, shape or dtype of the same
    bytes keys apart (a shared key reuses the plan)."""
    index = np.arange(24).reshape(2, 3, 4)
    view = np.arange(24).reshape(2, 4, 3).transpose(0, 2, 1)  # not C-contiguous
    assert planner._index_key(view) == planner._index_key(np.ascontiguousarray(view))
    assert planner._index_key(index) == planner._index_key(index.copy())
    changed = index.copy()
    changed[1, 2, 3] = -1
    assert planner._index_key(changed) != planner._index_key(index)
    assert planner._index_key(index.reshape(4, 3, 2)) != planner._index_key(index)
    assert planner._index_key(index.view(np.float64)) != planner._index_key(index)
    assert planner._index_key(np.zeros((0, 3), np.int64)) != planner._index_key(np.zeros((3, 0), np.int64))
