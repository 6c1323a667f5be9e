"""The matmul planner: how to split (B, M, N, K) over tiles, chosen by the cost model."""

import functools
import math
from typing import NamedTuple

import numpy as np

from popir import DType
from popsim import cost
from popsim.mapping import TileMapping

# Poplar's default availableMemoryProportion: the share of a tile's memory a matmul or convolution plan may
# use for its temporary operand blocks and partials.
DEFAULT_AVAILABLE_MEMORY = 0.6

# Vertex state of one reduce vertex (its header and two fields), resident on each tile that reduces.
REDUCE_VERTEX_BYTES = 16


class MatmulPlan(NamedTuple):
    gm: int
    gn: int
    gk: int
    mb: int
    nb: int
    kb: int
    cycles: int
    memory: int  # temporary bytes on the busiest tile (see ``temporary_bytes``)


def _splits(size):
    """Candidate split counts of an axis: 1..32, powers of two, and the whole axis, each giving distinct blocks."""
    size = max(size, 1)
    counts = set(range(1, min(size, 32) + 1)) | {size}
    g = 32
    while g < size:
        counts.add(g)
        g *= 2
    return sorted({-(-size // (-(-size // g))) for g in counts})


def _plan_cycles(target, batch, m, n, gk, mb, nb, kb, dtype, per_tile, partials):
    """Estimated cycles of candidate splits (arrays, one entry per candidate): operand exchange + AMP compute
    + reduction of the ``partials``, each BSP phase with its sync (a K-split or a cast of the partials adds a
    compute phase to the result's exchange)."""
    operand_bytes = (mb * kb + kb * nb) * dtype.itemsize
    reduced = (gk > 1) | (dtype != partials)
    cycles = np.where(reduced, 4, 3) * target.bsp_sync_cycles + per_tile * cost.amp_cycles(target, mb, kb, nb, dtype)
    # Each contiguous operand row received is one exchange region with its own setup cycles.
    cycles += cost.exchange_cycles(target, per_tile * operand_bytes) + per_tile * (mb + kb)
    return cycles + result_cycles(target, math.ceil(batch * m * n / target.num_tiles), gk, reduced, partials)


def result_cycles(target, rows, gk, reduced, partials):
    """Estimated cycles to bring a matmul's result to ``rows`` elements on its busiest tile: the ``gk``
    partials of each gathered and reduced when ``reduced``, else the result gathered."""
    reduction = cost.exchange_cycles(target, rows * gk * partials.itemsize) + cost.reduce_cycles(
        target, rows, gk, partials
    )
    return np.where(reduced, reduction, cost.exchange_cycles(target, rows * 4))


def result_rows(target, size, itemsize):
    """Elements of a ``size``-element result (linearly mapped, as the reduction's output) on its busiest tile."""
    mapping = TileMapping.linear(size, itemsize, target)
    return int((mapping.stops - mapping.starts).max(initial=0))


def temporary_bytes(target, per_tile, operand_bytes, partial_bytes, reduced, gk, rows, partials, dtype):
    """Peak temporary bytes on the busiest tile of a split (arrays, one per candidate): the larger of the
    compute phase (operand blocks and partials) and the reduction (partials still live, each of the ``rows``
    result elements' ``gk`` partials gathered to its tile when ``reduced``, and the result), so that a plan
    with more K-splits is charged for the partials it exchanges and reduces, and for the reduction's codelet
    and vertices, resident on every tile for the whole program."""
    partial_live = per_tile * partial_bytes
    gathered = np.where(reduced, rows * gk * partials.itemsize, 0)
    peak = np.maximum(partial_live + per_tile * operand_bytes, partial_live + gathered + rows * dtype.itemsize)
    return peak + np.where(reduced, target.code_bytes_per_codelet + REDUCE_VERTEX_BYTES, 0)


@functools.lru_cache(maxsize=512)
def plan_matmul(target, batch, m, n, k, dtype, partials=DType.float32, available_memory=DEFAULT_AVAILABLE_MEMORY):
    """The split with the fewest estimated cycles whose per-tile operands and partials fit in the
    ``available_memory`` proportion of a tile (else the smallest split by memory, as Poplar replans for the
    least memory when the proportion is too low). ``partials`` is the dtype the AMP accumulates in and the
    K-split reduces.

    Each task (b, i, j, kk) computes an (mb x kb) @ (kb x nb) partial on one tile; tasks beyond the tile
    count share tiles round-robin. Candidates are costed together as arrays; ties go to the first in
    (gm, gn, gk) order.
    """
    grids = np.meshgrid(*(np.array(_splits(size), np.int64) for size in (m, n, k)), indexing="ij")
    gm, gn, gk = (a.reshape(-1) for a in grids)
    keep = batch * gm * gn * gk <= max(target.num_tiles, batch)
    gm, gn, gk = gm[keep], gn[keep], gk[keep]
    mb, nb, kb = -(-m // gm), -(-n // gn), -(-k // gk)
    per_tile = -(-(batch * gm * gn * gk) // target.num_tiles)
    reduced = (gk > 1) | (dtype != partials)
    rows = result_rows(target, batch * m * n, dtype.itemsize)
    operand_bytes = (mb * kb + kb * nb) * dtype.itemsize
    memory = temporary_bytes(
        target, per_tile, operand_bytes, mb * nb * partials.itemsize, reduced, gk, rows, partials, dtype
    )
    cycles = _plan_cycles(target, batch, m, n, gk, mb, nb, kb, dtype, per_tile, partials)
    fits = np.flatnonzero(memory <= int(target.tile_bytes * available_memory))
    # Nothing fits: the fastest of the plans needing the least memory (the allocator reports any overflow).
    pick = fits[np.argmin(cycles[fits])] if fits.size else np.lexsort((cycles, memory))[0]
    return MatmulPlan(*(int(a[pick]) for a in (gm, gn, gk, mb, nb, kb, cycles, memory)))
