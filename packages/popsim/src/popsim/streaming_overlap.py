"""Tile-memory lifetimes when streaming-memory transfers overlap the neighbouring phases' compute (PopTorch's
``Liveness.OffChipAfterFwd``; ``schedule.place_phases`` with ``overlap`` lays the transfers out so): a
phase's loads run while the phase before computes, and its stores while the phase after does, within one
pass. The allocator places the program's storages with these lifetimes, so the tiles hold both phases' data
where the schedule says they do."""

from popsim.provenance import point_units
from popsim.remote import RemoteCopy


def overlapped_lifetimes(placed, points, remote):
    """``placed`` ((storage, first point, last point) of each temporary storage, as ``executable._liveness``
    numbers ``points``, the program's ``provenance.program_points``) with the overlap's lifetimes: a load's
    tile buffer is live from the first point of the compute of the unit (phase and pass) before the load's,
    while it loads, and a storage whose last use is a store (into one of ``remote``, the streaming-memory
    storages) stays live to the last point of the compute of the unit after the store's, until the store is
    done. Units are the points' ``point_units``, numbered in order of first appearance (an unplaced point
    belongs to the unit of the compute before it); the first unit of a pass has none before it, the last none
    after it (PopTorch leaves a gap of phases between the passes, where those transfers overlap no compute).
    A unit's compute is its points but the transfers: a store sits after the last reader of what it stores,
    which may run in the next unit, but the schedule runs it with its own unit's transfers."""
    loaded, stores = {}, set()  # a load's buffer -> the load's point; the stores' points
    for point, step in enumerate(points):
        if isinstance(step, RemoteCopy):
            if step.dst.storage in remote:
                stores.add(point)
            else:
                loaded[step.dst.storage] = point
    transfers = stores.union(loaded.values())
    units = _Units(point_units(points), transfers)
    extended = []
    for storage, first, last in placed:
        if storage in loaded:
            first = min(first, units.start_before(loaded[storage]))
        if last in stores:
            last = max(last, units.end_after(last))
        extended.append((storage, first, last))
    # In order of first use, as ``_liveness`` gives them: first fit in that order packs equal blocks tightly.
    return sorted(extended, key=lambda block: block[1])


class _Units:
    """The unit of each program point (``units``: each one's label, None where unplaced) and the points of
    each unit's compute (its points but the ``transfers``)."""

    def __init__(self, units, transfers):
        self.unit_of, keys, current = [], {}, None
        for point, unit in enumerate(units):
            own = current if unit is None else keys.setdefault(tuple(unit), len(keys))
            if point not in transfers:
                current = own
            self.unit_of.append(own)
        self.spans = {}  # unit -> [first point, last point] of its compute
        for point, unit in enumerate(self.unit_of):
            if unit is not None and point not in transfers:
                self.spans.setdefault(unit, [point, point])[1] = point
        self.passes = [direction for _, direction in keys]  # each unit's pass, in order

    def _beside(self, point, step):
        """The unit ``step`` away from ``point``'s in the same pass, or None."""
        unit = self.unit_of[point]
        if unit is None or not 0 <= unit + step < len(self.passes):
            return None
        return unit + step if self.passes[unit + step] == self.passes[unit] else None

    def start_before(self, point):
        """The first point of the unit before ``point``'s in its pass (``point`` when there is none)."""
        unit = self._beside(point, -1)
        return self.spans.get(unit, [point])[0]

    def end_after(self, point):
        """The last point of the unit after ``point``'s in its pass (``point`` when there is none)."""
        unit = self._beside(point, 1)
        return self.spans.get(unit, [point, point])[1]
