"""Tile mappings: which contiguous element ranges of a tensor live on which tile."""

import numpy as np

from popsim.errors import Error


class TileMapping:
    """Blocks ``[starts[k], stops[k])`` of a flattened tensor on ``tiles[k]``, sorted by start, covering it.

    A tile may hold several blocks; they sit one after another in that tile's allocation of the tensor.
    """

    __slots__ = ("tiles", "starts", "stops", "size", "_key")

    def __init__(self, tiles, starts, stops, size):
        self.tiles = np.asarray(tiles, np.int64)
        self.starts = np.asarray(starts, np.int64)
        self.stops = np.asarray(stops, np.int64)
        self.size = int(size)
        if size and (
            self.starts[0] != 0
            or self.stops[-1] != size
            or np.any(self.starts[1:] != self.stops[:-1])
            or np.any(self.stops <= self.starts)
        ):
            raise Error(f"a tile mapping must cover elements 0..{size} with non-empty blocks in order")
        self._key = None

    @staticmethod
    def linear(size, itemsize, target, grain=None):
        """Poplar-style linear mapping: equal chunks of whole grains (at least ``min_bytes_per_tile``).

        Small tensors use few tiles; the first tile depends on the size so that unrelated small tensors
        spread over the IPU while tensors of one size (operands of one elementwise op) stay aligned.
        """
        if size == 0:
            return TileMapping([], [], [], 0)
        grain = grain or max(1, target.min_bytes_per_tile // itemsize)
        even = -(-size // target.num_tiles)
        per_tile = max(grain, -(-even // grain) * grain)
        starts = np.arange(0, size, per_tile, dtype=np.int64)
        stops = np.minimum(starts + per_tile, size)
        first = (size * 2654435761) % target.num_tiles
        tiles = target.first_tile + (first + np.arange(starts.size)) % target.num_tiles
        return TileMapping(tiles, starts, stops, size)

    @staticmethod
    def on_tiles(block_sizes, tiles):
        """Consecutive blocks of the given sizes on the given tiles (an explicit mapping)."""
        sizes = np.asarray(block_sizes, np.int64)
        keep = sizes > 0
        stops = np.cumsum(sizes)[keep]
        return TileMapping(np.asarray(tiles, np.int64)[keep], stops - sizes[keep], stops, int(sizes.sum()))

    def scaled(self, factor):
        """The mapping of a tensor with ``factor`` consecutive elements per element of this one."""
        return TileMapping(self.tiles, self.starts * factor, self.stops * factor, self.size * factor)

    def block_of(self, elements):
        """Index of the block holding each element."""
        return np.searchsorted(self.stops, elements, side="right")

    def tile_bytes(self, itemsize):
        """(tiles, bytes this tensor occupies on each): the tiles it uses, ascending."""
        sizes = np.bincount(self.tiles, weights=(self.stops - self.starts) * itemsize).astype(np.int64)
        used = np.flatnonzero(sizes)
        return used, sizes[used]

    def offsets_in_tile(self):
        """Element offset of each block inside its tile's allocation of the tensor."""
        order = np.lexsort((self.starts, self.tiles))
        sizes = (self.stops - self.starts)[order]
        first = np.r_[True, self.tiles[order][1:] != self.tiles[order][:-1]]
        run = np.cumsum(sizes) - sizes
        base = np.maximum.accumulate(np.where(first, run, 0))
        offsets = np.empty_like(sizes)
        offsets[order] = run - base
        return offsets

    def key(self):
        """Hashable identity: equal keys mean element-for-element the same placement."""
        if self._key is None:
            self._key = (self.size, self.tiles.tobytes(), self.starts.tobytes())
        return self._key

    def __eq__(self, other):
        return isinstance(other, TileMapping) and self.key() == other.key()

    __hash__ = None

    @property
    def num_tiles_used(self):
        return int(np.unique(self.tiles).size)
