"""The host lower bound of a faithful simulated training step (issue 17), against the measured step and eager's.

A faithful step (issue 17's rule) runs every tile's own vertices on its own memory and really copies every
byte the simulated IPU exchanges. For the compiled training step of a model (the programs one call runs),
this measures on this host, in one process, interleaved, median of ``ROUNDS`` rounds:

- the exchange floor: every exchange row of the step's programs (copy rows and compact rows, each phase as
  often as its loops run it) replayed as plain memcpy regions, one per repetition of a row, from the row's
  real source offset to its real destination offset, on a fresh arena of the executable's size
  (``TileArena.copy``, a GIL-free memcpy loop), split by bytes over as many threads as the engine uses;
- the compute floor: the step's GEMM blocks at their real per-tile shapes (each MATMUL vertex's (m, k, n), and
  each CONV vertex as the (out channels, taps, positions) GEMM of its window, the im2col unpaid) through
  NumPy's batched matmul, one call per shape; plus the bytes every other vertex reads and writes (the field
  extents ``popsim.validate`` checks) at the streaming bandwidth of a copy within a buffer of the arena's size,
  both divided by the engine's thread count (perfect scaling);
- the floor (their sum), the engine's time (inside ``Executable._run_phases``), the whole step (a
  ``trainingModel`` call) and eager PyTorch's step (forward, backward, SGD), with floor/eager, step/floor and
  engine/floor.

Each part of the floor is the faster of two kernels, both shown: the exchange regions by memcpy
(``TileArena.copy``) and by the engine as contiguous byte rows (its inline small copies); the GEMM blocks by
NumPy and by the engine's own MATMUL/CONV vertices at their real addresses. For comparison it also times the
exchange's bytes alone at streaming bandwidth (what fewer, larger rows could approach) and the engine running
only the step's exchange phases, then only its compute phases (the other phases made SYNC), on the replay's
arena.

What the floor leaves out, so it sits below any faithful engine (it is a floor, not a prediction):
- strided and broadcast source rows are charged as contiguous memcpy of the same bytes (no element gather);
- no per-phase dispatch and no barrier between BSP phases: all regions run in one loop (memcpy: every thread
  an equal share of the bytes; byte rows: one exchange phase the engine's threads share);
- NumPy's GEMMs run on float32 operands whatever their dtype, on contiguous stacks, without the vertex's own
  partials narrowing or a convolution's window gathering (the engine's own GEMM vertices, the other
  kernel, do all that, so the faster of the two never exceeds the engine's GEMM work);
- element vertices run at copy bandwidth, whatever their arithmetic (exp, erf, division...);
- nothing for streaming inputs/outputs, host-side feeds, reading results back, or the optimizer step's host
  work, which the whole step still pays.
It keeps the exact count and size of the exchange rows, so a plan with fewer, larger rows has a lower floor.

    python bench/step_bound.py [--model tutorial-cnn|encoder|small-resnet|bert-tiny] ...
"""

import argparse
import collections
import pathlib
import statistics
import sys
import threading
import time

import numpy as np

from popsim import _kernels, validate
from popsim import _opcodes as oc
from popsim._arena import TileArena

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

MODELS = ("tutorial-cnn", "encoder", "small-resnet", "bert-tiny")
ROUNDS = 9
BANDWIDTH_COPIES = 3  # the first warms the buffers' pages
MIN_COPY_BYTES = 1 << 16
MB = 1e6
_COPY = {name: i for i, name in enumerate(oc.COPY_COLUMNS)}
_RUN = {name: i for i, name in enumerate(oc.RUN_COLUMNS)}
_PH = oc.PHASES
_CONTROL = (_PH["BRANCH_IF_ZERO"], _PH["JUMP"])
_GEMM_KINDS = (oc.MATMUL, oc.CONV)
_OUT_CHANNELS = oc.CONV_GEOM["out_channels"]
_GEOMETRY_BYTES = len(oc.CONV_GEOMETRY) * 4  # int32 fields
# Engine runs here move no host streams: an empty stream table, host buffer and stream rows.
_NO_STREAMS, _NO_HOST = np.zeros((1, len(oc.STREAM_COLUMNS)), np.int64), np.zeros(0, np.uint8)
_NO_ROWS = np.zeros((0, len(oc.STREAM_ROW_COLUMNS)), np.int64)


