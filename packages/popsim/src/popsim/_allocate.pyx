"""The tile allocator's first-fit kernel: each tile's live blocks are the first slots of its row, by address.

One call places one storage on many tiles; per tile it frees the blocks dead by the storage's first step,
scans the rest in address order for the first gap that holds the storage, and inserts the new block there,
all in the tile's own short row instead of array operations over every tile's blocks.
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
