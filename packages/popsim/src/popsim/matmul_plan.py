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
    out, g = set(), 1
    while g < size:
        out.add(g)
        g *= 2
    out.add(max(size, 1))
    return sorted(out)


@functools.lru_cache(maxsize=512)
def plan_matmul(target, batch, m, n, k, dtype):
    """The split with the fewest estimated cycles whose per-tile operands fit in half a tile.

    Each task (b, i, j, kk) computes an (mb x kb) @ (kb x nb) partial on one tile; tasks beyond the tile
    count share tiles round-robin. Estimated cost: operand exchange + AMP compute + partial reduction.
    """
    itemsize = dtype.itemsize
    tiles = target.num_tiles
    best = None
    for gm in _splits(m):
        for gn in _splits(n):
            for gk in _splits(k):
                tasks = batch * gm * gn * gk
                if tasks > max(tiles, batch):
                    continue
                mb, nb, kb = -(-m // gm), -(-n // gn), -(-k // gk)
                per_tile = math.ceil(tasks / tiles)
                operand_bytes = (mb * kb + kb * nb) * itemsize
                if per_tile * (operand_bytes + mb * nb * 4) > target.tile_bytes // 2:
                    continue
                cycles = per_tile * (cost.amp_cycles(target, mb, kb, nb, dtype))
                cycles += cost.exchange_cycles(target, per_tile * operand_bytes)
                if gk > 1 or itemsize != 4:
                    rows = math.ceil(batch * m * n / tiles)
                    cycles += cost.exchange_cycles(target, rows * gk * 4)
                    cycles += cost.reduce_cycles(target, rows, gk, dtype)
                else:
                    cycles += cost.exchange_cycles(target, math.ceil(batch * m * n / tiles) * 4)
                if best is None or cycles < best.cycles:
                    best = MatmulPlan(gm, gn, gk, mb, nb, kb, cycles)
    if best is None:
        best = MatmulPlan(m, n, k, 1, 1, 1, 0)
    return best
