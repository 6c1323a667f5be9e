"""Per-tile memory allocation with liveness, and the out-of-memory report."""

import numpy as np

from popsim.errors import OutOfMemoryError

ALIGN = 8
_FIELDS = ("tile", "start", "end", "last", "owner")  # one array each; a row per live block


class TileAllocator:
    """First-fit placement of tensor storages in each tile's bytes, reusing space of dead tensors.

    ``place`` gives each storage, on each tile it occupies, an offset; blocks whose last use precedes
    the new storage's first use are free again. ``budget[tile]`` is what tensors may use there. The live
    blocks of every tile are held in arrays sorted by (tile, start), so one placement over many tiles is a
    handful of array operations rather than a scan per tile.
    """

    def __init__(self, budget):
        self.budget = np.asarray(budget, np.int64)
        self.blocks = {name: np.zeros(0, np.float64 if name == "last" else np.int64) for name in _FIELDS}
        self.owners = []  # the storage of each block's owner number
        self.peak = np.zeros(self.budget.size, np.int64)
        self.overflow = {}

    def copy(self):
        other = TileAllocator(self.budget)
        other.blocks = dict(self.blocks)  # arrays are replaced, never changed in place
        other.owners = list(self.owners)
        other.peak = self.peak.copy()
        other.overflow = dict(self.overflow)
        return other

    def place(self, storage, tiles, nbytes, first, last):
        """Place ``storage`` with ``nbytes[i]`` on ``tiles[i]`` (distinct tiles), live from step ``first`` to
        ``last``; returns an array of its byte offset on every tile (meaningful on ``tiles``)."""
        tiles = np.asarray(tiles, np.int64)
        need = -(-np.asarray(nbytes, np.int64) // ALIGN) * ALIGN
        b = self.blocks
        touched = np.zeros(self.budget.size, bool)
        touched[tiles] = True
        on = touched[b["tile"]]
        keep = ~on | (b["last"] >= first)  # blocks dead by now are freed on the tiles this placement touches
        b = {name: values[keep] for name, values in b.items()}
        on = on[keep]
        offsets = np.zeros(self.budget.size, np.int64)
        offsets[tiles] = _first_fit(b["tile"][on], b["start"][on], b["end"][on], need, tiles, self.budget.size)
        new = {"tile": tiles, "start": offsets[tiles], "end": offsets[tiles] + need}
        new["last"], new["owner"] = np.full(tiles.size, float(last)), np.full(tiles.size, len(self.owners))
        self.owners.append(storage)
        at = np.searchsorted(b["tile"] * _KEY + b["start"], new["tile"] * _KEY + new["start"])
        self.blocks = {name: np.insert(b[name], at, new[name]) for name in _FIELDS}
        np.maximum.at(self.peak, tiles, new["end"])
        over = new["end"] > self.budget[tiles]
        for tile, end in zip(tiles[over].tolist(), new["end"][over].tolist()):
            if tile not in self.overflow:
                self.overflow[tile] = (end, self._tile_blocks(tile))
        return offsets

    def _tile_blocks(self, tile):
        b = self.blocks
        on = np.flatnonzero(b["tile"] == tile)
        return [(int(b["start"][i]), int(b["end"][i]), b["last"][i], self.owners[b["owner"][i]]) for i in on]

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


_KEY = 1 << 40  # (tile, start) as one sortable number: tile * _KEY + start (tile memory is far below 2**40)


def _first_fit(tile, start, end, need, tiles, num_tiles):
    """Per tile of ``tiles``, the first-fit offset of ``need`` bytes among the live blocks (``tile``, ``start``,
    ``end``, sorted by tile then start): scanning a tile's blocks in address order, the first gap before a
    block that holds ``need``, else the end of the highest block."""
    need_of = np.zeros(num_tiles, np.int64)
    need_of[tiles] = need
    offset = np.zeros(num_tiles, np.int64)
    if tile.size:
        # Highest end so far within each tile's run of blocks: a running maximum over tile * _KEY + end.
        reach = np.maximum.accumulate(tile * _KEY + end) - tile * _KEY
        group_start = np.r_[True, tile[1:] != tile[:-1]]
        before = np.where(group_start, 0, np.r_[0, reach[:-1]])
        fits = start - before >= need_of[tile]
        last_of = np.r_[tile[1:] != tile[:-1], True]
        offset[tile[last_of]] = reach[last_of]
        hit_tiles, first_hit = np.unique(tile[fits], return_index=True)
        offset[hit_tiles] = before[fits][first_hit]
    return offset[tiles]
