"""A matmul whose M, N or K does not divide into its plan's blocks runs the smaller block at the edge (the
vertex's own m, k and n) instead of exchanging zero padding to fill it: no operand copy reads the one-element
zero constant, the edge vertices are smaller, and results equal NumPy."""

import numpy as np
import pytest

import popir
import popsim
from popsim import planner
from popsim import program as popsim_program

TARGET = popsim.Target.small(num_tiles=16)


@pytest.fixture
def compiled(monkeypatch):
    """Compile a graph recording the sources of each matmul operand Copy and each matmul plan."""
    copies, plans = [], []
    copy, layout = popsim_program._Flattener.copy, planner.Lowerer._matmul_layout

    def record_copy(self, step):
        if step.name.startswith("matmul-"):
            copies.append([(s.size, s.category) for s in step.srcs])
        return copy(self, step)

    def record_layout(self, *args):
        plans.append(layout(self, *args))
        return plans[-1]

    monkeypatch.setattr(popsim_program._Flattener, "copy", record_copy)
    monkeypatch.setattr(planner.Lowerer, "_matmul_layout", record_layout)
    return lambda g: (popsim.compile(g, TARGET), copies, plans)


@pytest.mark.parametrize(("m", "k", "n"), [(37, 29, 23), (5, 131, 3), (61, 7, 50)])
def test_edge_blocks_are_run_smaller_without_zero_padding(compiled, m, k, n):
    g = popir.Graph("mm")
    a = g.add_input("a", (m, k), "float32")
    b = g.add_input("b", (k, n), "float32")
    g.output("y", a @ b)
    exe, copies, plans = compiled(g)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((m, k)).astype(np.float32), "b": rng.standard_normal((k, n)).astype(np.float32)}
    np.testing.assert_allclose(exe.run(feeds)["y"], feeds["a"] @ feeds["b"], rtol=1e-5, atol=1e-5)
    assert copies and all(("constant" not in {c for size, c in srcs if size == 1}) for srcs in copies), copies
    (plan,) = plans
    split = plan.split
    full = np.array([split.mb, split.kb, split.nb])
    # Some task is an edge block (these shapes do not divide), and it is run at its own size.
    assert (plan.sizes < full).any(), (split, plan.sizes)
    assert plan.a_tasks.size == (plan.sizes[:, 0] * plan.sizes[:, 1]).sum()
    assert plan.b_tasks.size == (plan.sizes[:, 1] * plan.sizes[:, 2]).sum()
    assert (plan.a_tasks >= 0).all() and (plan.b_tasks >= 0).all()
