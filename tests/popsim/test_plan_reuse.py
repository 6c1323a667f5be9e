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
