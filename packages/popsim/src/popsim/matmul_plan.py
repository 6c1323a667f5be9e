"""The matmul planner: how to split (B, M, N, K) over tiles, chosen by the cost model."""

import functools
import math
from typing import NamedTuple

from popsim import cost


class MatmulPlan(NamedTuple):
    gm: int
    gn: int
    gk: int
    mb: int
    nb: int
    kb: int
    cycles: int


def _splits(size):
    """Candidate split counts of an axis: 1..32, powers of two, and the whole axis, each giving distinct blocks."""
    size = max(size, 1)
    counts = set(range(1, min(size, 32) + 1)) | {size}
    g = 32
    while g < size:
        counts.add(g)
        g *= 2
    return sorted({-(-size // (-(-size // g))) for g in counts})


@functools.lru_cache(maxsize=512)
def plan_matmul(target, batch, m, n, k, dtype):
    """The split with the fewest estimated cycles whose per-tile operands fit in half a tile (else the
    smallest split by memory).

    Each task (b, i, j, kk) computes an (mb x kb) @ (kb x nb) partial on one tile; tasks beyond the tile
    count share tiles round-robin. Estimated cost: operand exchange + AMP compute + partial reduction.
    """
    itemsize = dtype.itemsize
    tiles = target.num_tiles
    best = smallest = None
    for gm in _splits(m):
        for gn in _splits(n):
            for gk in _splits(k):
                tasks = batch * gm * gn * gk
                if tasks > max(tiles, batch):
                    continue
                mb, nb, kb = -(-m // gm), -(-n // gn), -(-k // gk)
                per_tile = math.ceil(tasks / tiles)
                operand_bytes = (mb * kb + kb * nb) * itemsize
                memory = per_tile * (operand_bytes + mb * nb * 4)
                if smallest is None or memory < smallest[0]:
                    smallest = (memory, MatmulPlan(gm, gn, gk, mb, nb, kb, 0))
                if memory > target.tile_bytes // 2:
                    continue
                cycles = per_tile * (cost.amp_cycles(target, mb, kb, nb, dtype))
                # Each contiguous operand row received is one exchange region with its own setup cycles.
                cycles += cost.exchange_cycles(target, per_tile * operand_bytes) + per_tile * (mb + kb)
                if gk > 1 or itemsize != 4:
                    rows = math.ceil(batch * m * n / tiles)
                    cycles += cost.exchange_cycles(target, rows * gk * 4)
                    cycles += cost.reduce_cycles(target, rows, gk, dtype)
                else:
                    cycles += cost.exchange_cycles(target, math.ceil(batch * m * n / tiles) * 4)
                if best is None or cycles < best.cycles:
                    best = MatmulPlan(gm, gn, gk, mb, nb, kb, cycles)
    # Nothing fits: take the plan needing the least memory and let the allocator report the overflow.
    return best if best is not None else smallest[1]
