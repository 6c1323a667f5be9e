"""Runtime-index gathers and scatters on tables larger than a tile: sliced over tiles, same results."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops

ROWS, DIM = 4000, 64  # a 1 MB float32 table: more than one tile holds


def _run(g, feeds):
    return popsim.compile(g, "ipu2").run(feeds), popir.interpreter.run(g, feeds)


def _check_lookup(rows, idx_shape, seed):
    """Embedding-style lookups (gather along axis 0 with negative indices too) agree with the interpreter."""
    g = popir.Graph("emb")
    table = g.add_input("table", (rows, DIM), "float32")
    idx = g.add_input("idx", idx_shape, "int32")
    g.output("y", ops.gather(table, idx, axis=0))
    rng = np.random.default_rng(seed)
    feeds = {
        "table": rng.standard_normal((rows, DIM)).astype(np.float32),
        "idx": rng.integers(-rows, rows, idx_shape).astype(np.int32),
    }
    got, want = _run(g, feeds)
    np.testing.assert_array_equal(got["y"], want["y"])


def test_embedding_lookup_of_a_table_larger_than_a_tile():
    _check_lookup(ROWS, (8, 16), seed=0)


def test_take_along_axis_and_scatter_add_on_a_large_table():
    g = popir.Graph("scatter")
    table = g.add_input("table", (ROWS, DIM), "float32")
    idx = g.add_input("idx", (12, DIM), "int32")
    upd = g.add_input("upd", (12, DIM), "float32")
    g.output("picked", ops.take_along_axis(table, idx, axis=0))
    g.output("added", ops.scatter_add(table, idx, upd, axis=0))
    rng = np.random.default_rng(1)
    feeds = {
        "table": rng.standard_normal((ROWS, DIM)).astype(np.float32),
        "idx": rng.integers(0, ROWS, (12, DIM)).astype(np.int32),
        "upd": rng.standard_normal((12, DIM)).astype(np.float32),
    }
    got, want = _run(g, feeds)
    np.testing.assert_array_equal(got["picked"], want["picked"])
    np.testing.assert_allclose(got["added"], want["added"], rtol=1e-6, atol=1e-6)


def test_out_of_range_index_into_a_sliced_table_is_an_error():
    g = popir.Graph("emb")
    table = g.add_input("table", (ROWS, DIM), "float32")
    idx = g.add_input("idx", (4,), "int32")
    g.output("y", ops.gather(table, idx, axis=0))
    exe = popsim.compile(g, "ipu2")
    feeds = {"table": np.zeros((ROWS, DIM), np.float32), "idx": np.array([0, 1, ROWS, 2], np.int32)}
    with pytest.raises(popsim.IndexRangeError, match="1 gather/scatter index") as caught:
        exe.run(feeds)
    assert caught.value.count == 1


@pytest.mark.parametrize("rows", [1000, ROWS])
def test_a_lookup_whose_output_is_larger_than_a_tile_is_cut_into_chunks(rows):
    # 64 x 48 lookups of 64 floats: a 786 KB result, from a table that fits one tile and from one that does not.
    _check_lookup(rows, (64, 48), seed=2)


def test_a_gather_along_an_inner_axis_of_a_large_table():
    g = popir.Graph("cols")
    table = g.add_input("table", (DIM, ROWS), "float32")
    idx = g.add_input("idx", (5,), "int32")
    g.output("y", ops.gather(table, idx, axis=1))
    rng = np.random.default_rng(3)
    feeds = {
        "table": rng.standard_normal((DIM, ROWS)).astype(np.float32),
        "idx": np.array([0, 3999, -1, 7, 2000], np.int32),
    }
    got, want = _run(g, feeds)
    np.testing.assert_array_equal(got["y"], want["y"])


def _embedding_grad_graph(rows, dim, n, widened=False):
    """The embedding backward as popir differentiates a lookup: scatter_add of n gradient rows at the row
    indices broadcast over the row width (``widened``: the same scatter with [n, dim] indices fed as such)."""
    g = popir.Graph("embedding_grad")
    table = g.add_input("table", (rows, dim), "float32")
    idx = g.add_input("idx", (n, dim) if widened else (n,), "int32")
    grad = g.add_input("grad", (n, dim), "float32")
    at = idx if widened else ops.broadcast_to(ops.reshape(idx, shape=(n, 1)), shape=(n, dim))
    g.output("added", ops.scatter_add(table, at, grad, axis=0))
    return g


def _embedding_grad_feeds(rows, dim, n, seed=3):
    rng = np.random.default_rng(seed)
    return {
        "table": rng.standard_normal((rows, dim)).astype(np.float32),
        "idx": rng.integers(-rows, rows, n).astype(np.int32),
        "grad": rng.standard_normal((n, dim)).astype(np.float32),
    }


SMALL = popsim.Target.small(num_tiles=16, tile_bytes=65_536)


@pytest.mark.parametrize(
    "target, rows, dim, n",
    [(SMALL, 256, 64, 128), (popsim.Target.ipu2(), 1024, 128, 512)],
    ids=["small", "bert-tiny-embedding"],
)
def test_embedding_backward_spreads_its_indices_and_updates_over_tiles(target, rows, dim, n):
    """Indices and updates larger than a quarter tile are cut into chunks on tiles of their own (as
    multiUpdateAdd spreads them) instead of sitting whole beside each table slice, which ran out of memory;
    the running sum steps from chunk to chunk, so the result is the interpreter's to the bit."""
    g = _embedding_grad_graph(rows, dim, n)
    exe = popsim.compile(g, target)
    feeds = _embedding_grad_feeds(rows, dim, n)
    np.testing.assert_array_equal(exe.run(feeds)["added"], popir.interpreter.run(g, feeds)["added"])
    # No tile holds more than a quarter tile of the updates (the only tensors of their size: the row indices
    # are never widened to the row width).
    for tensor in exe.profile.programs[g.name]["tensors"]:
        if tensor["bytes"] == n * dim * 4:
            assert max(per_tile for _, _, per_tile in tensor["tile_runs"]) <= target.tile_bytes // 4, tensor["name"]


