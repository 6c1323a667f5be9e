"""Compile-time helpers of the reduction planner (planner.Lowerer._local_pairs): one pass over a reduction's
elements where NumPy needs a sort."""

import numpy as np

from popsim._types cimport offset_t


def row_tile_pairs(const offset_t[::1] tile, Py_ssize_t group):
    """The (row, tile) pairs of a reduction whose element i, of row ``i // group``, lies on tile ``tile[i]``,
    numbered by tile, then row (as ``np.unique`` of ``tile * rows + row`` numbers them): each element's pair and
    its place among its pair's elements in index order, and each pair's tile, row and element count. None when
    no tile holds two elements of one row (found before the per-element arrays are made)."""
    cdef Py_ssize_t n = tile.shape[0], i, r, p, num_pairs = 0
    cdef offset_t t, num_tiles
    if group <= 0 or n % group:
        raise ValueError(f"{n} elements do not make rows of {group}")
    if n and np.min(tile) < 0:
        raise ValueError(f"an element lies on tile {np.min(tile)}")
    num_tiles = np.max(tile) + 1 if n else 0
    last = np.full(num_tiles, -1, np.int64)  # per tile: the latest row seen holding an element there
    first = np.zeros(num_tiles + 1, np.int64)  # per tile: its first pair's number (pairs per tile, at first)
    pair_of, rank = np.empty(n, np.int64), np.empty(n, np.int64)
    cdef offset_t[::1] last_v = last, first_v = first, pair_v = pair_of, rank_v = rank
    with nogil:
        # A tile's pairs are numbered row after row, after those of every lower tile.
        for i in range(n):
            t, r = tile[i], i // group
            if last_v[t] != r:
                last_v[t] = r
                first_v[t + 1] += 1
                num_pairs += 1
        for t in range(num_tiles):
            first_v[t + 1] += first_v[t]
            last_v[t] = -1
    if num_pairs == n:
        return None
    pair_tile, pair_row = np.empty(num_pairs, np.int64), np.empty(num_pairs, np.int64)
    counts = np.zeros(num_pairs, np.int64)
    cdef offset_t[::1] tile_v = pair_tile, row_v = pair_row, count_v = counts
    cdef offset_t[::1] current = np.empty(num_tiles, np.int64)  # per tile: the number of its pair in this row
    with nogil:
        for i in range(n):
            t, r = tile[i], i // group
            if last_v[t] != r:
                last_v[t] = r
                current[t] = first_v[t]
                first_v[t] += 1
                tile_v[current[t]], row_v[current[t]] = t, r
            p = current[t]
            pair_v[i], rank_v[i] = p, count_v[p]
            count_v[p] += 1
    return pair_of, rank, pair_tile, pair_row, counts
