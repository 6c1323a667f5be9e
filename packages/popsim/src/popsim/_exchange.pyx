"""Exchange and host transfers: coalescing an index map into byte-run copy rows, one StreamCopy slice, and
the host's reads and writes of tile memory. copy_run, the per-row copy the engine calls, is in _exchange.pxd."""

import numpy as np

from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy

from popsim._arena cimport TileArena
from popsim._types cimport byte_t, copy_t, offset_t

include "_opcodes_report.pxi"


cdef bint stream_copy(byte_t* base, byte_t* host, offset_t* stream, const offset_t* rows,
                      Py_ssize_t start, Py_ssize_t stop) noexcept nogil:
    """One StreamCopy. ``stream`` is (to_device, host byte offset, capacity, cursor, slice bytes); rows
    (offset in the slice, arena offset, bytes) place the slice's blocks. The cursor advances one slice;
    False (nothing moved) when the stream holds no further slice."""
    cdef offset_t at = stream[ST_HOST] + stream[ST_CURSOR]
    cdef const offset_t* r
    cdef Py_ssize_t i
    if stream[ST_CURSOR] + stream[ST_SLICE] > stream[ST_CAPACITY]:
        return False
    for i in range(start, stop):
        r = rows + SR_COLS * i
        if stream[ST_TO_DEVICE]:
            memcpy(base + r[SR_ARENA], host + at + r[SR_OFFSET], r[SR_NBYTES])
        else:
            memcpy(host + at + r[SR_OFFSET], base + r[SR_ARENA], r[SR_NBYTES])
    stream[ST_CURSOR] += stream[ST_SLICE]
    return True


def copy_runs(const offset_t[::1] src, const offset_t[::1] dst, offset_t itemsize):
    """Coalesce element copies ``src[i] -> dst[i]`` (byte offsets) into copy_run rows, greedily.

    A run grows while its destination stays contiguous and its source keeps the stride of its first step;
    consecutive runs of one shape whose sources advance by one fixed step become the repetitions of a
    two-dimensional row (a block of a matrix, a window of an image), so one row moves a whole block.
    """
    cdef Py_ssize_t n = src.shape[0], i
    if n and max(np.max(src), np.max(dst)) > np.iinfo(np.int32).max:
        raise OverflowError(_BEYOND_ROWS)
    rows = np.empty((n, COPY_COLS), np.int32)
    cdef copy_t[:, ::1] table = rows
    cdef Runs runs
    if n:
        runs_open(&runs, &table[0, 0], itemsize)
        with nogil:
            for i in range(n):
                runs_push(&runs, src[i], dst[i])
            runs_close(&runs)
    return rows[:runs.count if n else 0].copy()


_BEYOND_ROWS = "exchange offsets beyond 2 GiB do not fit an exchange row"


cdef struct Runs:
    # copy_runs' rows as they are found: the rows written so far and the run still growing.
    copy_t* rows
    Py_ssize_t count
    offset_t itemsize
    offset_t src, dst, stride  # the growing run's first source and destination, and its source stride
    Py_ssize_t size  # its elements (0: none yet)


cdef inline void runs_open(Runs* r, copy_t* rows, offset_t itemsize) noexcept nogil:
    r.rows, r.count, r.itemsize, r.size = rows, 0, itemsize, 0


cdef inline void runs_push(Runs* r, offset_t src, offset_t dst) noexcept nogil:
    """The next element copy: it extends the growing run (its second element sets the stride) or ends it."""
    if r.size == 1 and dst == r.dst + r.itemsize:
        r.stride = src - r.src
        r.size = 2
        return
    if r.size > 1 and dst == r.dst + r.size * r.itemsize and src == r.src + r.size * r.stride:
        r.size += 1
        return
    runs_close(r)
    r.src, r.dst, r.stride, r.size = src, dst, r.itemsize, 1


cdef inline void runs_close(Runs* r) noexcept nogil:
    """Write the growing run: one more repetition of the last row when it has that row's shape and its
    source is the next step on, else a row of its own."""
    cdef copy_t* last = r.rows + (r.count - 1) * COPY_COLS
    cdef offset_t outer
    if r.size == 0:
        return
    if r.count > 0 and last[CP_COUNT] == r.size and last[CP_STRIDE] == r.stride \
            and r.dst == last[CP_DST] + last[CP_REPS] * r.size * r.itemsize:
        outer = r.src - last[CP_SRC]
        if last[CP_REPS] == 1:
            last[CP_OUTER] = outer
            last[CP_REPS] = 2
            return
        if outer == <offset_t> last[CP_REPS] * last[CP_OUTER]:
            last[CP_REPS] += 1
            return
    last += COPY_COLS
    last[CP_SRC], last[CP_DST], last[CP_COUNT], last[CP_STRIDE] = r.src, r.dst, r.size, r.stride
    last[CP_ITEMSIZE], last[CP_REPS], last[CP_OUTER] = r.itemsize, 1, 0
    r.count += 1


