"""Direct convolution (our poplin): CONV vertices over input windows already on their tiles.

A convolution is split over groups x batch x output channels x output rows x input channels. Each task's
tile receives, once, the union of the input windows its output rows read (its *patch*: rows of the input
with their halo, padding left out) and its weights, runs one CONV vertex, and writes an output partial;
partials of an input-channel split are reduced across tiles. Nothing is expanded into im2col columns on
the exchange: an input element reaches a tile at most once however many taps read it. With few input
channels a vertex folds the kernel columns into its channels on the tile (poplin's tile-level expandDims),
so that each AMP weight load covers more of them.
"""

import contextlib
import functools
import zlib
from typing import NamedTuple

import numpy as np

from popir import DType
from popsim import _opcodes as oc
from popsim import cost
from popsim.mapping import TileMapping
from popsim.matmul_plan import DEFAULT_AVAILABLE_MEMORY, plan_matmul, result_cycles, result_rows, temporary_bytes
from popsim.planner import _index_key, _sources_key


class ConvSpec(NamedTuple):
    """One convolution's shape: ``groups`` of (``channels`` -> ``out_channels``), a ``batch`` of
    ``in_size`` (rows, cols) inputs giving ``out_size`` outputs; ``pad`` is the (top, left) padding (negative
    when the first window starts inside the input). ``in_dilation`` spaces the input's elements apart with
    zeros between them (a strided convolution's input gradient); ``pad`` counts in those spaced positions."""

    groups: int
    batch: int
    channels: int
    out_channels: int
    in_size: tuple
    out_size: tuple
    kernel: tuple
    stride: tuple
    dilation: tuple
    pad: tuple
    in_dilation: tuple = (1, 1)


class ConvPlan(NamedTuple):
    """Split counts and block sizes of (batch, out_channels, out_rows, channels), estimated cycles and
    temporary bytes on the busiest tile, and whether the vertices fold the kernel columns into the channels."""

    splits: tuple
    blocks: tuple
    cycles: int
    memory: int
    fold: bool = False


# Input channels one AMP weight load covers at a kernel position (*estimate*, by activation itemsize): a
# convolution with fewer channels per position leaves AMP lanes idle, which folding fills.
AMP_INPUT_CHANNELS = {4: 8, 2: 16}

# Bytes of one CONV vertex's geometry constant (int32 words), placed on its tile.
GEOMETRY_BYTES = len(oc.CONV_GEOMETRY) * DType.int32.itemsize


def _folds(spec):
    """Whether the vertices may fold the kernel columns into the input channels, as poplin's tile-level
    expandDims: a view of the patch (the AMP reads overlapping windows of each row, no copy and no extra
    memory) when the columns are unit-spaced. Candidates: (False,) or (False, True)."""
    return np.array([False, True]) if spec.dilation[1] == 1 and spec.in_dilation[1] == 1 else np.array([False])


