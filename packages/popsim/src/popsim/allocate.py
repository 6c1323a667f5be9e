"""Per-tile memory allocation with liveness, and the out-of-memory report."""

import numpy as np

from popsim import _allocate
from popsim.errors import OutOfMemoryError

ALIGN = 8
_FOREVER = np.iinfo(np.int64).max  # the last step of a block live to the end (a variable or constant)
_SLOTS = 16  # block slots per tile to begin with; doubled whenever a tile needs more


class TileAllocator:
    """Placement of tensor storages in each tile's bytes, reusing space of dead tensors.

    ``place`` gives each storage, on each tile it occupies, an offset by first fit; blocks whose last use
    precedes the new storage's first use are free again. ``place_all`` places a program's storages, whose
    steps are all known, together (largest first on each tile). ``budget[tile]`` is what tensors may use
    there. Each tile's live blocks fill the first ``count[tile]`` slots of its row of ``start`` / ``end`` /
    ``last`` / ``owner``, in address order; the kernel works on the rows of the tiles a placement touches only.
    """

    def __init__(self, budget):
        self.budget = np.asarray(budget, np.int64)
        self.rows = np.zeros((4, self.budget.size, _SLOTS), np.int64)  # start, end, last, owner per slot
        self.count = np.zeros(self.budget.size, np.int64)  # live blocks per tile
        self.owners = []  # the storage of each block's owner number
        self.peak = np.zeros(self.budget.size, np.int64)
        self.overflow = {}

    def copy(self):
        other = TileAllocator.__new__(TileAllocator)
        other.budget, other.rows, other.count = self.budget, self.rows.copy(), self.count.copy()
        other.owners, other.peak, other.overflow = list(self.owners), self.peak.copy(), dict(self.overflow)
        return other

    def place(self, storage, tiles, nbytes, first, last):
        """Place ``storage`` with ``nbytes[i]`` on ``tiles[i]`` (distinct tiles), live from step ``first`` to
        ``last``; returns an array of its byte offset on every tile (meaningful on ``tiles``)."""
        tiles = np.ascontiguousarray(tiles, np.int64)
        need = -(-np.asarray(nbytes, np.int64) // ALIGN) * ALIGN
        slots = self.rows.shape[2]
        wanted = int(self.count[tiles].max(initial=0)) + 1  # the live blocks and the new one
        if wanted > slots:
            self.rows = np.pad(self.rows, ((0, 0), (0, 0), (0, max(slots, wanted - slots))))
        at = np.empty(tiles.size, np.int64)
        until = _FOREVER if last == np.inf else int(last)
        _allocate.place(*self.rows, self.count, tiles, need, int(first), until, len(self.owners), at)
        self.owners.append(storage)
        offsets = np.zeros(self.budget.size, np.int64)
        offsets[tiles] = at
        self.peak[tiles] = np.maximum(self.peak[tiles], at + need)
        over = at + need > self.budget[tiles]
        for tile, end in zip(tiles[over].tolist(), (at + need)[over].tolist()):
            if tile not in self.overflow:
                self.overflow[tile] = (end, self._tile_blocks(tile))
        return offsets

    def place_all(self, placements):
        """Place storages whose steps are all known, ``placements`` a list of (storage, tiles, nbytes, first,
        last) as ``place`` takes them, after this allocator's resident blocks (live to the end, as variables);
        returns each one's offsets as ``place`` does. On each tile the largest block goes first, each at the
        lowest offset clear of the blocks placed before it whose steps overlap its own (greedy by size): placing
        in program order instead leaves holes where short-lived blocks were that later ones do not fit. The
        blocks placed do not become resident: ``place`` must not follow."""
        tiles = [np.asarray(p[1], np.int64) for p in placements]
        offsets = np.zeros((len(placements), self.budget.size), np.int64)
        if not sum(t.size for t in tiles):
            return list(offsets)
        entry = np.repeat(np.arange(len(placements)), [t.size for t in tiles])
        tile = np.concatenate(tiles)
        need = -(-np.concatenate([np.asarray(p[2], np.int64) for p in placements]) // ALIGN) * ALIGN
        steps = np.array([(p[3], _FOREVER if p[4] == np.inf else p[4]) for p in placements], np.int64)
        # By tile, largest first, then in placement order (a stable sort keeps it).
        order = np.argsort(tile * (int(need.max()) + 1) - need, kind="stable")
        tile, need, entry = tile[order], need[order], entry[order]
        first, last = steps[entry, 0], steps[entry, 1]
        at = self._place_groups(tile, need, entry, first, last)
        np.maximum.at(self.peak, tile, at + need)
        self._note_overflow(placements, tile, need, first, last, entry, at)
        offsets[entry, tile] = at
        return list(offsets)

    def _place_groups(self, tile, need, entry, first, last):
        """The offset of each entry (sorted by tile, in placement order), running the kernel once per distinct
        tile: tiles with the same resident blocks and the same entries place them alike (most tiles of an IPU
        hold the same run of linearly mapped tensors), found by a hash and confirmed element by element."""
        bounds = np.flatnonzero(np.r_[True, tile[1:] != tile[:-1], True])
        starts, sizes = bounds[:-1], np.diff(bounds)
        within = np.arange(tile.size) - starts.repeat(sizes)
        resident = self._resident(tile[starts])
        like = _first_of_equal(_group_hash(np.stack([entry, need], axis=1), starts, within, resident, sizes))
        source = starts[like].repeat(sizes) + within  # the entry of the like group at the same place
        same = np.logical_and.reduceat((entry == entry[source]) & (need == need[source]), starts)
        same &= (resident == resident[like]).all(axis=1)
        groups = np.arange(starts.size)
        like = np.where(same, like, groups)
        run = np.flatnonzero((like == groups).repeat(sizes))
        scratch = [np.empty(int(sizes.max()), np.int64) for _ in range(4)]
        at = np.zeros(tile.size, np.int64)
        placed = np.empty(run.size, np.int64)
        rows = self.rows[0], self.rows[1], self.count
        _allocate.place_by_size(*rows, tile[run], need[run], first[run], last[run], placed, *scratch)
        at[run] = placed
        return at[starts[like].repeat(sizes) + within]

    def _resident(self, tiles):
        """Each tile's resident blocks (start and end of its live slots, then their count), one row per tile."""
        live = np.arange(self.rows.shape[2]) < self.count[tiles, None]
        blocks = np.where(live, self.rows[:2, tiles], 0)
        return np.concatenate([blocks[0], blocks[1], self.count[tiles, None]], axis=1)

    def _note_overflow(self, placements, tile, need, first, last, entry, at):
        """Record each over-budget tile's furthest block end and the blocks live with that block (the entries
        are sorted by tile)."""
        over = np.flatnonzero(at + need > self.budget[tile])
        furthest = over[np.argsort(-(at + need)[over], kind="stable")]
        _, keep = np.unique(tile[furthest], return_index=True)
        for i in furthest[keep].tolist():
            t = int(tile[i])
            if t in self.overflow:
                continue
            lo, hi = np.searchsorted(tile, [t, t + 1])
            live = lo + np.flatnonzero((first[lo:hi] <= last[i]) & (last[lo:hi] >= first[i]))
            ends = [np.inf if step == _FOREVER else step for step in last[live].tolist()]
            blocks = self._tile_blocks(t) + [
                (int(at[k]), int(at[k] + need[k]), end, placements[entry[k]][0]) for k, end in zip(live.tolist(), ends)
            ]
            self.overflow[t] = (int(at[i] + need[i]), sorted(blocks, key=lambda b: b[0]))

    def _tile_blocks(self, tile):
        """(start, end, last step, storage) of each live block on ``tile``, by address."""
        start, end, last, owner = (row[tile, : self.count[tile]].tolist() for row in self.rows)
        last = [np.inf if s == _FOREVER else s for s in last]
        return [(s, e, t, self.owners[o]) for s, e, t, o in zip(start, end, last, owner)]

    def check(self, relax, target):
        """Raise OutOfMemoryError for the most over-subscribed tile of ``target`` unless ``relax``."""
        if relax or not self.overflow:
            return
        tile, (needed, blocks) = max(self.overflow.items(), key=lambda kv: kv[1][0] - self.budget[kv[0]])
        largest = sorted(blocks, key=lambda b: b[0] - b[1])[:3]
        names = ", ".join(f"{s.name} {s.dtype}{list(s.shape)} ({e - b} bytes)" for b, e, _, s in largest)
        raise OutOfMemoryError(
            f"out of memory on {target.describe_tile(tile)}: {needed} bytes needed, {self.budget[tile]} available "
            f"({len(self.overflow)} tiles over budget); largest tensors there: {names}. "
            "Compile with relax_memory=True to compile anyway and see the profile."
        )


def _group_hash(values, starts, within, resident, sizes):
    """Per group of rows of ``values`` (group i: rows starts[i] on, ``within`` numbering each row in its group),
    two random-weighted sums of its rows and one of its ``resident`` row, and its size: equal groups hash alike."""
    rng = np.random.default_rng(0)
    width = max(int(within.max(initial=0)) + 1, resident.shape[1])
    weights = rng.integers(1, 1 << 62, (2, width, values.shape[1]), dtype=np.uint64)
    rows = values.astype(np.uint64)
    keys = [np.add.reduceat((rows * w[within]).sum(axis=1), starts) for w in weights]
    keys.append((resident.astype(np.uint64) * weights[0, : resident.shape[1], 0]).sum(axis=1))
    return np.stack(keys + [sizes.astype(np.uint64)], axis=1)


def _first_of_equal(keys):
    """For each row of ``keys``, the index of the first row equal to it."""
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return first[inverse.reshape(-1)]
