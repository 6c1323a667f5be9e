"""The engine: coalesced exchange runs, threads sharing a phase's rows, and out-of-range dynamic indices."""

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import popir
import popsim
from popir import ops
from popsim import _exchange, _kernels
from popsim import _opcodes as oc
from popsim._arena import TileArena

OVERSUBSCRIBED_THREADS = 8


def _expand(rows):
    """The (src, dst) byte offset of every element a list of copy_run rows moves."""
    pairs = [
        (src + k * outer + j * stride, dst + (k * count + j) * isz)
        for src, dst, count, stride, isz, reps, outer in rows
        for k in range(reps)
        for j in range(count)
    ]
    return np.array(pairs, np.int64).reshape(-1, 2)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-8, 8), st.integers(1, 9)), min_size=0, max_size=12))
def test_copy_runs_move_exactly_the_given_elements(segments):
    src, dst, at = [], [], 0
    for start, step, count in segments:
        src += [4 * (start + step * j + 64) for j in range(count)]
        dst += [4 * (at + j) for j in range(count)]
        at += count + (start % 3 == 0)  # sometimes a gap in the destination
    src, dst = np.array(src, np.int64), np.array(dst, np.int64)
    rows = _exchange.copy_runs(src, dst, 4)
    np.testing.assert_array_equal(_expand(rows), np.stack([src, dst], axis=1).reshape(-1, 2))
    assert len(rows) <= max(len(segments), 0) + sum(c for _, _, c in segments) // 2 + 1


def _run_exchange(memory, rows, compact=False):
    """``memory`` (any dtype) after one EXCHANGE phase of ``rows`` runs in the engine; with ``compact``, the
    rows split as a Copy's are (an EXCHANGE phase, then a RUNS phase of the compact rows)."""
    arena = TileArena(1, memory.nbytes)
    view = np.frombuffer(arena.buffer, memory.dtype)
    view[:] = memory
    phases = np.array([[oc.PHASES["EXCHANGE"], 0, len(rows), 0]], np.int64)
    runs = None
    if compact:
        rows, runs = _exchange.split_rows(rows)
        isz = memory.itemsize
        phases = np.array([[oc.PHASES["EXCHANGE"], 0, len(rows), 0], [oc.PHASES["RUNS"], 0, len(runs), isz]])
    no_rows = np.zeros((0, oc.NCOLS), np.int64)
    streams = (np.zeros((0, len(oc.STREAM_ROW_COLUMNS)), np.int64), np.zeros((0, len(oc.STREAM_COLUMNS)), np.int64))
    _kernels.run_program(
        arena,
        phases,
        np.zeros(len(phases), np.int64),
        no_rows,
        np.zeros(0),
        np.ascontiguousarray(rows),
        np.zeros(0, np.int64),
        *streams,
        np.zeros(0, np.uint8),
        runs=runs,
    )
    return view.copy()


SOURCES = 1024  # the first source element of the copies below; destinations are all before it
SIGNALING_NAN = np.array(0x7F800001, np.uint32).view(np.float32)  # quiet-bit clear: a float64 trip changes it


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-8, 8), st.integers(1, 40)), min_size=1, max_size=12))
def test_the_engine_runs_copy_rows_exactly_as_element_copies(segments):
    # Runs of every shape the rows take (contiguous, strided, a broadcast element, repeated blocks) move
    # each element's bits to exactly where an element-by-element copy puts them.
    src, dst, at = [], [], 0
    for start, step, count in segments:
        src += [start + step * j + SOURCES for j in range(count)]  # sources never overlap destinations
        dst += [at + j for j in range(count)]
        at += count + (start % 3 == 0)
    memory = np.arange(2 * SOURCES, dtype=np.float32)
    memory[:SOURCES] = 0
    memory[SOURCES + 8] = SIGNALING_NAN
    rows = _exchange.copy_runs(np.array(src, np.int64) * 4, np.array(dst, np.int64) * 4, 4)
    expected = memory.copy()
    expected[dst] = memory[src]
    assert _run_exchange(memory, rows).tobytes() == expected.tobytes()


