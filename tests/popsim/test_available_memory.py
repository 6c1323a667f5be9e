"""The available-memory proportion (Poplar's availableMemoryProportion) bounds a matmul plan's temporary
tile memory: a lower proportion gives a plan with a lower peak, at the cost of cycles, and the same numbers."""

import numpy as np
import pytest

import popir
import popsim
from popir import DType
from popsim.matmul_plan import plan_matmul

TARGET = popsim.Target.small(num_tiles=16, tile_bytes=65_536)
SIZE = 64


def _matmul_graph(annotated=None):
    g = popir.Graph("mm")
    a = g.add_input("a", (SIZE, SIZE), "float32")
    b = g.add_input("b", (SIZE, SIZE), "float32")
    y = popir.ops.matmul(a, b)
    y.producer.available_memory = annotated
    g.output("y", y)
    return g


def _run(graph, **options):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((SIZE, SIZE)).astype(np.float32) for _ in range(2))
    exe = popsim.compile(graph, target=TARGET, **options)
    out = exe.run({"a": a, "b": b})["y"]
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)
    profile = exe.profile.programs["mm"]
    return profile["memory_max_tile_bytes"], profile["total_cycles"]


def test_a_lower_proportion_plans_less_temporary_memory_and_more_cycles():
    roomy = plan_matmul(TARGET, 1, SIZE, SIZE, SIZE, DType.float32, DType.float32, 1.0)
    tight = plan_matmul(TARGET, 1, SIZE, SIZE, SIZE, DType.float32, DType.float32, 0.1)
    assert tight.memory < roomy.memory and tight.cycles > roomy.cycles
    assert tight.memory > 0.1 * TARGET.tile_bytes  # too low: the least-memory plan, as Poplar replans


def test_the_per_ipu_proportion_lowers_the_compiled_peak_with_the_same_numbers():
    roomy_peak, roomy_cycles = _run(_matmul_graph(), available_memory={0: 1.0})
    tight_peak, tight_cycles = _run(_matmul_graph(), available_memory={0: 0.1})
    assert tight_peak < roomy_peak and tight_cycles > roomy_cycles


def test_a_node_proportion_overrides_its_ipus():
    per_ipu = _run(_matmul_graph(), available_memory={0: 0.1})
    node_wins = _run(_matmul_graph(annotated=1.0), available_memory={0: 0.1})
    assert node_wins[0] > per_ipu[0]


@pytest.mark.parametrize(
    "available_memory, message",
    [({0: 1.5}, "from 0 to 1, got 1.5"), ({0: "half"}, "got 'half'"), ({1: 0.5}, "IPU 1 is not an IPU")],
)
def test_invalid_proportions_are_refused(available_memory, message):
    with pytest.raises(popsim.Error, match=message):
        popsim.compile(_matmul_graph(), target=TARGET, available_memory=available_memory)


def test_gradient_matmuls_inherit_the_proportion_of_their_forward_matmul():
    g = _matmul_graph(annotated=0.1)
    a, b = g.inputs
    loss = popir.ops.reduce_sum(g.outputs["y"], axes=(0, 1), keepdims=False)
    popir.autodiff.grad(g, loss, [a, b])
    backward = [n for n in g.nodes if n.op == "matmul" and n.role == "backward"]
    assert len(backward) == 2 and {n.available_memory for n in backward} == {0.1}