def phase_runs(phases):
    """How many times one run of the program runs each phase: a phase inside Repeats runs the product of their
    counts. Refuses a program with branches (which branch runs depends on the data)."""
    phases = np.asarray(phases)
    if np.isin(phases[:, 0], _CONTROL).any():
        raise NotImplementedError("the bound counts phases statically; this program branches (an If)")
    runs = np.ones(len(phases), np.int64)
    counts = {}
    for p, (kind, a, b, _) in enumerate(phases.tolist()):
        if kind == _PH["LOOP_INIT"]:
            counts[a] = b
        elif kind == _PH["LOOP_BACK"]:
            runs[b:p] *= counts[a]
    return runs


def _rows_of(phases, runs, kind):
    """(row index, times it runs, phase's c column) of every table row the phases of ``kind`` run."""
    picked = [(a, b, c, r) for (k, a, b, c), r in zip(phases.tolist(), runs.tolist()) if k == kind and b > a]
    if not picked:
        return (np.zeros(0, np.int64),) * 3
    rows = np.concatenate([np.arange(a, b) for a, b, _, _ in picked])
    times = np.concatenate([np.full(b - a, r) for a, b, _, r in picked])
    column = np.concatenate([np.full(b - a, c) for a, b, c, _ in picked])
    return rows, times, column


def copy_regions(flat, runs, arena_bytes):
    """(src, dst, nbytes) memcpy regions of every exchange row of ``flat`` as often as it runs: one region per
    repetition of a row, at its real offsets. A source that would run past the arena (a broadcast or a
    narrow stride read as contiguous bytes) is moved back inside it, keeping its size."""
    phases = np.asarray(flat.phases)
    rows, times, _ = _rows_of(phases, runs, _PH["EXCHANGE"])
    copies = np.asarray(flat.copies, np.int64).reshape(-1, len(oc.COPY_COLUMNS))[rows]
    src, dst, count, isz, reps, outer = (
        copies[:, _COPY[c]] for c in ("src", "dst", "count", "itemsize", "reps", "outer")
    )
    # Repetition k of a row reads from src + k * outer and writes the next count * itemsize bytes.
    nbytes = count * isz
    each = np.repeat(np.arange(len(copies)), reps * times)
    k = np.arange(each.size) - np.repeat(np.cumsum(reps * times) - reps * times, reps * times)
    k %= np.maximum(reps[each], 1)
    general = (src[each] + k * outer[each], dst[each] + k * nbytes[each], nbytes[each])
    rows, times, itemsize = _rows_of(phases, runs, _PH["RUNS"])
    compact = np.repeat(np.asarray(flat.runs, np.int64).reshape(-1, len(oc.RUN_COLUMNS))[rows], times, axis=0)
    compact_bytes = compact[:, _RUN["count"]] * np.repeat(itemsize, times)
    src, dst, nbytes = (np.concatenate(x) for x in zip(general, (compact[:, 0], compact[:, 1], compact_bytes)))
    return np.minimum(src, arena_bytes - nbytes), dst, nbytes


def mergeable(regions):
    """How many regions continue another's source and destination bytes (so one memcpy could do both): a
    plan's rows already coalesce what they can, so this says whether fewer regions could copy the same bytes."""
    src, dst, nbytes = (x[np.lexsort(regions[1::-1])] for x in regions)  # by destination, then source
    return int(((dst[:-1] + nbytes[:-1] == dst[1:]) & (src[:-1] + nbytes[:-1] == src[1:])).sum())


def replay_seconds(arena, regions, threads):
    """Wall seconds to memcpy ``regions`` within ``arena`` on ``threads`` threads, each an equal share of the
    bytes (TileArena.copy releases the GIL)."""
    src, dst, nbytes = regions
    cuts = np.searchsorted(np.cumsum(nbytes), np.arange(1, threads) * nbytes.sum() / threads)
    parts = [(s, d, n) for s, d, n in zip(*(np.split(x, cuts) for x in regions)) if len(n)]
    workers = [threading.Thread(target=arena.copy, args=part) for part in parts[1:]]
    start = time.perf_counter()
    for w in workers:
        w.start()
    if parts:
        arena.copy(*parts[0])
    for w in workers:
        w.join()
    return time.perf_counter() - start


def vertex_rows(flat, runs):
    """(instruction row, times it runs) of every vertex the compute phases of ``flat`` run."""
    rows, times, _ = _rows_of(np.asarray(flat.phases), runs, _PH["COMPUTE"])
    return rows, times


