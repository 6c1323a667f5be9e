"""Where device work and memory came from, for profiles: the popir node behind each compute set, exchange
and tensor (module path, frontend op, source line, role), each tensor's memory category, and the liveness of
memory over a program."""

import numpy as np

from popsim.device_graph import ComputeSet, Copy, Execute, If, StreamCopy, children

# Memory categories of tensors; the profile adds the per-tile "vertex state" and "code" of compute sets.
CATEGORIES = ("variables", "optimizer state", "inputs", "activations", "gradients", "temporaries", "constants")
_ORIGIN_FIELDS = ("module", "aten", "source", "role")
# A popir value's storage by the role of the node that made it; the rest of what planners make is temporary.
_VALUE_CATEGORY = {"forward": "activations", "backward": "gradients", "optimizer": "temporaries", None: "activations"}
_PINNED_CATEGORY = {"input": "inputs", "constant": "constants"}


def origin_of(node):
    """The provenance of the popir node a step or tensor was lowered from, as JSON: its popir ``op`` and
    whichever of module, aten, source and role are known; {} when there is none (hand-built programs, and
    the output and update copies that end a program)."""
    if node is None:
        return {}
    origin = {"op": node.op}
    for name in _ORIGIN_FIELDS:
        value = getattr(node, name, None)
        if value is not None:
            origin[name] = value
    return origin


def fused_origins(compute_set):
    """``{"fused": [...]}``: the provenance of each popir node a compute set's fused expression computes, with
    the ``elements`` it makes (the profile splits the set's cycles among them by these); {} when unfused."""
    if len(compute_set.fused) < 2:
        return {}
    return {"fused": [{**origin_of(node), "elements": node.outputs[0].type.size} for node in compute_set.fused]}


def credit_merged(step, origin, nbytes):
    """Record in an exchange ``step`` that a copy from ``origin`` (origin_of) receiving ``nbytes`` joined its
    phase: ``step["merged"]`` lists each origin with the bytes its copies receive (the profile splits the
    phase's cycles by these) once copies of two origins share it; call before adding ``nbytes`` to it."""
    if "merged" not in step:
        if origin == step["origin"]:
            return
        step["merged"] = [{**step["origin"], "bytes": step["bytes"]}]
    part = next((p for p in step["merged"] if {k: v for k, v in p.items() if k != "bytes"} == origin), None)
    if part is None:
        step["merged"].append({**origin, "bytes": nbytes})
    else:
        part["bytes"] += nbytes


def busy_ipus(target, per_tile):
    """The IPUs with a tile that has work in ``per_tile`` (a value per tile)."""
    if target.num_ipus == 1:
        return [0] if per_tile.any() else []
    busy = np.flatnonzero(np.asarray(per_tile).reshape(target.num_ipus, -1).any(axis=1))
    return busy.tolist()


def category(storage, dg):
    """The memory category (one of ``CATEGORIES``) of a tensor storage of ``dg``."""
    if storage.category == "variable":
        return "optimizer state" if dg.state_kinds.get(storage.name) == "optimizer_state" else "variables"
    if storage.category in _PINNED_CATEGORY:
        return _PINNED_CATEGORY[storage.category]
    if storage.id in dg.node_outputs:
        return _VALUE_CATEGORY.get(getattr(storage.origin, "role", None), "activations")
    return "temporaries"


def program_points(program):
    """The steps of ``program`` in the order the allocator numbers its liveness (``executable._liveness``):
    each ComputeSet, Copy and StreamCopy, and each If (its condition test), loop bodies once."""
    points = []

    def walk(step):
        if isinstance(step, Execute):
            step = step.compute_set
        if isinstance(step, ComputeSet | Copy | StreamCopy):
            points.append(step)
            return
        if isinstance(step, If):
            points.append(step)
        for child in children(step):
            walk(child)

    walk(program)
    return points


