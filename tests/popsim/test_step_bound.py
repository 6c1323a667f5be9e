"""The helpers of bench/step_bound.py: the work it counts is the work the engine does."""

import pathlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import _kernels
from popsim import _opcodes as oc
from popsim._arena import TileArena

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import step_bound  # noqa: E402

PH = oc.PHASES
TILE_BYTES = 256


def _phase(kind, a=0, b=0, c=0):
    return [PH[kind], a, b, c]


def test_phase_runs_multiplies_nested_repeat_counts_and_refuses_branches():
    phases = np.array(
        [
            _phase("COMPUTE", 0, 1),
            _phase("LOOP_INIT", 0, 3),
            _phase("EXCHANGE", 0, 1),  # phase 2: the outer body starts here
            _phase("LOOP_INIT", 1, 4),
            _phase("COMPUTE", 1, 2),  # phase 4: the inner body
            _phase("LOOP_BACK", 1, 4),
            _phase("LOOP_BACK", 0, 2),
            _phase("SYNC"),
        ]
    )
    assert step_bound.phase_runs(phases).tolist() == [1, 1, 3, 3, 12, 3, 1, 1]
    with pytest.raises(NotImplementedError, match="branches"):
        step_bound.phase_runs(np.array([_phase("BRANCH_IF_ZERO", 0, 4, 1), _phase("SYNC")]))


def _looped_exchange():
    """A program whose loop runs twice an exchange of contiguous copy rows (one of three repetitions) and a
    RUNS phase of 2-byte compact rows, sources on tiles 0-1 and destinations on tiles 2-3."""
    copies = np.array(
        [
            # src, dst, count, stride, itemsize, reps, outer
            [0, 2 * TILE_BYTES, 4, 4, 4, 3, 40],
            [100, 2 * TILE_BYTES + 64, 5, 1, 1, 1, 0],
        ],
        np.int32,
    )
    runs = np.array([[TILE_BYTES, 3 * TILE_BYTES, 6, 2], [TILE_BYTES + 50, 3 * TILE_BYTES + 100, 1, 2]], np.int32)
    phases = [_phase("LOOP_INIT", 0, 2), _phase("EXCHANGE", 0, 2), _phase("RUNS", 0, 2, 2), _phase("LOOP_BACK", 0, 1)]
    empty = np.zeros((0, oc.NCOLS), np.int64)
    return SimpleNamespace(phases=np.array(phases, np.int64), copies=copies, runs=runs, instructions=empty)


def test_copy_regions_copy_exactly_what_the_engine_copies():
    flat = _looped_exchange()
    engine, replay = TileArena(4, TILE_BYTES), TileArena(4, TILE_BYTES)
    data = np.random.default_rng(0).integers(0, 256, 2 * TILE_BYTES, dtype=np.uint8)
    engine.buffer[: 2 * TILE_BYTES] = replay.buffer[: 2 * TILE_BYTES] = data
    phases = flat.phases
    no_streams = (np.zeros((0, 3), np.int64), np.zeros((1, 5), np.int64), np.zeros(0, np.uint8))
    empty = (flat.instructions, np.zeros(0), flat.copies, np.zeros(1, np.int64))
    _kernels.run_program(engine, phases, np.zeros(len(phases), np.int64), *empty, *no_streams, 1, 0, flat.runs)
    src, dst, nbytes = step_bound.copy_regions(flat, step_bound.phase_runs(phases), 4 * TILE_BYTES)
    # Each repetition of a row is a region, each as often as the loop runs it.
    assert len(nbytes) == 2 * (3 + 1 + 2) and nbytes.sum() == 2 * (3 * 16 + 5 + 12 + 2)
    step_bound.replay_seconds(replay, (src, dst, nbytes), threads=2)
    assert np.array_equal(replay.buffer, engine.buffer) and replay.buffer[2 * TILE_BYTES :].any()


def _step_of(graph, feeds):
    """The instruction table, vertex rows and run counts of the one program ``graph`` compiles to."""
    exe = popsim.compile(graph, "small")
    engine_runs = step_bound._engine_watch(exe)
    exe.run(feeds)
    ((flat, _),) = engine_runs
    rows, times = step_bound.vertex_rows(flat, step_bound.phase_runs(flat.phases))
    return exe, np.asarray(flat.instructions), rows, times


@pytest.mark.parametrize("m, k, n", [(3, 7, 5), (40, 300, 50)])
def test_gemm_blocks_hold_exactly_the_matmul_macs(m, k, n):
    g = popir.Graph("mm")
    g.output("c", g.add_input("a", (m, k), "float32") @ g.add_input("b", (k, n), "float32"))
    feeds = {"a": np.ones((m, k), np.float32), "b": np.ones((k, n), np.float32)}
    exe, table, rows, times = _step_of(g, feeds)
    shapes = step_bound.gemm_shapes(table, rows, times, exe.arena)
    assert sum(count * a * b * c for (a, b, c), count in shapes.items()) == m * k * n
    assert sum(shapes.values()) == (table[rows, oc.COL["op"]] == oc.MATMUL).sum()


def test_element_work_counts_each_element_read_and_written():
    g = popir.Graph("e")
    g.output("y", ops.exp(g.add_input("x", (100,), "float32")))
    _, table, rows, times = _step_of(g, {"x": np.ones(100, np.float32)})
    assert step_bound.element_work(table, rows, times) == (100, 100 * 4 * 2)


def test_mergeable_counts_regions_that_continue_both_source_and_destination():
    # Sorted by destination: (0 -> 100, 8 B), (8 -> 108), (50 -> 112), (54 -> 116): the second continues the
    # first on both sides, the third the second's destination only, the fourth the third on both sides.
    src = np.array([50, 0, 8, 54], np.int64)
    dst = np.array([112, 100, 108, 116], np.int64)
    nbytes = np.array([4, 8, 4, 4], np.int64)
    assert step_bound.mergeable((src, dst, nbytes)) == 2