def gemm_shapes(table, rows, times, arena):
    """{(m, k, n): blocks} of the step's GEMM vertices: MATMUL (m, k) @ (k, n), and CONV as (out channels,
    taps) @ (taps, output positions), its out channels read from its geometry in tile memory."""
    col = oc.COL
    shapes = collections.Counter()
    for r, t in zip(rows.tolist(), times.tolist()):
        row = table[r]
        if row[col["op"]] == oc.MATMUL:
            shapes[int(row[col["p0"]]), int(row[col["p1"]]), int(row[col["n"]])] += t
        elif row[col["op"]] == oc.CONV:
            at = int(row[col["c"]])
            out_channels = int(arena.buffer[at : at + _GEOMETRY_BYTES].view(np.int32)[_OUT_CHANNELS])
            shapes[out_channels, int(row[col["p2"]]), int(row[col["n"]]) // out_channels] += t
    return shapes


def element_work(table, rows, times):
    """(element operations, bytes read and written) of the step's vertices other than GEMMs: an EXPR vertex
    counts an operation per element per op of its program, a REDUCE one per element reduced."""
    col = oc.COL
    kinds = table[rows, col["op"]]
    keep = ~np.isin(kinds, _GEMM_KINDS)
    rows, times, kinds = rows[keep], times[keep], kinds[keep]
    _, size = validate._instruction_extents(table, rows)
    for i in np.flatnonzero(kinds == oc.EXPR):  # its extents come from its program
        addr = np.zeros(size.shape[1], np.int64)
        validate._expression_extents(table, rows[i], addr, size[i])
    r = table[rows]
    n, p0, p1 = r[:, col["n"]], r[:, col["p0"]], r[:, col["p1"]]
    ops = np.where(kinds == oc.EXPR, table[np.where(kinds == oc.EXPR, p0, 0), oc.EXPR_HEAD["ops"]], 1)
    elements = np.select([kinds == oc.REDUCE, np.isin(kinds, (oc.GATHER, oc.SCATTER_ADD))], [p0 * p1, p0 * n * p1], n)
    return int((elements * ops * times).sum()), int((size.sum(axis=1) * times).sum())


class GemmFloor:
    """The step's GEMM blocks as float32 stacks, one per shape, ready to time through NumPy's batched matmul."""

    def __init__(self, shapes):
        rng = np.random.default_rng(0)
        self.stacks = [
            (
                rng.standard_normal((c, m, k), np.float32),
                rng.standard_normal((c, k, n), np.float32),
                np.empty((c, m, n), np.float32),
            )
            for (m, k, n), c in shapes.items()
        ]
        self.macs = sum(c * m * k * n for (m, k, n), c in shapes.items())
        self.blocks, self.shapes = sum(shapes.values()), len(shapes)

    def seconds(self):
        start = time.perf_counter()
        for a, b, out in self.stacks:
            np.matmul(a, b, out=out)
        return time.perf_counter() - start


def engine_seconds(arena, flat, keep, threads):
    """Wall seconds of the engine's own run of ``flat`` on ``arena`` with only the phases whose kinds are in
    ``keep`` doing work (the others become SYNC phases, so loop targets still hold)."""
    phases = np.array(flat.phases, np.int64)
    phases[~np.isin(phases[:, 0], [*keep, _PH["LOOP_INIT"], _PH["LOOP_BACK"]]), 0] = _PH["SYNC"]
    arrays = {"table": flat.instructions, "fparams": flat.fparams, "copies": flat.copies, "runs": flat.runs}
    return _run_engine(arena, phases, threads, counters=flat.num_counters, **arrays)


def gemm_engine_seconds(arena, flats, threads):
    """Wall seconds of the engine running only the step's GEMM vertices (MATMUL and CONV rows at their real
    addresses, each as often as it runs), in one compute phase per program."""
    total = 0.0
    for flat in flats:
        table = np.asarray(flat.instructions)[np.repeat(*vertex_rows(flat, phase_runs(flat.phases)))]
        table = table[np.isin(table[:, oc.COL["op"]], _GEMM_KINDS)]
        phases = np.array([[_PH["COMPUTE"], 0, len(table), 0]], np.int64)
        total += _run_engine(arena, phases, threads, table=table, fparams=np.zeros(len(table)))
    return total


def regions_engine_seconds(arena, regions, threads):
    """Wall seconds of the engine copying ``regions`` as contiguous byte rows (its inline small copies, one
    compact row each, in one exchange phase)."""
    src, dst, nbytes = regions
    runs = np.stack([src, dst, nbytes, np.ones_like(nbytes)], axis=1).astype(np.int32)
    phases = np.array([[_PH["RUNS"], 0, len(runs), 1]], np.int64)
    return _run_engine(arena, phases, threads, runs=runs)


def _run_engine(arena, phases, threads, table=None, fparams=None, copies=None, runs=None, counters=0):
    """Wall seconds of one ``_kernels.run_program`` call of ``phases``: no host streams or stream phases."""
    table = np.ascontiguousarray(np.zeros((0, oc.NCOLS), np.int64) if table is None else table)
    fparams = np.zeros(len(table)) if fparams is None else np.asarray(fparams, float)
    copies = np.zeros((0, len(oc.COPY_COLUMNS)), np.int32) if copies is None else copies
    runs = np.zeros((0, len(oc.RUN_COLUMNS)), np.int32) if runs is None else runs
    cycles, loops = np.zeros(len(phases), np.int64), np.zeros(max(counters, 1), np.int64)
    start = time.perf_counter()
    tables = (table, fparams, copies, loops, _NO_ROWS, _NO_STREAMS, _NO_HOST)
    _kernels.run_program(arena, phases, cycles, *tables, threads, 0, runs)
    return time.perf_counter() - start


def streaming_bandwidth(nbytes):
    """Bytes read plus written per second by a copy within a buffer of ``nbytes``: the best of a few copies."""
    half = max(nbytes // 2, MIN_COPY_BYTES)
    src, dst = np.ones(half, np.uint8), np.zeros(half, np.uint8)
    best = np.inf
    for _ in range(BANDWIDTH_COPIES):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * half / best


class StepFloor:
    """The floor of one step of ``exe`` running ``flats`` (the programs one call ran), timed on demand."""

    def __init__(self, exe, flats):
        self.threads, self.flats = exe.num_threads, flats
        arena = exe.arena
        self.arena_bytes = arena.num_tiles * arena.tile_bytes
        # A copy of the device's memory, so the replay reads the step's real pages rather than untouched zeros.
        self.arena = TileArena(arena.num_tiles, arena.tile_bytes)
        self.arena.buffer[:] = arena.buffer
        regions, shapes = [], collections.Counter()
        self.rows = self.element_ops = self.element_bytes = 0
        for flat in flats:
            runs = phase_runs(flat.phases)
            regions.append(copy_regions(flat, runs, self.arena_bytes))
            self.rows += sum(len(_rows_of(np.asarray(flat.phases), runs, _PH[k])[0]) for k in ("EXCHANGE", "RUNS"))
            rows, times = vertex_rows(flat, runs)
            table = np.asarray(flat.instructions)
            shapes += gemm_shapes(table, rows, times, arena)
            ops, nbytes = element_work(table, rows, times)
            self.element_ops += ops
            self.element_bytes += nbytes
        self.regions = tuple(np.concatenate(x) for x in zip(*regions))
        src, dst, nbytes = self.regions
        self.bytes = int(nbytes.sum())
        self.across = int(nbytes[src // arena.tile_bytes != dst // arena.tile_bytes].sum())
        self.gemm = GemmFloor(shapes)

    def seconds(self):
        """The floor's figures and the engine's split of one step, in seconds, measured now: FIGURES."""
        a, flats, threads = self.arena, self.flats, self.threads
        bandwidth = streaming_bandwidth(self.arena_bytes) * threads
        return (
            replay_seconds(a, self.regions, threads),
            regions_engine_seconds(a, self.regions, threads),
            self.bytes / bandwidth,
            self.gemm.seconds() / threads,
            gemm_engine_seconds(a, flats, threads),
            self.element_bytes / bandwidth,
            sum(engine_seconds(a, flat, (_PH["EXCHANGE"], _PH["RUNS"]), threads) for flat in flats),
            sum(engine_seconds(a, flat, (_PH["COMPUTE"],), threads) for flat in flats),
        )


# StepFloor.seconds' figures, then measure's.
FIGURES = (
    "exchange_memcpy", "exchange_rows", "exchange_bandwidth", "gemm_numpy", "gemm_engine", "element",
    "engine_exchange", "engine_compute",
)  # fmt: skip
MEASURED = ("engine", "step", "eager")


def _engine_watch(exe):
    """Record every engine run of ``exe``: a list of (program's flat arrays, seconds in the engine)."""
    runs = []
    run_phases = exe._run_phases

    def timed(flat, table, host):
        start = time.perf_counter()
        try:
            return run_phases(flat, table, host)
        finally:
            runs.append((flat, time.perf_counter() - start))

    exe._run_phases = timed
    return runs


def measure(name):
    """The floor of model ``name``'s training step and its median figures over interleaved rounds."""
    # Imported here: the floor's helpers above need only NumPy and popsim, so popsim's tests can pin them.
    import torch
    from models import STEPS_PER_ROUND, _timed, threads, training_steps

    import poptorch

    torch.set_num_threads(threads())
    training, sim_step, eager_step = training_steps(name, poptorch.Options().showCompilationProgressBar(False))
    sim_step()  # compiles
    eager_step()
    engine = _engine_watch(training._exe)
    sim_step()
    floor = StepFloor(training._exe, [flat for flat, _ in engine])
    floor.seconds()  # warm
    rounds = []
    for _ in range(ROUNDS):  # interleaved: a slow spell of the shared machine hits every figure alike
        eager_s = _timed(eager_step)
        engine.clear()
        step_s = _timed(sim_step)
        engine_s = sum(s for _, s in engine) / STEPS_PER_ROUND
        rounds.append((*floor.seconds(), engine_s, step_s, eager_s))
    training.detachFromDevice()
    return floor, np.array(rounds)


HEADER = (
    f"{'model':<13} {'MB':>6} {'MB across':>9} {'rows':>9} {'regions':>9} {'MMACs':>6} {'Mel.ops':>7} {'el.MB':>6} "
    f"{'xchg':>6} {'gemm':>6} {'elem':>6} {'floor':>6} {'eng.x':>6} {'eng.c':>6} {'engine':>6} {'step':>6} "
    f"{'eager':>6} {'floor/eager':>11} {'step/floor':>10} {'engine/floor':>12}"
)
LEGEND = (
    "times in ms, medians of rounds: xchg/gemm/elem the floor's parts (each the faster of its two kernels, shown "
    "below a row), eng.x/eng.c the engine's own run of only the exchange / only the compute phases; MB and MB "
    "across: bytes the exchange rows copy, and those between tiles; rows: exchange rows; regions: their repetitions"
)


def row(name):
    """One line of the table for model ``name``."""
    floor, rounds = measure(name)
    f = dict(zip(FIGURES + MEASURED, rounds.T))
    exchange = np.minimum(f["exchange_memcpy"], f["exchange_rows"])
    gemm = np.minimum(f["gemm_numpy"], f["gemm_engine"])
    total = exchange + gemm + f["element"]
    parts = (exchange, gemm, f["element"], total, f["engine_exchange"], f["engine_compute"])
    ms = [statistics.median(x) * 1e3 for x in (*parts, f["engine"], f["step"], f["eager"])]
    ratios = [statistics.median(x) for x in (total / f["eager"], f["step"] / total, f["engine"] / total)]
    counts = f"{floor.bytes / MB:6.1f} {floor.across / MB:9.1f} {floor.rows:9,} {len(floor.regions[0]):9,}"
    work = f"{floor.gemm.macs / 1e6:6.1f} {floor.element_ops / 1e6:7.2f} {floor.element_bytes / MB:6.1f}"
    times = " ".join(f"{v:6.2f}" for v in ms)
    line = f"{name:<13} {counts} {work} {times} {ratios[0]:11.2f} {ratios[1]:10.2f} {ratios[2]:12.2f}"
    kernels = ("exchange_memcpy", "exchange_rows", "exchange_bandwidth", "gemm_numpy", "gemm_engine")
    detail = (
        "  ms: exchange by memcpy {:.2f}, as engine byte rows {:.2f}, its bytes alone at streaming bandwidth {:.2f}; "
        "GEMMs by NumPy {:.2f}, by the engine {:.2f}; median region {:.0f} B, {:,} mergeable; {:,} GEMM blocks of "
        "{} shapes"
    )
    figures = [statistics.median(f[k]) * 1e3 for k in kernels]
    figures += [np.median(floor.regions[2]), mergeable(floor.regions), floor.gemm.blocks, floor.gemm.shapes]
    return f"{line}\n{detail.format(*figures)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, action="append", help="default: every model")
    args = parser.parse_args()
    print(LEGEND)
    print(HEADER, flush=True)
    for name in args.model or MODELS:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