def memory_map(dg, placed, program, num_tiles):
    """Tensors and liveness of one program for its profile.

    ``placed`` lists (storage, first, last) of every storage the program's memory holds (variables and
    constants with first = -1 and last = None: resident throughout). Returns (tensors, per-tile bytes by
    category, liveness): each tensor with its category, provenance, live range and bytes per tile; the
    liveness gives, at each program point, the bytes live in each category over all tiles and the point's
    phase and pass (``units``, see ``_point_unit``), and each tile's peak point (``tile_peak_points``, see
    ``tile_peak_points``). A tensor's bytes per tile are ``tile_runs``."""
    points = program_points(program)
    count = len(points) + 1  # the last point streams the outputs out
    tensors = []
    per_tile = {name: np.zeros(num_tiles, np.int64) for name in CATEGORIES}
    live = {name: np.zeros(count + 1, np.int64) for name in CATEGORIES}
    spans = []  # (tiles, bytes on each, first live point, point after the last) of each tensor
    for storage, first, last in placed:
        m = storage.mapping
        sizes = np.bincount(m.tiles, weights=(m.stops - m.starts) * storage.itemsize, minlength=num_tiles)
        tiles = np.flatnonzero(sizes)
        if not tiles.size:
            continue
        kind = category(storage, dg)
        nbytes = int(sizes.sum())
        per_tile[kind] += sizes.astype(np.int64)
        start, stop = max(first, 0), count if last is None else min(last, count - 1) + 1
        live[kind][start] += nbytes
        live[kind][stop] -= nbytes
        spans.append((tiles, sizes[tiles].astype(np.int64), start, stop))
        tensors.append(
            {
                "name": storage.name,
                "category": kind,
                "bytes": nbytes,
                "first": int(first),
                "last": None if last is None else int(last),
                "tile_runs": tile_runs(tiles, sizes[tiles].astype(np.int64)),
                **origin_of(storage.origin),
            }
        )
    labels = [_point_label(step) for step in points] + ["stream outputs out"]
    liveness = {
        "points": labels,
        "modules": [origin_of(getattr(step, "origin", None)).get("module") for step in points] + [None],
        "units": point_units(points) + [None],
        "bytes": {name: np.cumsum(curve[:-1]).tolist() for name, curve in live.items()},
        "tile_peak_points": tile_peak_points(spans, num_tiles),
    }
    return tensors, {name: arr.tolist() for name, arr in per_tile.items()}, liveness


def tile_peak_points(spans, num_tiles):
    """Per tile, the program point where the bytes of the tensors live on it peak (the earliest of equal
    peaks), None on a tile that holds none. ``spans`` gives each tensor's tiles, bytes on each, and live
    points ``start`` to ``stop`` (exclusive). The allocator's peak on a tile is at least these bytes: the
    rest is alignment padding and gaps left between tensors of different lifetimes."""
    spans = [s for s in spans if s[2] < s[3]]
    points = [None] * num_tiles
    if not spans:
        return points
    # Each span adds its bytes at ``start`` and takes them away at ``stop``; sorted by (tile, point), a running
    # sum gives a tile's live bytes after each event (each tile's events sum to zero, so tiles do not mix).
    # (tile, point) is sorted as one number, tile * width + point.
    width = max(stop for _, _, _, stop in spans) + 1
    tile = np.concatenate([t for t, _, _, _ in spans] * 2)
    delta = np.concatenate([b for _, b, _, _ in spans] + [-b for _, b, _, _ in spans])
    point = np.concatenate([np.full(t.size, a) for t, _, a, _ in spans] + [np.full(t.size, z) for t, _, _, z in spans])
    order = np.argsort(tile * width + point, kind="stable")
    key, running = (tile * width + point)[order], np.cumsum(delta[order])
    # Bytes live at a point: the running sum after the point's last event on the tile.
    last = np.r_[key[1:] != key[:-1], True]
    key, running = key[last], running[last]
    tile, point = key // width, key % width
    # Per tile (its points ascending): the first point where the live bytes reach the tile's most.
    starts = np.flatnonzero(np.r_[True, tile[1:] != tile[:-1]])
    group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, tile.size]))
    hits = np.flatnonzero(running == np.maximum.reduceat(running, starts)[group])
    first = hits[np.r_[True, group[hits][1:] != group[hits][:-1]]]
    for t, p, b in zip(tile[first].tolist(), point[first].tolist(), running[first].tolist()):
        points[t] = p if b > 0 else None
    return points


def tile_runs(tiles, nbytes):
    """[first tile, tile count, bytes on each] for each run of consecutive ``tiles`` holding equal ``nbytes``:
    a linearly mapped tensor over a thousand tiles takes two runs, not a thousand entries."""
    starts = np.flatnonzero(np.r_[True, (np.diff(tiles) != 1) | (np.diff(nbytes) != 0)])
    counts = np.diff(np.r_[starts, tiles.size])
    return np.stack([tiles[starts], counts, nbytes[starts]], axis=1).tolist()


def point_units(points):
    """``[stage or phase, pass]`` of each of ``points`` (``program_points``), None where unplaced."""
    return [_point_unit(step) for step in points]


def _point_unit(step):
    """``[stage or phase, pass]`` of the placed popir node a program point was lowered from (None: unplaced)."""
    node = getattr(step, "origin", None)
    placement = getattr(node, "placement", None)
    if placement is None:
        return None
    return [int(placement[0]), "forward" if node.role in (None, "forward") else "backward"]


def _point_label(step):
    if isinstance(step, If):
        return "if (condition test)"
    if isinstance(step, StreamCopy):
        return f"stream-{'in' if step.to_device else 'out'} {step.stream}"
    return step.name
