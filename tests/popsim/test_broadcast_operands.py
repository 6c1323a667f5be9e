"""Identical operands reach a tile once: an elementwise op whose operand is broadcast over its output (a [C]
bias over [N, C], a [N, 1] row statistic over [N, C], a [1, C, 1, 1] channel scale over an image batch) sends
each tile the distinct operand elements its vertices read, once, and reads them in rows (a contiguous slice,
or one element the vertex broadcasts) instead of exchanging the repeated operand element by element. Results
equal those of the same program given the operand already broadcast, bit for bit (the arithmetic is unchanged),
and NumPy's at float tolerance. An operand broadcast over leading axes only is read repeating, and a row
statistic held, one vertex per block (tests/popsim/test_repeating_operands.py); rows that would add vertices
are not chosen (their state would stay resident for the whole program), so on these targets the other
operands are still exchanged whole."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import broadcast_rows
from popsim import program as popsim_program
from popsim.mapping import TileMapping

# Few tiles with large blocks, so a block spans several rows of the broadcast operand.
TARGET = popsim.Target.small(num_tiles=4)


def _pairs_sent_twice(flattener, step):
    """(source element, destination tile) pairs ``step`` (a Copy) delivers across tiles more than once."""
    src_tile = np.concatenate([flattener._addresses(s)[1] for s in step.srcs])[step.index]
    m = step.dst.storage.mapping
    dst_tile = np.repeat(m.tiles, m.stops - m.starts)
    across = src_tile != dst_tile
    pairs = popsim_program._storage_elements(step)[across] * flattener.target.num_tiles + dst_tile[across]
    return pairs.size - np.unique(pairs).size


@pytest.fixture
def compiled(monkeypatch):
    """Compile a graph, recording each Copy's (name, pairs sent twice)."""
    copies = []
    copy = popsim_program._Flattener.copy

    def record(self, step):
        copies.append((step.name, _pairs_sent_twice(self, step) if step.dst.size else 0))
        return copy(self, step)

    monkeypatch.setattr(popsim_program._Flattener, "copy", record)
    return lambda g: (popsim.compile(g, TARGET), copies)


CASES = {
    "bias over rows": ((48, 40), (40,)),
    "row statistic": ((48, 40), (48, 1)),
    "channel scale": ((4, 6, 5, 7), (1, 6, 1, 1)),
    "middle axis": ((6, 9, 16), (6, 1, 16)),
}
# The cases whose operand a block's one vertex reads repeating (broadcast over leading axes only) or held
# (constant over aligned runs, successive runs reading successive elements).
ONE_VERTEX = ("bias over rows", "row statistic")


def _graph(shape, operand, fused):
    g = popir.Graph("bias")
    x = g.add_input("x", shape, "float32")
    b = g.add_input("b", operand, "float32", kind="parameter")
    y = x + b
    # A second op reading b through a chain the lowering fuses into one expression vertex.
    g.output("y", y)
    if fused:
        g.output("z", ops.exp(x * b) - b)
    return g


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_a_broadcast_operand_reaches_each_tile_once_and_results_are_exact(compiled, case, fused):
    shape, operand = CASES[case]
    g = _graph(shape, operand, fused)
    exe, copies = compiled(g)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    exe.write_variable("b", rng.standard_normal(operand).astype(np.float32))
    got = exe.run(feeds)
    bias = exe.read_variable("b")
    whole = popsim.compile(_graph(shape, shape, fused), TARGET)
    whole.write_variable("b", np.ascontiguousarray(np.broadcast_to(bias, shape)))
    same = whole.run(feeds)
    want = popir.interpreter.run(g, {**feeds, "b": bias})
    for name in want:
        np.testing.assert_array_equal(got[name], same[name], err_msg=name)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if case in ONE_VERTEX:
        # One vertex per block reads the tile's copy in order: no element reaches a tile twice.
        assert copies and not any(twice for _, twice in copies), copies
    else:
        # Rows that would add vertices (resident state for the whole program) are not chosen: these blocks
        # span several rows, so the operand is exchanged into the output's blocks as before.
        assert copies and any(twice for _, twice in copies), copies


def _repeats_whole(operand, shape, mapping):
    """Whether exchanging ``operand`` broadcast to ``shape`` element by element into ``mapping`` brings some
    element to a tile twice."""
    index = np.broadcast_to(np.arange(int(np.prod(operand))).reshape(operand), shape).reshape(-1)
    keys = np.repeat(mapping.tiles, mapping.stops - mapping.starts) * index.size + index
    return np.unique(keys).size < keys.size


def test_the_whole_broadcast_would_repeat_elements_on_these_targets():
    """The cases above do exercise rows: exchanged element by element, each would bring some operand element
    to a tile twice (and ``may_repeat`` says so)."""
    for shape, operand in CASES.values():
        mapping = TileMapping.linear(int(np.prod(shape)), 4, TARGET)
        assert _repeats_whole(operand, shape, mapping)
        assert broadcast_rows.may_repeat(*broadcast_rows.run_length(operand, shape), mapping)


@pytest.mark.parametrize("num_tiles", [4, 16, 64])
@pytest.mark.parametrize(("shape", "operand"), [((48, 40), (40,)), ((6, 9, 16), (6, 1, 16)), ((64, 32), (32,))])
def test_may_repeat_is_never_wrong_when_it_says_no(num_tiles, shape, operand):
    mapping = TileMapping.linear(int(np.prod(shape)), 4, popsim.Target.small(num_tiles=num_tiles))
    if not broadcast_rows.may_repeat(*broadcast_rows.run_length(operand, shape), mapping):
        assert not _repeats_whole(operand, shape, mapping)


@pytest.mark.parametrize(
    ("x_shape", "shape", "want"),
    [
        ((40,), (48, 40), (40, False)),
        ((48, 1), (48, 40), (40, True)),
        ((1, 6, 1, 1), (4, 6, 5, 7), (35, True)),
        ((6, 1, 16), (6, 9, 16), (16, False)),
        ((1, 1, 6), (3, 1, 4, 6), (6, False)),
    ],
)
def test_run_length_says_over_which_output_runs_the_source_element_is_constant_or_steps(x_shape, shape, want):
    assert broadcast_rows.run_length(x_shape, shape) == want
    g, constant = want
    index = np.broadcast_to(np.arange(int(np.prod(x_shape))).reshape(x_shape), shape).reshape(-1, g)
    step = 0 if constant else 1
    assert (np.diff(index, axis=1) == step).all()


@pytest.mark.parametrize(("shape", "operand", "rows_pay"), [((64, 8), (64, 1), False), ((16, 64), (16, 1), True)])
def test_rows_are_chosen_only_when_their_set_up_costs_less_than_the_exchange_they_save(shape, operand, rows_pay):
    """On 32 tiles of 32-element blocks: an [N, 1] operand over rows of 8 would cut each block into 4 rows to
    save 28 elements of exchange, which the estimate says costs more than it saves, so the operand is
    exchanged whole as before; over rows of 64 each block is one row reading one element, which pays."""
    copies = []
    copy = popsim_program._Flattener.copy
    target = popsim.Target.small(num_tiles=32)

    def record(self, step):
        copies.append(_pairs_sent_twice(self, step) if step.dst.size else 0)
        return copy(self, step)

    g = _graph(shape, operand, fused=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(popsim_program._Flattener, "copy", record)
        exe = popsim.compile(g, target)
    rng = np.random.default_rng(0)
    x, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(operand).astype(np.float32)
    exe.write_variable("b", b)
    np.testing.assert_array_equal(exe.run({"x": x})["y"], x + b)
    assert (max(copies) == 0) == rows_pay, copies