def split_rows(rows):
    """(rows of several repetitions, the others as compact rows) of one Copy's exchange rows, each part in
    its order. A compact row (_opcodes.RUN_COLUMNS) drops a single repetition's outer step and count, and
    the element size its RUNS phase holds for the whole Copy: 16 bytes a row instead of 28. One pass to count,
    one to fill (a mask and two fancy-indexed copies cost several passes over millions of rows)."""
    cdef const copy_t[:, ::1] table = np.ascontiguousarray(rows, np.int32).reshape(-1, COPY_COLS)
    cdef Py_ssize_t n = table.shape[0], i, j, g = 0, c = 0, singles = 0
    for i in range(n):
        singles += table[i, CP_REPS] == 1
    general, compact = np.empty((n - singles, COPY_COLS), np.int32), np.empty((singles, RUN_COLS), np.int32)
    cdef copy_t[:, ::1] gv = general, cv = compact
    with nogil:
        for i in range(n):
            if table[i, CP_REPS] == 1:
                cv[c, RN_SRC], cv[c, RN_DST] = table[i, CP_SRC], table[i, CP_DST]
                cv[c, RN_COUNT], cv[c, RN_STRIDE] = table[i, CP_COUNT], table[i, CP_STRIDE]
                c += 1
            else:
                for j in range(COPY_COLS):
                    gv[g, j] = table[i, j]
                g += 1
    return general, compact


def block_elements(const offset_t[::1] base, const offset_t[::1] tiles, const offset_t[::1] sizes, offset_t itemsize):
    """The arena byte offset and tile of every element of blocks laid out in order: block b holds ``sizes[b]``
    elements of ``itemsize`` bytes from ``base[b]`` on tile ``tiles[b]``."""
    cdef Py_ssize_t b, k, i = 0
    cdef offset_t n = np.sum(sizes)
    addr, tile = np.empty(n, np.int64), np.empty(n, np.int64)
    cdef offset_t[::1] a = addr, t = tile
    with nogil:
        for b in range(base.shape[0]):
            for k in range(sizes[b]):
                a[i], t[i] = base[b] + k * itemsize, tiles[b]
                i += 1
    return addr, tile

