"""An operand broadcast over its output's leading axes only (a [C] bias over [N, C]) is read *repeating*, as
popops' BroadcastVectorInner reads it: each tile receives the operand's distinct elements once, and each block
of the output is one vertex reading that copy cyclically (output element j reads copy element
(phase + j) % period), whatever N. An operand constant over aligned runs (a [N, 1] row statistic over [N, C])
is read *held*, as BroadcastVectorOuter reads it: element j reads copy element (phase + j) // period. The
vertex state is of fixed size (the period and phase beside its fields), the results are bit for bit those of
the operand exchanged already broadcast, and the exchange moves fewer bytes than that broadcast would."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import ops
from popsim import _opcodes as oc
from popsim import broadcast_rows
from popsim.mapping import TileMapping

TARGET = popsim.Target.small(num_tiles=4)
DTYPES = ("float32", "float16", "int32")


def _graph(shape, operand, dtype, op, statistic=None):
    """``op`` of x and a parameter b of shape ``operand``, and with a ``statistic`` shape, an input s of that
    shape in the same vertex (a row statistic beside the bias, as a layer norm's)."""
    g = popir.Graph("repeat")
    x = g.add_input("x", shape, dtype)
    b = g.add_input("b", operand, dtype, kind="parameter")
    if statistic is not None:
        x = x - g.add_input("s", statistic, dtype)
    if op == "add":
        g.output("y", x + b)
    elif op == "maximum":
        g.output("y", ops.maximum(b, x))  # the repeating operand first (field a)
    elif op == "where":
        g.output("y", ops.where(ops.gt(x, b), b, x))  # repeating in two fields of one vertex
    else:  # a fused expression reading b twice
        g.output("y", (x * b) - b)
    return g


def _values(rng, shape, dtype):
    if dtype == "int32":
        return rng.integers(-50, 50, shape).astype(np.int32)
    return rng.standard_normal(shape).astype(dtype)


# Where b sits: a [C] bias (repeating), a [N, 1] statistic (held), a [C] bias beside a [N, 1] statistic.
LAYOUTS = ("repeating", "held", "both")


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=2),
    st.integers(8, 40),
    st.sampled_from([2, 3, 4, 7]),
    st.sampled_from(DTYPES),
    st.sampled_from(["add", "maximum", "where", "fused"]),
    st.sampled_from(LAYOUTS),
    st.integers(0, 2**16),
)
def test_repeating_and_held_operands_give_the_bits_of_the_broadcast_operand_and_numpy(
    lead, c, tiles, dtype, op, layout, seed
):
    shape = (*lead, 3, c)
    operand = (*lead, 3, 1) if layout == "held" else (c,)
    statistic = (*lead, 3, 1) if layout == "both" else None
    target = popsim.Target.small(num_tiles=tiles, min_bytes_per_tile=8)
    rng = np.random.default_rng(seed)
    feeds, bias = {"x": _values(rng, shape, dtype)}, _values(rng, operand, dtype)
    if statistic:
        feeds["s"] = _values(rng, statistic, dtype)
    exe = popsim.compile(_graph(shape, operand, dtype, op, statistic), target)
    exe.write_variable("b", bias)
    got = exe.run(feeds)["y"]
    whole_feeds = {**feeds, "s": np.ascontiguousarray(np.broadcast_to(feeds["s"], shape))} if statistic else feeds
    whole = popsim.compile(_graph(shape, shape, dtype, op, statistic and shape), target)
    whole.write_variable("b", np.ascontiguousarray(np.broadcast_to(bias, shape)))
    assert got.tobytes() == whole.run(whole_feeds)["y"].tobytes()
    want = popir.interpreter.run(_graph(shape, operand, dtype, op, statistic), {**feeds, "b": bias})["y"]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-3)


def _random_mapping(rng, size, tiles):
    """``size`` elements in random blocks on random tiles (several blocks per tile, in any order)."""
    cuts = np.unique(np.r_[0, rng.integers(0, size + 1, rng.integers(0, 12)), size])
    return TileMapping.on_tiles(np.diff(cuts), rng.integers(0, tiles, cuts.size - 1))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.integers(1, 5), st.integers(0, 2**16))