def vertex_cycles(target, spec, fold, channels, out_channels, positions, dtype):
    """Cycles of CONV vertices (integers or arrays, one per vertex) of ``channels`` -> ``out_channels`` over
    ``positions`` outputs. The AMP reloads its weights at each kernel position; with the kernel columns
    folded into the channels, once per kernel row and AMP load of the folded channels (fewer loads only when
    the channels alone leave AMP lanes idle)."""
    kh, kw = spec.kernel
    folded_loads = kh * -(-channels * kw // AMP_INPUT_CHANNELS[dtype.itemsize])
    loads = np.where(fold, folded_loads, kh * kw)
    return cost.conv_cycles(target, out_channels, channels * kh * kw, loads, positions, dtype)


def _split_counts(size):
    """Candidate split counts of an axis, each giving distinct blocks: 1, 2, 3 and then about x1.5 apart."""
    counts, g = {1, size}, 2
    while g < size:
        counts.add(g)
        g = g + 1 if g < 4 else g * 3 // 2
    return np.array(sorted({-(-size // (-(-size // c))) for c in counts}), np.int64)


def _patch_extent(out, k, s, d, u, size):
    """Input rows (or cols, ``u`` apart) an ``out``-long block of outputs reads, at most the whole input."""
    return np.minimum(size, -(-((out - 1) * s + (k - 1) * d + 1) // u) + (u > 1))


@functools.lru_cache(maxsize=512)
def plan_conv(target, spec, dtype, partials=DType.float32, available_memory=DEFAULT_AVAILABLE_MEMORY):
    """The split with the fewest estimated cycles whose patches, weights and partials fit in the
    ``available_memory`` proportion of a tile (else the least memory), as ``plan_matmul`` chooses."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel, spec.stride, spec.dilation
    (h, w), (oh, ow) = spec.in_size, spec.out_size
    sizes = (spec.batch, spec.out_channels, oh, spec.channels)
    grids = np.meshgrid(*(_split_counts(n) for n in sizes), _folds(spec), indexing="ij")
    gb, go, gr, gc, fold = (a.reshape(-1) for a in grids)
    bb, ob, rb, cb = (-(-n // g) for n, g in zip(sizes, (gb, go, gr, gc)))
    tasks = spec.groups * gb * go * gr * gc
    keep = tasks <= max(target.num_tiles, spec.groups)
    gb, go, gr, gc, fold, bb, ob, rb, cb, tasks = (a[keep] for a in (gb, go, gr, gc, fold, bb, ob, rb, cb, tasks))
    per_tile = -(-tasks // target.num_tiles)
    (uh, uw) = spec.in_dilation
    rows, cols = _patch_extent(rb, kh, sh, dh, uh, h), _patch_extent(ow, kw, sw, dw, uw, w)
    operand_bytes = (bb * cb * rows * cols + ob * cb * kh * kw) * dtype.itemsize
    reduced = (gc > 1) | (dtype != partials)
    out_size = spec.groups * spec.batch * spec.out_channels * oh * ow
    out_rows = result_rows(target, out_size, dtype.itemsize)
    partial_bytes = bb * ob * rb * ow * partials.itemsize
    memory = temporary_bytes(target, per_tile, operand_bytes, partial_bytes, reduced, gc, out_rows, partials, dtype)
    memory += per_tile * GEOMETRY_BYTES  # each vertex's geometry constant
    exchange = functools.partial(cost.exchange_cycles, target)
    compute = vertex_cycles(target, spec, fold, cb, ob, bb * rb * ow, dtype)
    # Each contiguous patch row or weight row received is one exchange region with its own setup cycles.
    cycles = (3 + reduced) * target.bsp_sync_cycles + per_tile * (compute + bb * cb * rows + ob * cb)
    cycles += exchange(per_tile * operand_bytes)
    outputs = out_rows  # the result's elements on its busiest tile (its linear mapping is in whole grains)
    cycles += np.where(
        reduced,
        exchange(outputs * gc * partials.itemsize) + cost.reduce_cycles(target, outputs, gc, partials),
        exchange(np.full(gc.shape, outputs * dtype.itemsize)),
    )
    budget = int(target.tile_bytes * available_memory)
    fits = memory <= budget
    pick = np.flatnonzero(fits) if fits.any() else np.flatnonzero(memory == memory.min())
    best = pick[np.argmin(cycles[pick])]
    splits = tuple(int(a[best]) for a in (gb, go, gr, gc))
    blocks = tuple(int(a[best]) for a in (bb, ob, rb, cb))
    return ConvPlan(splits, blocks, int(cycles[best]), int(memory[best]), bool(fold[best]))


def direct_is_faster(lw, spec, dtype):
    """Whether CONV vertices are chosen over a matmul over im2col columns (the kernel folded into the input
    channels) for ``spec``, by the planners' rule: the faster of the plans that fit the node's memory
    proportion, else the one needing less memory."""
    if 0 in (spec.batch, spec.out_channels, *spec.out_size):
        return False  # nothing to compute: the matmul path handles empty operands
    partial = lw.partials_type if dtype == DType.float16 else DType.float32
    direct = plan_conv(lw.target, spec, dtype, partial, lw.available_memory)
    positions = spec.batch * spec.out_size[0] * spec.out_size[1]
    taps = spec.channels * spec.kernel[0] * spec.kernel[1]
    folded = plan_matmul(
        lw.target, spec.groups, spec.out_channels, positions, taps, dtype, partial, lw.available_memory
    )
    budget = int(lw.target.tile_bytes * lw.available_memory)
    folded_cycles = _folded_cycles(lw.target, folded, spec.groups * spec.out_channels * positions, dtype, partial)
    if (direct.memory <= budget) != (folded.memory <= budget):
        return direct.memory <= budget  # only one fits: a lower proportion never picks more memory
    if direct.memory > budget and direct.memory != folded.memory:
        return direct.memory < folded.memory  # neither fits: the least memory, as each planner replans
    return direct.cycles <= folded_cycles


def _folded_cycles(target, plan, size, dtype, partials):
    """The im2col matmul ``plan``'s estimated cycles with its ``size``-element result charged at that
    result's busiest tile. The matmul planner charges an even share of every tile, but the result's linear
    mapping holds whole grains: a small result (a weight gradient's) sits on few tiles, each reducing many
    more partials than an even share (4.6x for a 32x32 3x3 weight gradient over 8x16x16 outputs), which made
    the comparison pick im2col where CONV vertices run faster."""
    reduced = plan.gk > 1 or dtype != partials
    even, busiest = -(-size // target.num_tiles), result_rows(target, size, dtype.itemsize)
    return plan.cycles + int(
        result_cycles(target, busiest, plan.gk, reduced, partials)
        - result_cycles(target, even, plan.gk, reduced, partials)
    )


def _clipped(lo, hi, step, size):
    """The input rows (or cols, ``step`` apart) at spaced positions lo..hi inclusive, clipped to the input
    [0, size) and never empty (a block whose windows read only padding still gets one real row, which none
    of its windows reads)."""
    start = min(max(-(-lo // step), 0), size - 1)
    return start, max(min(hi // step + 1, size), start + 1)


def _tasks(spec, plan):
    """Per task: (group, batch range, out-channel range, out-row range, channel index, channel range)."""
    (gb, go, gr, gc), (bb, ob, rb, cb) = plan.splits, plan.blocks
    sizes = (spec.batch, spec.out_channels, spec.out_size[0], spec.channels)
    for g in range(spec.groups):
        for i in np.ndindex(gb, go, gr, gc):
            b, o, r, c = (slice(k * n, min((k + 1) * n, total)) for k, n, total in zip(i, (bb, ob, rb, cb), sizes))
            yield g, b, o, r, i[3], c


def _layout(spec, plan, x_index, w_index):
    """Index maps of every task's patch and weights, each vertex's geometry, and for each output element
    (G, N, O, OH, OW) the partial that holds it from each input-channel block."""
    (kh, kw), (sh, sw), (dh, dw), (top, left) = spec.kernel, spec.stride, spec.dilation, spec.pad
    (h, w), (oh, ow), (uh, uw) = spec.in_size, spec.out_size, spec.in_dilation
    c0, c1 = _clipped(-left, (ow - 1) * sw - left + (kw - 1) * dw, uw, w)
    patches, weights, geometry, sizes = [], [], [], []
    where = np.zeros((spec.groups, spec.batch, spec.out_channels, oh, ow, plan.splits[3]), np.int64)
    offset = 0
    for g, b, o, r, ci, c in _tasks(spec, plan):
        r0, r1 = _clipped(r.start * sh - top, (r.stop - 1) * sh - top + (kh - 1) * dh, uh, h)
        patches.append(x_index[g, b, c, r0:r1, c0:c1].reshape(-1))
        weights.append(w_index[g, o, c].reshape(-1))
        nb, nc, nr, no = b.stop - b.start, c.stop - c.start, r.stop - r.start, o.stop - o.start
        geometry.append(
            (nb, nc, r1 - r0, c1 - c0, no, nr, ow, kh, kw, sh, sw, dh, dw, uh, uw)
            + (r.start * sh - top - r0 * uh, -left - c0 * uw)
        )
        size = nb * no * nr * ow
        where[g, b, o, r, :, ci] = offset + np.arange(size).reshape(nb, no, nr, ow)
        sizes.append(size)
        offset += size
    return patches, weights, np.array(geometry, np.int32), np.array(sizes, np.int64), where


class ConvLayout(NamedTuple):
    """Everything a convolution's vertices and exchanges are built from: the tile of each task, the index
    maps of the patch and weight gathers (and each task's count of each), the geometry constant (shared by
    repeated layers, as any constant), the partials' sizes and dtype, and for each result element its
    partial from each input-channel block, and whether the vertices fold the kernel columns into the channels."""

    tiles: np.ndarray
    patch_index: np.ndarray
    patch_counts: np.ndarray
    weight_index: np.ndarray
    weight_counts: np.ndarray
    geometry: object
    out_sizes: np.ndarray
    partial: DType
    q: np.ndarray
    fold: bool


def _conv_layout(lw, x_index, w_index, spec, dtype, order):
    partial = lw.partials_type if dtype == DType.float16 else DType.float32
    plan = plan_conv(lw.target, spec, dtype, partial, lw.available_memory)
    patches, weights, geometry, out_sizes, where = _layout(spec, plan, x_index, w_index)
    tiles = lw.task_tiles(len(out_sizes))
    # The geometry is vertex state: placed on each tile when the program loads, as Poplar places it.
    place = TileMapping.on_tiles(np.full(len(tiles), len(oc.CONV_GEOMETRY)), tiles)
    geom = lw.dg.add_tensor(geometry.shape, DType.int32, place, "conv-geometry", "constant", geometry)
    q = where.reshape(-1, plan.splits[3])[np.asarray(order).reshape(-1)]
    counts = [np.array([p.size for p in parts], np.int64) for parts in (patches, weights)]
    return ConvLayout(
        tiles,
        np.concatenate(patches),
        counts[0],
        np.concatenate(weights),
        counts[1],
        geom,
        out_sizes,
        partial,
        q,
        plan.fold,
    )


def direct_conv(lw, x_srcs, x_index, w_srcs, w_index, spec, dtype, shape, order):
    """The convolution ``spec`` as CONV vertices: input element (g, n, c, y, x) is element ``x_index[g, n, c,
    y, x]`` of ``x_srcs``, weight (g, o, c, i, j) element ``w_index[...]`` of ``w_srcs``. Returns a new
    tensor of ``shape`` whose element k is output (G, N, O, OH, OW) element ``order[k]`` (flat).

    A layout depends only on what its key names, so a repeated layer (same shapes, dtypes, placements and
    memory proportion) reuses the layout of its first instance."""
    where = (lw.target.first_tile, lw.target.num_tiles, lw.available_memory, lw.dither)
    key = (where, dtype, spec, _sources_key(x_srcs), _sources_key(w_srcs))
    key += (_index_key(x_index), _index_key(w_index), _index_key(np.asarray(order)))
    if key not in lw.conv_layouts:
        lw.conv_layouts[key] = _conv_layout(lw, x_index, w_index, spec, dtype, order)
    layout = lw.conv_layouts[key]
    tiles, geometry = layout.tiles, layout.geometry.value
    fields = {}
    for name, srcs, index, counts in (
        ("patch", x_srcs, layout.patch_index, layout.patch_counts),
        ("weights", w_srcs, layout.weight_index, layout.weight_counts),
    ):
        place = TileMapping.on_tiles(counts, tiles)
        t = lw.gather((int(counts.sum()),), dtype, srcs, index, place, name=f"conv-{name}")
        ends = np.cumsum(counts)
        fields[name] = t.regions(ends - counts, ends)
    out_sizes = layout.out_sizes
    p = lw.new((int(out_sizes.sum()),), layout.partial, TileMapping.on_tiles(out_sizes, tiles))
    ends = np.cumsum(out_sizes)
    g = {name: geometry[:, i].astype(np.int64) for name, i in oc.CONV_GEOM.items()}
    taps = g["channels"] * spec.kernel[0] * spec.kernel[1]
    positions = g["batch"] * g["out_rows"] * g["out_cols"]
    cycles = vertex_cycles(lw.target, spec, layout.fold, g["channels"], g["out_channels"], positions, dtype)
    words = np.arange(len(tiles)) * len(oc.CONV_GEOMETRY)
    oc.conv(
        lw.dg.add_vertices,
        lw.dg.add_compute_set("conv"),
        tiles,
        out_sizes,
        cycles,
        patch=fields["patch"],
        weights=fields["weights"],
        geometry=layout.geometry.regions(words, words + len(oc.CONV_GEOMETRY)),
        out=p.regions(ends - out_sizes, ends),
        patch_size=layout.patch_counts,
        weights_size=layout.weight_counts,
        taps=taps,
    )
    if layout.q.shape[1] == 1 and dtype == layout.partial:
        return lw.gather(shape, dtype, [p], layout.q[:, 0], name="conv-out")
    return lw.reduce_index("sum", [p], layout.q, shape, dtype, layout.partial)


# Tiles sharing an exchange bus (*estimate*): a dithered convolution starts on the first tile of a column.
TILES_PER_COLUMN = 4


@contextlib.contextmanager
def dithered(lw, groups, batch, channels, out_channels, field):
    """Lower one pass of a convolution (forward, input or weight gradient) with Poplar's convolution
    dithering when ``lw.conv_dithering`` is set: its tasks start at a column and run in a direction both
    hashed from the forward convolution's ``groups``, input ``field`` and the product of ``batch``,
    ``channels`` and ``out_channels`` (the same for every pass, as poplin's pass-oblivious hash)."""
    if not lw.conv_dithering:
        yield
        return
    seed = zlib.crc32(np.array([groups, *field, batch * channels * out_channels], np.int64).tobytes())
    columns = -(-lw.target.num_tiles // TILES_PER_COLUMN)
    lw.dither = ((seed % columns) * TILES_PER_COLUMN, -1 if seed // columns % 2 else 1)
    try:
        yield
    finally:
        lw.dither = None
