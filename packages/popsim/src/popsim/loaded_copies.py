"""The tile copies of host-written scalars (optimizer hyper-parameters), kept only on the tiles that read them.

While lowering, a scalar variable only the host writes gets a copy with one element per tile of its IPU
(``Lowerer._scalar_loaded``), as which tiles read it is known only once every program is lowered. Then each
copy is cut down to the elements its vertices read, one per reading tile, as Poplar places such a value only
where a vertex reads it: the others would take tile memory and host-write bytes for nothing.
"""

import numpy as np

from popsim.device_graph import ComputeSet, Regions, StreamCopy, leaves
from popsim.mapping import TileMapping


def place_on_readers(dg, programs):
    """Re-map each copy in ``dg.host_copy_of`` that only vertices read, one element each on their own tile,
    onto the tiles of those vertices (ascending), renumbering the vertices' fields to match."""
    readers, other_uses = _uses(set(dg.host_copy_of), programs)
    aliased = {t.storage for t in dg.tensors if t.storage is not t}
    for copy, uses in readers.items():
        if copy in other_uses or copy in aliased or not all(_own_element(copy, b, name) for b, name in uses):
            continue
        tiles = np.unique(np.concatenate([batch.tiles for batch, _ in uses]))
        copy.mapping = TileMapping.on_tiles(np.ones(tiles.size, np.int64), tiles)
        copy.shape = (tiles.size,)
        for batch, name in uses:
            at = np.searchsorted(tiles, batch.tiles)
            batch.fields[name] = Regions(copy, at, at + 1)
            batch.blocks[name] = at


def _uses(copies, programs):
    """({copy: [(batch, field name) of each vertex field reading it]}, copies any other step touches)."""
    readers, other_uses = {}, set()
    for program in programs:
        for step in leaves(program):
            if not isinstance(step, ComputeSet):
                other_uses.update(_tensors_of(step) & copies)
                continue
            for batch in step.batches:
                for name, regions in batch.fields.items():
                    if regions.tensor in copies:
                        readers.setdefault(regions.tensor, []).append((batch, name))
    return readers, other_uses


def _tensors_of(step):
    """The storages an exchange or a stream touches."""
    tensors = [step.tensor] if isinstance(step, StreamCopy) else [step.dst, *step.srcs]
    return {t.storage for t in tensors}


def _own_element(copy, batch, name):
    """Whether each vertex of ``batch`` reads through field ``name`` exactly the element of ``copy`` on its tile."""
    regions, m = batch.fields[name], copy.mapping
    one_element = np.all(regions.stops - regions.starts == 1)
    return bool(one_element and np.all(m.tiles[m.block_of(regions.starts)] == batch.tiles))
