"""Per-tile memory allocation with liveness, and the out-of-memory report."""

import bisect
from collections import defaultdict

from popsim.errors import OutOfMemoryError

ALIGN = 8


class TileAllocator:
    """First-fit placement of tensor storages in each tile's bytes, reusing space of dead tensors.

    ``place`` gives each storage, on each tile it occupies, an offset; blocks whose last use precedes
    the new storage's first use are free again. ``budget[tile]`` is what tensors may use there.
    """

    def __init__(self, budget):
        self.budget = budget
        self.live = defaultdict(list)  # tile -> [start, end, last_step, storage]
        self.peak = defaultdict(int)
        self.overflow = {}

    def copy(self):
        other = TileAllocator(self.budget)
        other.live = defaultdict(list, {t: list(v) for t, v in self.live.items()})
        other.peak = defaultdict(int, self.peak)
        other.overflow = dict(self.overflow)
        return other

    def place(self, storage, tile_bytes, first, last):
        offsets = {}
        live = self.live
        for tile, nbytes in tile_bytes.items():
            nbytes = -(-nbytes // ALIGN) * ALIGN
            blocks = [b for b in live[tile] if b[2] >= first]  # stays sorted: kept so by insort below
            offset = 0
            for start, end, _, _ in blocks:
                if start - offset >= nbytes:
                    break
                if end > offset:
                    offset = end
            bisect.insort(blocks, (offset, offset + nbytes, last, storage))
            live[tile] = blocks
            end = offset + nbytes
            self.peak[tile] = max(self.peak[tile], end)
            if end > self.budget[tile] and tile not in self.overflow:
                self.overflow[tile] = (end, blocks)
            offsets[tile] = offset
        return offsets

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
