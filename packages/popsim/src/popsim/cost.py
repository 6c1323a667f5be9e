"""Cycle estimators in the style of the PopLibs estimators (compute per vertex, exchange, sync, host).

All figures are cycles of one tile at the target's clock. A tile's 6 hardware workers take issue slots
round-robin, so work split evenly over the workers costs ``workers`` tile cycles per worker cycle.
"""

import math

import numpy as np

# Worker cycles per vector of results, by codelet family (*estimates*, as in the PopLibs tables).
_SIMPLE = (
    "copy neg abs relu sign logical_not cast add sub mul maximum minimum eq ne lt le gt ge logical_and logical_or"
    " where fill ceil floor round bitwise_not bitwise_and bitwise_or bitwise_xor"
)
_COMPLEX = {
    "div": 4, "sqrt": 5, "rsqrt": 5, "exp": 8, "log": 8, "tanh": 8, "sigmoid": 10, "erf": 12, "sin": 10, "cos": 10,
    "pow": 16, "random": 4, "acos": 16, "acosh": 16, "asin": 16, "asinh": 16, "atan": 14, "atanh": 16, "cosh": 10,
    "sinh": 10, "tan": 12, "expm1": 8, "log1p": 8, "atan2": 16, "remainder": 6,
}  # fmt: skip
CYCLES_PER_VECTOR = {**dict.fromkeys(_SIMPLE.split(), 1), **_COMPLEX}
WORKER_OVERHEAD = 10  # worker cycles to start a vertex and set up its pointers
AMP_OVERHEAD = 50  # tile cycles to load AMP weights and drain partials per matmul vertex
# poplin's PerformanceEstimation.hpp: convNx1Overhead() = 101 supervisor cycles per ConvPartialnx1 vertex.
CONV_NX1_OVERHEAD = 101
# The same file's nx1 inner-loop estimate loads the AMP's coefficients at every kernel position in
# numLoads + 9 cycles, numLoads = 4 elements x 4 loads x 8 units x (4 B float, 2 B half) / 8 B per cycle.
CONV_WEIGHT_LOAD_CYCLES = {4: 64 + 9, 2: 32 + 9}  # by activation itemsize


def elementwise_cycles(target, n, dtype, codelet):
    """Cycles of an elementwise vertex over ``n`` elements: n split over the workers, vector-wide."""
    return expression_cycles(target, n, [(codelet, dtype)])


# Worker cycles to step a 2D elementwise vertex (popops' BroadcastVectorInner2D, BroadcastScalar2D) to its next
# row: its pointers and count (*estimate*).
ROW_OVERHEAD = 4


def row_cycles(target, rows):
    """Cycles a 2D elementwise vertex adds for ``rows`` rows beyond its first (an integer or an array), the
    rows shared over the workers."""
    return target.workers * _ceil_div(rows, target.workers) * ROW_OVERHEAD


def _ceil_div(a, b):
    """ceil(a / b) of integers, or elementwise of integer arrays (the estimators cost a batch of vertices)."""
    return -(-a // b)


def expression_cycles(target, n, ops):
    """Cycles of a fused elementwise vertex (a popops map expression) over ``n`` elements (an integer or an
    array, one per vertex): each of its (codelet, operand dtype) ``ops`` at its vector rate, one start-up."""
    per_worker = _ceil_div(n, target.workers)
    vectors = sum(_ceil_div(per_worker, target.vector_width(dtype)) * CYCLES_PER_VECTOR[c] for c, dtype in ops)
    return target.workers * (vectors + WORKER_OVERHEAD)


def reduce_cycles(target, rows, group, dtype):
    """Cycles of a reduction vertex: ``rows`` outputs (an integer or an array, one per vertex), each over
    ``group`` inputs, vectorised across outputs."""
    per_worker = _ceil_div(rows, target.workers)
    vectors = _ceil_div(per_worker * group, target.vector_width(dtype))
    return target.workers * (vectors + WORKER_OVERHEAD)


def amp_cycles(target, m, k, n, dtype):
    """Cycles of a matmul partial (m x k) @ (k x n) on the AMP unit: MACs at the AMP rate plus overhead."""
    return _ceil_div(m * k * n, target.amp_macs(dtype)) + AMP_OVERHEAD + target.workers * m


def conv_cycles(target, out_channels, taps, kernel_positions, positions, dtype):
    """Cycles of a direct-convolution vertex (poplin's ConvPartialnx1 on the AMP): ``out_channels x taps x
    positions`` MACs at the AMP rate, the vertex's supervisor overhead, and a reload of the AMP's weights at
    each kernel position (all integers or arrays, one per vertex)."""
    macs = out_channels * taps * positions
    reload = CONV_WEIGHT_LOAD_CYCLES[dtype.itemsize]
    return _ceil_div(macs, target.amp_macs(dtype)) + CONV_NX1_OVERHEAD + kernel_positions * reload


def gather_cycles(target, rows, count, inner, itemsize):
    """Cycles of a dynamic-index gather/scatter vertex moving ``rows * count`` slices of ``inner`` elements."""
    slices = rows * count
    words = math.ceil(slices * inner * itemsize / target.store_bytes_per_cycle)
    return target.workers * (math.ceil(slices / target.workers) * 4 + WORKER_OVERHEAD) + words


def exchange_cycles(target, busiest_tile_bytes):
    """Cycles of one exchange phase: the busiest tile's bytes at the exchange rate plus a fixed cost (an
    integer, or an array of candidate phases' bytes as the planners cost them)."""
    cycles = _ceil_div(busiest_tile_bytes, target.exchange_bytes_per_cycle) + target.exchange_fixed_cycles
    if np.ndim(busiest_tile_bytes):
        return np.where(busiest_tile_bytes == 0, 0, cycles)
    return int(cycles) if busiest_tile_bytes else 0


def link_cycles(target, busiest_ipu_bytes):
    """Cycles for the busiest IPU's traffic over its IPU-Links in one exchange phase (0 when none)."""
    if busiest_ipu_bytes == 0:
        return 0
    per_cycle = target.ipu_link_bytes_per_second / target.clock_hz
    return math.ceil(busiest_ipu_bytes / per_cycle) + target.exchange_fixed_cycles


def host_cycles(target, nbytes):
    """Cycles to stream ``nbytes`` between host and device."""
    return math.ceil(nbytes / target.host_bytes_per_second * target.clock_hz)


# A host callback's own time, in host seconds (*estimates*): a fixed cost to hand the call to the host thread
# and back (of the order of a PCIe round trip and a thread wake-up), then the host touching each element of
# the callback's inputs and results once at a host core's streaming rate. A model, not the callback's
# measured wall time, so a run's cycles stay deterministic.
HOST_CALLBACK_SECONDS = 10e-6
HOST_CALLBACK_ELEMENTS_PER_SECOND = 1e9


def host_callback_cycles(target, elements):
    """Device cycles (at the target's clock) the tiles wait while the host runs a callback whose inputs and
    results hold ``elements`` elements in all."""
    seconds = HOST_CALLBACK_SECONDS + elements / HOST_CALLBACK_ELEMENTS_PER_SECOND
    return math.ceil(seconds * target.clock_hz)


CONTROL_CYCLES = 10  # supervisor cycles to set or step a loop counter, or to jump (*estimate*)


def branch_cycles(target):
    """Cycles of an If's decision: the condition word is broadcast to every tile (an exchange), then a sync."""
    return exchange_cycles(target, 4) + target.bsp_sync_cycles
