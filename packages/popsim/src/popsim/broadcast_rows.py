"""How elementwise vertices read an operand broadcast over their output (a [C] bias over [N, C], a [N, 1]
row statistic over [N, C]) without the broadcast being materialised by exchange.

As popops' broadcast vertices (BroadcastVectorInner2D, BroadcastScalar2D) do, each tile receives the distinct
source elements its vertices read, once, and each block of the output is cut into *rows*: stretches over
which every broadcast operand's source element either steps by one (a contiguous slice of the tile's copy) or
stays the same (one element of it, which the vertex broadcasts). An operand broadcast over leading axes only
(a [C] bias over [N, C]) *repeats* instead: as popops' BroadcastVectorInner reads it, a whole block is one
vertex reading the tile's copy cyclically (``repeating_reads``), whatever N. NumPy only; the planner builds
the copies and vertices.
"""

from typing import NamedTuple

import numpy as np

from popsim.mapping import TileMapping

# A broadcast operand is read in rows only when its rows hold at least this many elements on average: shorter
# rows would cost more per-row set-up than the duplicated elements they save.
MIN_ROW_ELEMENTS = 8
# The share of an op's estimated exchange saving that rows must cover with their set-up cycles: the copy is
# exchanged in a phase with others, whose busiest tile need not be the one the op's saving relieves.
SAVING_SHARE = 0.5


def run_length(x_shape, shape):
    """(g, constant): the output's flat elements fall in aligned runs of ``g`` over which the source element of
    ``x_shape`` broadcast to ``shape`` is constant (``constant``) or steps by one."""
    padded = (1,) * (len(shape) - len(x_shape)) + tuple(x_shape)
    axes = [(a, o) for a, o in zip(padded, shape) if o != 1]
    if not axes:
        return 1, False
    constant = axes[-1][0] == 1
    g = 1
    for a, o in reversed(axes):
        if (a == 1) != constant:
            break
        g *= o
    return g, constant


def repeats(x_size, g, constant):
    """Whether an operand of ``x_size`` elements read with run length ``g`` (``run_length``) repeats: output
    element i reads its element i % g (it is broadcast over leading axes only)."""
    return not constant and x_size == g


def wraps(rows, period):
    """How often each row wraps an operand repeating every ``period`` output elements (its rows beyond the
    first, as a 2D broadcast vertex steps through them)."""
    return (rows.starts % period + rows.stops - rows.starts - 1) // period


class Rows(NamedTuple):
    """The rows of an output mapping: [starts, stops) of the flat output, the block of the mapping each lies
    in, and its tile."""

    starts: np.ndarray
    stops: np.ndarray
    block: np.ndarray
    tiles: np.ndarray


def cut_rows(mapping, runs):
    """``mapping``'s blocks cut at every multiple of each run length in ``runs``."""
    cuts = [mapping.starts, mapping.stops[-1:]] + [np.arange(0, mapping.size, g, dtype=np.int64) for g in runs]
    cuts = np.unique(np.concatenate(cuts))
    starts, stops = cuts[:-1], cuts[1:]
    block = mapping.block_of(starts)
    return Rows(starts, stops, block, mapping.tiles[block])


def may_repeat(g, constant, mapping):
    """Whether exchanging an operand broadcast with run length ``g`` (``run_length``) element by element into
    ``mapping`` could bring one of its elements to a tile twice. Not when its source steps by one over runs
    at least as long as every block and each tile holds one block: a block then reads a run's tail and the
    next run's head, whose elements differ (runs of distinct sources are ``g`` apart in the operand)."""
    if constant:
        return True
    one_block_per_tile = np.unique(mapping.tiles).size == mapping.tiles.size
    return not one_block_per_tile or int((mapping.stops - mapping.starts).max(initial=0)) > g


class TileCopies(NamedTuple):
    """An operand's copies on the tiles of its reader: ``index`` (the source element of each element of the
    copies, tile after tile, ascending source elements on each), their ``mapping``, and ``at``, the element of
    the copies each row starts reading at."""

    index: np.ndarray
    mapping: TileMapping
    at: np.ndarray


def tile_copies(index, rows, size, constant):
    """The distinct source elements each tile's rows read from a ``size``-element operand through the flat
    broadcast ``index`` map, once per tile (a ``constant`` operand's row reads one element)."""
    first = rows.tiles * size + index[rows.starts]
    if constant:
        keys = first
    else:
        keys = np.repeat(rows.tiles, rows.stops - rows.starts) * size + index
    distinct = np.unique(keys)
    tiles, counts = np.unique(distinct // size, return_counts=True)
    return TileCopies(distinct % size, TileMapping.on_tiles(counts, tiles), np.searchsorted(distinct, first))


def repeating_reads(copies, rows):
    """(first element, period, phase) of each row reading a repeating operand from its tile's copy (its
    ``tile_copies``): the row's output element j reads element (phase + j) % period of the tile's whole copy.
    The copy holds a tile's distinct source elements ascending; a row reads consecutive source elements, mod
    the operand's size, so consecutive ones lie side by side in the copy, and the operand's wrap from its last
    element to its first is the copy's wrap from its last element to its first."""
    block = np.searchsorted(copies.mapping.tiles, rows.tiles)
    first = copies.mapping.starts[block]
    return first, copies.mapping.stops[block] - first, copies.at - first


def held_copies(index, rows, size, g, mapping, runs):
    """The copies a *held* operand's rows read (one source element per aligned run of ``g`` output elements,
    the operand constant over each run: a [N, 1] row statistic over [N, C]), with ``at`` the copy element each
    row starts at; each row's successive runs read successive copy elements. A tile's copy holds its distinct
    source elements ascending where that order serves every row; otherwise (a channel operand whose block
    wraps to the next image) the elements its rows' runs read, in their order. ``rows`` are ``mapping`` cut at
    ``runs``."""
    runs_rows = cut_rows(mapping, [*runs, g])
    parent = np.searchsorted(rows.starts, runs_rows.starts, side="right") - 1
    first = np.r_[True, parent[1:] != parent[:-1]]
    step = (rows.starts[parent] % g + runs_rows.starts - rows.starts[parent]) // g
    copies = tile_copies(index, runs_rows, size, True)
    if (copies.at == copies.at[first][parent] + step).all():
        return TileCopies(copies.index, copies.mapping, copies.at[first])
    order = np.lexsort((runs_rows.starts, runs_rows.tiles))
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    tiles, counts = np.unique(runs_rows.tiles, return_counts=True)
    in_order = index[runs_rows.starts][order]
    return TileCopies(in_order, TileMapping.on_tiles(counts, tiles), position[first])
