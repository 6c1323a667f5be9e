"""Per-tile memory allocation with liveness, and the out-of-memory report."""

import numpy as np

from popsim import _allocate
from popsim.errors import OutOfMemoryError

ALIGN = 8
_FOREVER = np.iinfo(np.int64).max  # the last step of a block live to the end (a variable or constant)
_SLOTS = 16  # block slots per tile to begin with; doubled whenever a tile needs more


class TileAllocator:
    """First-fit placement of tensor storages in each tile's bytes, reusing space of dead tensors.

    ``place`` gives each storage, on each tile it occupies, an offset; blocks whose last use precedes
    the new storage's first use are free again. ``budget[tile]`` is what tensors may use there. Each tile's
    live blocks fill the first ``count[tile]`` slots of its row of ``start`` / ``end`` / ``last`` / ``owner``,
    in address order; the kernel works on the rows of the tiles a placement touches only.
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