WIDE_SOURCES = 4096  # beyond every destination and every source's reach below it in the test that follows


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.int32, np.float32, np.int64])
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([0, 0, 1, -1, 3, 17]), st.integers(1, 70), st.integers(1, 4)),
        min_size=1,
        max_size=8,
    )
)
def test_broadcast_and_strided_rows_move_every_dtype_s_bits_as_element_copies(dtype, segments):
    # Each segment repeats a run ``reps`` times from sources one element further on: broadcast runs (step 0,
    # filled from one read) of every length, strided and contiguous ones, whose sources overlap one another.
    src, dst = [], []
    for start, step, count, reps in segments:
        for k in range(reps):
            src += [start + k + step * j + WIDE_SOURCES for j in range(count)]
            dst += [len(dst) + j for j in range(count)]
    rng = np.random.default_rng(len(src))
    memory = rng.integers(0, 256, 2 * WIDE_SOURCES * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    memory[:WIDE_SOURCES] = 0
    isz = np.dtype(dtype).itemsize
    rows = _exchange.copy_runs(np.array(src, np.int64) * isz, np.array(dst, np.int64) * isz, isz)
    expected = memory.copy()
    expected[dst] = memory[src]
    assert _run_exchange(memory, rows).tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32])
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([0, 1, -1, 3, 17]), st.integers(1, 40), st.integers(1, 3)),
        min_size=1,
        max_size=8,
    )
)
def test_compact_rows_move_the_same_bytes_as_the_rows_they_replace(dtype, segments):
    # Random exchanges (broadcast, strided, contiguous runs, some repeated) run once as copy rows only and
    # once split as a Copy's are: the rows of one repetition as compact rows of a RUNS phase.
    src, dst, at = [], [], 0
    for start, step, count, reps in segments:
        for k in range(reps):
            src += [start + 5 * k + step * j + WIDE_SOURCES for j in range(count)]
            dst += [at + j for j in range(count)]
            at += count + (start % 4 == 0)  # sometimes a gap
    rng = np.random.default_rng(len(src))
    memory = rng.integers(0, 256, 2 * WIDE_SOURCES * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    isz = np.dtype(dtype).itemsize
    rows = _exchange.copy_runs(np.array(src, np.int64) * isz, np.array(dst, np.int64) * isz, isz)
    general, runs = _exchange.split_rows(rows)
    assert len(general) + len(runs) == len(rows) and (general[:, oc.COPY_COLUMNS.index("reps")] > 1).all()
    assert _run_exchange(memory, rows, compact=True).tobytes() == _run_exchange(memory, rows).tobytes()


def test_copy_runs_move_a_window_in_one_two_dimensional_row():
    # A 3-wide window taken from 4 image rows of pitch 10: one row of 4 repetitions of a 3-element run.
    src = np.array([4 * (10 * r + c) for r in range(4) for c in range(3)], np.int64)
    dst = np.arange(12, dtype=np.int64) * 4
    rows = _exchange.copy_runs(src, dst, 4)
    assert rows.tolist() == [[0, 0, 3, 4, 4, 4, 40]]


def test_copy_runs_move_a_transposed_block_in_one_row():
    # dst (3, 5) = src (5, 3).T: every destination row is a column of the source (stride 12 bytes).
    src = (np.arange(15).reshape(5, 3).T.reshape(-1) * 4).astype(np.int64)
    dst = np.arange(15, dtype=np.int64) * 4
    rows = _exchange.copy_runs(src, dst, 4)
    assert rows.tolist() == [[0, 0, 5, 12, 4, 3, 4]]
    np.testing.assert_array_equal(_expand(rows), np.stack([src, dst], axis=1))


def _cnn_graph():
    g = popir.Graph("cnn")
    x = g.add_input("x", (4, 3, 12, 12), "float32")
    w = g.add_input("w", (8, 3, 3, 3), "float32", kind="parameter")
    y = ops.relu(ops.conv2d(x, w, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1))
    g.output("y", ops.reduce_sum(y * y, axes=(1, 2, 3), keepdims=False))
    return g


def test_threads_give_bit_identical_results():
    """One thread, two, and more threads than this machine has cores (the waits then give their core away)."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32)}
    weights = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    results = []
    for threads in (1, 2, OVERSUBSCRIBED_THREADS):
        exe = popsim.compile(_cnn_graph(), "ipu2")
        exe.num_threads = threads
        exe.write_variable("w", weights)
        results.append(exe.run(feeds)["y"])
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)
    expected = popir.interpreter.run(_cnn_graph(), {**feeds, "w": weights})["y"]
    np.testing.assert_allclose(results[0], expected, rtol=1e-5)


def test_thread_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPSIM_NUM_THREADS", "3")
    assert popsim.executable.default_threads() == 3
    monkeypatch.setenv("POPSIM_NUM_THREADS", "zero")
    with pytest.raises(popsim.Error, match="POPSIM_NUM_THREADS"):
        popsim.executable.default_threads()


def test_an_out_of_range_gather_index_is_an_error_not_a_crash():
    g = popir.Graph("g")
    table = g.add_input("table", (5, 3), "float32")
    index = g.add_input("index", (4,), "int32")
    g.output("rows", ops.gather(table, index, axis=0))
    exe = popsim.compile(g, popsim.Target.small())
    values = np.arange(15, dtype=np.float32).reshape(5, 3)
    ok = exe.run({"table": values, "index": np.array([0, 4, -1, 2], np.int32)})["rows"]
    np.testing.assert_array_equal(ok, values[[0, 4, -1, 2]])
    with pytest.raises(popsim.Error, match="1 gather/scatter index"):
        exe.run({"table": values, "index": np.array([0, 5, 1, 2], np.int32)})
    with pytest.raises(popsim.Error, match="2 gather/scatter index"):
        exe.run({"table": values, "index": np.array([-6, 1000000, 1, 2], np.int32)})


@pytest.mark.parametrize("op", ["take_along_axis", "scatter_add"])
def test_an_index_beyond_its_axis_is_an_error_even_when_its_flat_position_exists(op):
    # Index 5 on an axis of 4 would address row 1's second element through the flat offset 0 * 4 + 5.
    g = popir.Graph("g")
    x = g.add_input("x", (3, 4), "float32")
    index = g.add_input("index", (3, 1), "int32")
    upd = g.add_input("upd", (3, 1), "float32")
    if op == "take_along_axis":
        g.output("y", ops.take_along_axis(x, index, axis=1) + upd)
    else:
        g.output("y", ops.scatter_add(x, index, upd, axis=1))
    exe = popsim.compile(g, popsim.Target.small())
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "upd": np.ones((3, 1), np.float32)}
    exe.run({**feeds, "index": np.array([[3], [0], [-4]], np.int32)})
    with pytest.raises(popsim.Error, match="1 gather/scatter index"):
        exe.run({**feeds, "index": np.array([[5], [0], [1]], np.int32)})
    with pytest.raises(popsim.Error, match="2 gather/scatter index"):
        exe.run({**feeds, "index": np.array([[100], [-5], [1]], np.int32)})


def test_an_executable_round_trips_through_bytes_with_its_variables_and_runs_alike():
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32)}
    exe = popsim.compile(_cnn_graph(), "ipu2")
    exe.write_variable("w", rng.standard_normal((8, 3, 3, 3)).astype(np.float32))
    clone = popsim.Executable.from_bytes(exe.to_bytes())
    np.testing.assert_array_equal(clone.read_variable("w"), exe.read_variable("w"))
    np.testing.assert_array_equal(clone.run(feeds)["y"], exe.run(feeds)["y"])
    assert clone.profile.programs == exe.profile.programs
    with pytest.raises(TypeError, match="to_bytes"):
        pickle.dumps(exe)


ONE_TILE = popsim.Target.small(num_tiles=1, tile_bytes=1 << 20)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_where_with_a_scalar_operand_copies_the_bits_of_its_choice(dtype):
    g = popir.Graph("where")
    cond = g.add_input("c", (37,), "bool")
    x = g.add_input("x", (37,), dtype)
    s = g.add_input("s", (), dtype)
    g.output("x_or_s", ops.where(cond, x, s))
    g.output("s_or_x", ops.where(cond, s, x))
    rng = np.random.default_rng(0)
    c = rng.random(37) < 0.5
    xv = rng.standard_normal(37).astype(np.float32)
    xv[3] = SIGNALING_NAN
    xv = xv.view(np.int32) if dtype == "int32" else xv
    sv = np.array(SIGNALING_NAN).view(np.int32) if dtype == "int32" else SIGNALING_NAN
    got = popsim.compile(g, ONE_TILE).run({"c": c, "x": xv, "s": sv})
    assert got["x_or_s"].tobytes() == np.where(c, xv, sv).tobytes()
    assert got["s_or_x"].tobytes() == np.where(c, sv, xv).tobytes()


def _row_reduction(x, op):
    """A row-by-row reduction in index order with a float64 running value (the vertex's own order)."""
    acc = np.full(x.shape[0], {"sum": 0.0, "max": -np.inf, "min": np.inf}[op])
    step = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]  # NaN propagates
    for column in x.T.astype(np.float64):
        acc = step(acc, column)
    return acc.astype(np.float32)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_float32_rows_reduce_side_by_side_exactly_as_one_at_a_time(op):
    rows, group = 11, 23  # two blocks of four rows and three rows left over
    g = popir.Graph("reduce")
    x = g.add_input("x", (rows, group), "float32")
    reduce = {"sum": ops.reduce_sum, "max": ops.reduce_max, "min": ops.reduce_min}[op]
    g.output("y", reduce(x, axes=(1,), keepdims=False))
    rng = np.random.default_rng(1)
    xv = (rng.standard_normal((rows, group)) * 10.0 ** rng.integers(-6, 6, (rows, group))).astype(np.float32)
    xv[2, 5], xv[9, 0], xv[5, 7] = np.nan, np.inf, -np.inf
    got = popsim.compile(g, ONE_TILE).run({"x": xv})["y"]
    assert got.tobytes() == _row_reduction(xv, op).tobytes()


def _ascending_k_product(a, b):
    """a @ b with every element summing its float32 products in ascending k from zero (the vertex's order)."""
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for kk in range(a.shape[1]):
        out = out + a[:, kk : kk + 1] * b[kk : kk + 1, :]
    return out


# Column groups of 8 over strips of up to 8 rows, a zero-padded tail of 1-7 columns (on the stack and, past
# 256 rows of b, on the heap), 4 leftover columns, and blocks of too few rows to pad the tail.
@pytest.mark.parametrize(
    "m,k,n",
    [
        (9, 16, 8),
        (23, 32, 16),
        (16, 26, 15),
        (6, 45, 5),
        (16, 37, 20),
        (17, 300, 3),
        (2, 85, 3),
        (1, 13, 1),
        (5, 28, 22),
    ],
)
def test_a_tile_s_matrix_product_sums_in_ascending_k_whatever_its_shape(m, k, n):
    g = popir.Graph("mm")
    x = g.add_input("x", (m, k), "float32")
    w = g.add_input("w", (k, n), "float32")
    g.output("y", ops.matmul(x, w))
    rng = np.random.default_rng(m * 1000 + k)
    a = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 3, (m, k))).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = popsim.compile(g, ONE_TILE).run({"x": a, "w": b})["y"]
    assert got.tobytes() == _ascending_k_product(a, b).tobytes()
