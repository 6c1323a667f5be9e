"""The tile allocator's kernels. First fit: each tile's live blocks are the first slots of its row, by address.

One call places one storage on many tiles; per tile it frees the blocks dead by the storage's first step,
scans the rest in address order for the first gap that holds the storage, and inserts the new block there,
all in the tile's own short row instead of array operations over every tile's blocks. ``place_by_size`` places
a program's blocks, whose steps are all known, largest first on each tile (see TileAllocator.place_all).
"""

from popsim._types cimport offset_t


def place(offset_t[:, ::1] start, offset_t[:, ::1] end, offset_t[:, ::1] last, offset_t[:, ::1] owner,
          offset_t[::1] count, const offset_t[::1] tiles, const offset_t[::1] need, offset_t first,
          offset_t last_step, offset_t owner_id, offset_t[::1] offsets):
    """Place a block of ``need[i]`` bytes on each tile ``tiles[i]`` (distinct), live to ``last_step`` and owned
    by ``owner_id``, writing its offset to ``offsets[i]``. A tile's row holds ``count[tile]`` live blocks
    sorted by start, and the caller leaves at least one free slot after them."""
    cdef Py_ssize_t i, j, k, n, t
    cdef offset_t at
    with nogil:
        for i in range(tiles.shape[0]):
            t = tiles[i]
            n = 0
            for j in range(count[t]):  # blocks dead by now are freed on the tiles this placement touches
                if last[t, j] >= first:
                    start[t, n], end[t, n], last[t, n], owner[t, n] = start[t, j], end[t, j], last[t, j], owner[t, j]
                    n += 1
            # First fit: the first gap before a block that holds the need, else after the highest block.
            at = 0
            j = 0
            while j < n and start[t, j] - at < need[i]:
                if end[t, j] > at:
                    at = end[t, j]
                j += 1
            for k in range(n, j, -1):
                start[t, k], end[t, k], last[t, k], owner[t, k] = start[t, k - 1], end[t, k - 1], last[t, k - 1], owner[t, k - 1]
            start[t, j], end[t, j], last[t, j], owner[t, j] = at, at + need[i], last_step, owner_id
            count[t] = n + 1
            offsets[i] = at


def place_by_size(const offset_t[:, ::1] start, const offset_t[:, ::1] end, const offset_t[::1] count,
                  const offset_t[::1] tile, const offset_t[::1] need, const offset_t[::1] first,
                  const offset_t[::1] last, offset_t[::1] offsets, offset_t[::1] ps, offset_t[::1] pe,
                  offset_t[::1] pf, offset_t[::1] pl):
    """Place blocks known in advance: entry e is ``need[e]`` bytes on ``tile[e]`` live from step ``first[e]``
    to ``last[e]``, the entries grouped by tile and each group in placement order (largest first). Each goes
    at the lowest offset clear of its tile's resident blocks (the first ``count[tile]`` of its ``start`` /
    ``end`` row, by address, live throughout) and of the group's blocks placed before it whose steps overlap
    its own. ``ps`` / ``pe`` / ``pf`` / ``pl``: scratch for the largest group, kept sorted by start."""
    cdef Py_ssize_t e = 0, g, j, k, m, r, n = tile.shape[0]
    cdef offset_t t, at, s, stop
    with nogil:
        while e < n:
            t = tile[e]
            m = 0
            g = e
            while g < n and tile[g] == t:
                # First fit over the resident blocks and the placed ones that overlap in time, merged by start.
                at = 0
                r = 0
                j = 0
                while True:
                    while j < m and (pf[j] > last[g] or pl[j] < first[g]):
                        j += 1
                    if r < count[t] and (j >= m or start[t, r] <= ps[j]):
                        s, stop = start[t, r], end[t, r]
                        r += 1
                    elif j < m:
                        s, stop = ps[j], pe[j]
                        j += 1
                    else:
                        break
                    if s - at >= need[g]:
                        break
                    if stop > at:
                        at = stop
                offsets[g] = at
                k = m
                while k > 0 and ps[k - 1] > at:
                    ps[k], pe[k], pf[k], pl[k] = ps[k - 1], pe[k - 1], pf[k - 1], pl[k - 1]
                    k -= 1
                ps[k], pe[k], pf[k], pl[k] = at, at + need[g], first[g], last[g]
                m += 1
                g += 1
            e = g