def test_embedding_backward_adds_whole_rows_at_row_indices():
    """The backward's broadcast row indices reach the scatter as [n] indices and its vertices add whole rows
    (Poplar's multiUpdateAdd): the same bits as the scatter of the widened [n, dim] indices, with less memory
    and fewer cycles."""
    rows, dim, n = 256, 64, 128
    feeds = _embedding_grad_feeds(rows, dim, n)
    want = popir.interpreter.run(_embedding_grad_graph(rows, dim, n), feeds)["added"]
    figures = {}
    for widened in (False, True):
        exe = popsim.compile(_embedding_grad_graph(rows, dim, n, widened), SMALL)
        wide = dict(feeds, idx=np.repeat(feeds["idx"][:, None], dim, axis=1)) if widened else feeds
        np.testing.assert_array_equal(exe.run(wide)["added"], want)
        profile = exe.profile.programs["embedding_grad"]
        figures[widened] = profile["memory_max_tile_bytes"], profile["memory_total_bytes"], profile["total_cycles"]
    assert all(rows_ < wide for rows_, wide in zip(figures[False], figures[True])), figures


def test_row_scatter_adds_rows_longer_than_a_vertex_block():
    """Whole-row adds of rows wider than the vertex's block buffers (a mixture of experts' gradient of its
    gathered expert matrices): added block by block, the interpreter's bits, nothing written past the buffers
    (which overran the stack and crashed the process)."""
    rows, dim, n = 4, 1100, 6
    feeds = _embedding_grad_feeds(rows, dim, n)
    exe = popsim.compile(_embedding_grad_graph(rows, dim, n), SMALL)
    want = popir.interpreter.run(_embedding_grad_graph(rows, dim, n), feeds)["added"]
    np.testing.assert_array_equal(exe.run(feeds)["added"], want)


def test_broadcast_row_indices_read_elsewhere_too_are_still_widened():
    g = popir.Graph("embedding_grad")
    table = g.add_input("table", (16, 8), "float32")
    idx = g.add_input("idx", (6,), "int32")
    grad = g.add_input("grad", (6, 8), "float32")
    at = ops.broadcast_to(ops.reshape(idx, shape=(6, 1)), shape=(6, 8))
    g.output("added", ops.scatter_add(table, at, grad, axis=0))
    g.output("at", at)
    feeds = _embedding_grad_feeds(16, 8, 6)
    got, want = popsim.compile(g, SMALL).run(feeds), popir.interpreter.run(g, feeds)
    np.testing.assert_array_equal(got["added"], want["added"])
    np.testing.assert_array_equal(got["at"], want["at"])


@pytest.mark.parametrize("widened", [False, True], ids=["row-indices", "widened"])
def test_out_of_range_index_in_a_chunked_scatter_is_an_error(widened):
    g = _embedding_grad_graph(256, 64, 128, widened)
    exe = popsim.compile(g, SMALL)
    idx = np.zeros(128, np.int32)
    idx[77] = 256  # in a middle chunk
    feeds = {"table": np.zeros((256, 64), np.float32), "grad": np.ones((128, 64), np.float32)}
    feeds["idx"] = np.repeat(idx[:, None], 64, axis=1) if widened else idx
    count = 64 if widened else 1
    with pytest.raises(popsim.IndexRangeError, match=f"{count} gather/scatter index") as caught:
        exe.run(feeds)
    # Once per bad index the scatter reads (a row index, or each element of a widened one), not per slice.
    assert caught.value.count == count