def test_each_row_reads_its_source_elements_cyclically_from_its_tile_s_copy(lead, period, tiles, seed):
    """Against NumPy's broadcast: for any mapping (partial copies included, where a block reads a stretch
    that wraps the operand), a row's output element j reads copy element first + (phase + j) % period, and
    that holds the source element the broadcast puts there."""
    rng = np.random.default_rng(seed)
    shape = (lead, period)
    index = np.broadcast_to(np.arange(period), shape).reshape(-1)
    mapping = _random_mapping(rng, index.size, tiles)
    rows = broadcast_rows.cut_rows(mapping, [])
    copies = broadcast_rows.tile_copies(index, rows, period, False)
    first, length, phase = broadcast_rows.repeating_reads(copies, rows)
    assert ((0 <= phase) & (phase < length)).all()
    for r in range(len(rows.starts)):
        j = np.arange(rows.stops[r] - rows.starts[r])
        read = copies.index[first[r] + (phase[r] + j) % length[r]]
        np.testing.assert_array_equal(read, index[rows.starts[r] : rows.stops[r]])
    want_wraps = (rows.starts % period + rows.stops - rows.starts - 1) // period
    np.testing.assert_array_equal(broadcast_rows.wraps(rows, period), want_wraps)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8), st.integers(1, 6), st.integers(1, 12), st.integers(1, 5), st.booleans(), st.integers(0, 2**16)
)
def test_each_row_reads_its_held_elements_in_order_from_its_tile_s_copy(lead, size, run, tiles, stat, seed):
    """Against NumPy's broadcast of a row statistic [lead, size, 1] (or a channel operand [1, size, 1], whose
    blocks may wrap to the next image) over [lead, size, run], for any mapping: a row's output element j reads
    copy element at + (phase + j) // run, holding the source element the broadcast puts there; a row
    statistic reaches each tile once."""
    rng = np.random.default_rng(seed)
    x_shape = (lead, size, 1) if stat else (1, size, 1)
    index = np.broadcast_to(np.arange(int(np.prod(x_shape))).reshape(x_shape), (lead, size, run)).reshape(-1)
    mapping = _random_mapping(rng, index.size, tiles)
    rows = broadcast_rows.cut_rows(mapping, [])
    copies = broadcast_rows.held_copies(index, rows, int(np.prod(x_shape)), run, mapping, [])
    for r in range(len(rows.starts)):
        j = np.arange(rows.stops[r] - rows.starts[r])
        read = copies.index[copies.at[r] + (rows.starts[r] % run + j) // run]
        np.testing.assert_array_equal(read, index[rows.starts[r] : rows.stops[r]])
    if stat:
        keys = np.repeat(copies.mapping.tiles, copies.mapping.stops - copies.mapping.starts) * index.size
        assert np.unique(keys + copies.index).size == copies.index.size


def _compiled(n, c=40):
    g = _graph((n, c), (c,), "float32", "add")
    return popsim.compile(g, TARGET).profile.programs["repeat"]


def test_a_repeating_vertex_s_state_is_fixed_whatever_the_rows_of_its_block():
    """On 4 tiles each block is one vertex (3 fields and the period and phase) however many [C] rows it
    holds: the state is as documented and does not grow with N."""
    want = 8 + 4 * 3 + 4 * oc.REPEAT_STATE_WORDS
    for n in (16, 64):
        profile = _compiled(n)
        assert profile["memory"]["vertex_state"] == [want] * TARGET.num_tiles
        (add,) = [s for s in profile["steps"] if s["name"] == "add"]
        assert add["vertices"] == TARGET.num_tiles


def _exchange_bytes(profile):
    return sum(s["bytes"] for s in profile["steps"] if s["kind"] == "exchange")


def test_a_repeating_operand_is_exchanged_once_per_tile_not_broadcast(monkeypatch):
    """The bias reaches each tile at most once (its 40 elements), where without the repeating form the
    operand is exchanged broadcast into the output's blocks (each tile its block's size)."""
    n, c = 64, 40
    repeating = _exchange_bytes(_compiled(n, c))
    assert repeating <= TARGET.num_tiles * c * 4
    monkeypatch.setattr(broadcast_rows, "repeats", lambda *_: False)
    broadcast = _exchange_bytes(_compiled(n, c))
    assert repeating < broadcast and broadcast >= (TARGET.num_tiles - 1) * n * c // TARGET.num_tiles * 4 - c * 4


def test_a_phase_outside_its_period_is_refused():
    dg = popsim.DeviceGraph(TARGET)
    x = dg.add_tensor((8,), popir.DType.float32, TileMapping.on_tiles([8], [0]), "x")
    out = dg.add_tensor((8,), popir.DType.float32, TileMapping.on_tiles([8], [0]), "out")
    cs = dg.add_compute_set("add")
    with pytest.raises(popsim.Error, match="phase"):
        oc.elementwise(
            dg.add_vertices, cs, "add", [0], [8], [1], operands=[x.regions([0], [4]), x.regions([0], [8])],
            out=out.regions([0], [8]), scalars=1 << oc.REPEAT_SHIFT, period=[4], phase=[4],
        )  # fmt: skip