def copy_plan(const offset_t[::1] index, const offset_t[::1] elements, const offset_t[::1] src_addr,
              const offset_t[::1] src_tile, const offset_t[::1] dst_base, const offset_t[::1] dst_tile,
              const offset_t[::1] dst_sizes, offset_t itemsize, Py_ssize_t num_tiles, Py_ssize_t tiles_per_ipu,
              Py_ssize_t num_ipus):
    """The copy rows and per-tile load of a Copy whose destination element i reads source element ``index[i]``
    (numbered over its sources laid end to end; ``src_addr`` / ``src_tile`` give each one's arena byte offset
    and tile). The destination's blocks, in element order, start at arena byte offsets ``dst_base`` on tiles
    ``dst_tile`` and hold ``dst_sizes`` elements.

    ``elements[i]`` names the element of tile memory ``index[i]`` reads (sources sharing a storage numbered
    alike), so a source element sent to many tiles leaves its tile once (the exchange broadcasts it) and
    crosses to each other IPU once. Returns (rows, elements received, sent and copied locally per tile,
    elements sent or received over IPU-Links per IPU, whichever is larger)."""
    cdef Py_ssize_t n = index.shape[0], total = src_addr.shape[0], words = (num_ipus + 63) // 64
    cdef Py_ssize_t i = 0, b, k, j, span, bad = -1
    cdef offset_t e, u, st, dt, si, di, d, sa, da, top = 0, fresh
    cdef uint64_t bit
    if np.sum(dst_sizes) != n:
        raise ValueError(f"the destination's blocks hold {np.sum(dst_sizes)} elements, the index map {n}")
    received, sent, local = (np.zeros(num_tiles, np.int64) for _ in range(3))
    link_out, link_in = np.zeros(num_ipus, np.int64), np.zeros(num_ipus, np.int64)
    rows = np.empty((n, COPY_COLS), np.int32)  # pages only as far as rows are written
    seen = np.zeros(total, np.uint8)
    reached = np.zeros((total if num_ipus > 1 else 0, words), np.uint64)  # per element: the IPUs it reached
    cdef offset_t[::1] rv = received, sv = sent, lv = local, lo = link_out, li = link_in
    cdef uint8_t[::1] seen_v = seen
    cdef uint64_t[:, ::1] reach = reached
    cdef copy_t[:, ::1] table = rows
    cdef Runs runs
    if n:
        runs_open(&runs, &table[0, 0], itemsize)
    with nogil:
        for b in range(dst_base.shape[0]):
            dt, d, k = dst_tile[b], dst_base[b], 0
            while k < dst_sizes[b]:
                e, u = index[i], elements[i]
                if not (0 <= e < total and 0 <= u < total):
                    bad = i
                    break
                # A span: the destination block's next elements read consecutive source elements (and
                # elements of tile memory) of one source tile at consecutive addresses; handled at once.
                span = source_span(&index[0], &elements[0], &src_addr[0], &src_tile[0], i,
                                   min(dst_sizes[b] - k, n - i), total, itemsize)
                sa, da, st = src_addr[e], d + k * itemsize, src_tile[e]
                runs_push_span(&runs, sa, da, span)  # rows beyond 2 GiB are refused below
                top = max(top, sa + (span - 1) * itemsize, da + (span - 1) * itemsize)
                i += span
                k += span
                if st == dt:
                    lv[dt] += span
                    continue
                rv[dt] += span
                fresh = 0
                for j in range(u, u + span):
                    if not seen_v[j]:
                        seen_v[j] = 1
                        fresh += 1
                sv[st] += fresh
                if num_ipus == 1:  # no IPU-Links to count (and no divisions to find the IPUs)
                    continue
                si, di = st // tiles_per_ipu, dt // tiles_per_ipu
                if si != di:
                    bit = (<uint64_t> 1) << (di % 64)
                    for j in range(u, u + span):
                        if not reach[j, di // 64] & bit:
                            reach[j, di // 64] |= bit
                            lo[si] += 1
                            li[di] += 1
            if bad >= 0:
                break
    if bad >= 0:
        raise IndexError(f"copy element {bad} reads element {index[bad]} of sources holding {total}")
    if top > np.iinfo(np.int32).max:
        raise OverflowError(_BEYOND_ROWS)
    if n:
        runs_close(&runs)
    return rows[:runs.count if n else 0].copy(), received, sent, local, np.maximum(link_out, link_in)


cdef inline Py_ssize_t source_span(const offset_t* index, const offset_t* elements, const offset_t* src_addr,
                                   const offset_t* src_tile, Py_ssize_t i, Py_ssize_t most, Py_ssize_t total,
                                   offset_t itemsize) noexcept nogil:
    """How many of the (at most ``most``) copy elements from ``i`` on read source elements e, e+1, ... (and
    elements of tile memory u, u+1, ...) at consecutive addresses of one tile, e = index[i] being valid."""
    cdef offset_t e = index[i], u = elements[i]
    cdef Py_ssize_t span = 1
    while span < most and e + span < total and u + span < total and index[i + span] == e + span \
            and elements[i + span] == u + span and src_addr[e + span] == src_addr[e] + span * itemsize \
            and src_tile[e + span] == src_tile[e]:
        span += 1
    return span


cdef inline void runs_push_span(Runs* r, offset_t src, offset_t dst, Py_ssize_t span) noexcept nogil:
    """``runs_push`` of the ``span`` element copies src + j * itemsize -> dst + j * itemsize: element by
    element until the growing run holds the last one pushed with the element size as its stride, after which
    every further element extends it."""
    cdef Py_ssize_t j = 0
    while j < span:
        runs_push(r, src + j * r.itemsize, dst + j * r.itemsize)
        j += 1
        if r.size > 1 and r.stride == r.itemsize:
            r.size += span - j
            return


def host_write(TileArena arena, const byte_t[::1] host, const offset_t[::1] host_offsets,
               const offset_t[::1] arena_offsets, const offset_t[::1] nbytes):
    """Host -> tiles: copy block i of ``host`` bytes to its place in the arena (a StreamCopy to the device)."""
    cdef Py_ssize_t i
    if host.shape[0] == 0:
        return
    with nogil:
        for i in range(nbytes.shape[0]):
            memcpy(arena.base + arena_offsets[i], &host[0] + host_offsets[i], nbytes[i])


def host_read(TileArena arena, byte_t[::1] host, const offset_t[::1] host_offsets,
              const offset_t[::1] arena_offsets, const offset_t[::1] nbytes):
    """Tiles -> host: gather the blocks of a tensor into ``host`` (a StreamCopy from the device)."""
    cdef Py_ssize_t i
    if host.shape[0] == 0:
        return
    with nogil:
        for i in range(nbytes.shape[0]):
            memcpy(&host[0] + host_offsets[i], arena.base + arena_offsets[i], nbytes[i])
