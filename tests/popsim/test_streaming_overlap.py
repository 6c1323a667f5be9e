"""compile(..., overlap_streaming=True): the allocator holds a phase's streaming-memory loads from the start
of the phase before and its stored tensors to the end of the phase after (within one pass), as
``place_phases`` overlaps those transfers with the neighbouring phases' compute."""

import numpy as np
import pytest

import popir
import popsim

ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=256 * 1024)
PHASES, WIDTH, BATCH = 3, 16, 128


def _phased_graph(activation=popir.ops.sin):
    """One activation(h @ w) layer per phase on IPU 0: the backward pass reads every phase's activations (with
    tanh, each phase's output is read by its own backward phase, tanh's gradient, and by the next phase's, the
    weight gradient of the layer it feeds)."""
    g = popir.Graph("train")
    h = g.add_input("x", (BATCH, WIDTH), "float32")
    ws = [g.add_input(f"w{p}", (WIDTH, WIDTH), "float32", kind="parameter") for p in range(PHASES)]
    with g.annotate(role="forward"):
        for p, w in enumerate(ws):
            with g.placed((p, 0)):
                h = activation(popir.ops.matmul(h, w))
        with g.placed((PHASES - 1, 0)):
            loss = popir.ops.reduce_sum(h, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    for p, grad in enumerate(popir.autodiff.grad(g, loss, ws)):
        g.output(f"grad{p}", grad)
    return g


def _compile(overlap, target=ROOMY):
    return popsim.compile(_phased_graph(), target=target, spill="backward", overlap_streaming=overlap)


def _feeds():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32)}
    weights = {f"w{p}": (rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32) for p in range(PHASES)}
    return feeds, weights


def _compute_spans(points, units):
    """{(phase, pass): [first point, last point]} of each unit's compute (its points but the transfers)."""
    spans = {}
    for point, (label, unit) in enumerate(zip(points, units)):
        if unit is not None and not label.startswith("remote "):
            spans.setdefault(tuple(unit), [point, point])[1] = point
    return spans


def test_overlapped_transfers_hold_their_tensors_into_the_neighbouring_phases():
    plain, overlapped = _compile(False), _compile(True)
    feeds, weights = _feeds()
    expected = popir.interpreter.run(_phased_graph(), {**feeds, **weights})
    for exe in (plain, overlapped):
        for name, value in weights.items():
            exe.write_variable(name, value)
        outputs = exe.run(feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(outputs[name], value, rtol=1e-4, atol=1e-4)
    before, after = (exe.profile.programs["train"] for exe in (plain, overlapped))
    assert before["liveness"]["points"] == after["liveness"]["points"]  # the same program, placed apart
    points, units = after["liveness"]["points"], after["liveness"]["units"]
    spans = _compute_spans(points, units)
    extended = 0
    # The same tensors, in order of first use (of their extended lifetimes with overlap).
    assert sorted(t["name"] for t in after["tensors"]) == sorted(t["name"] for t in before["tensors"])
    assert [t["first"] for t in after["tensors"]] == sorted(t["first"] for t in after["tensors"])
    for t in after["tensors"]:
        (was,) = [w for w in before["tensors"] if w["name"] == t["name"]]  # a value is loaded once per phase here
        first, last = was["first"], was["last"]
        if t["name"].startswith("remote load"):
            phase, direction = units[first]  # the load's own unit; the backward pass runs phase 2, 1, 0
            earlier = spans[(phase + 1, direction)][0] if phase + 1 < PHASES else first
            assert (t["first"], t["last"]) == (earlier, last)
            extended += earlier < first
        elif last is not None and points[last].startswith("remote store"):
            phase, direction = units[last]
            later = spans[(phase + 1, direction)][1] if phase + 1 < PHASES else last
            assert (t["first"], t["last"]) == (first, later)
            extended += later > last
        else:
            assert (t["first"], t["last"]) == (first, last)
    assert extended >= 2 * (PHASES - 1)  # every phase's transfers but the first backward and last forward ones
    assert after["memory_max_tile_bytes"] > before["memory_max_tile_bytes"]


def test_a_tile_the_overlap_takes_over_its_memory_is_out_of_memory():
    peak = _compile(False).profile.programs["train"]["memory_max_tile_bytes"]
    tight = popsim.Target.small(num_tiles=4, tile_bytes=peak)
    assert _compile(False, tight).profile.programs["train"]["memory_max_tile_bytes"] <= peak
    with pytest.raises(popsim.OutOfMemoryError, match="out of memory on"):
        _compile(True, tight)


def _store_of(program, name):
    """The tile tensor whose last use is the store ``name`` (in ``program``'s liveness points)."""
    points = program["liveness"]["points"]
    (tensor,) = [t for t in program["tensors"] if t["last"] is not None and points[t["last"]] == name]
    return tensor


def test_a_parked_activation_is_stored_in_the_unit_of_its_last_forward_reader():
    """Phase 0's sin output is read by phase 1's matmul, so its store sits after that matmul: it belongs to
    phase 1 (its program position), the schedule runs it there (between phase 1's matmul and sin, holding the
    tiles without overlap) and, with overlap, its tile tensor lives on to the end of phase 2's compute."""
    plain, overlapped = (_compile(o).profile.programs["train"] for o in (False, True))
    steps = plain["steps"]
    for i, step in enumerate(steps):
        if step["name"].startswith("remote store"):
            reader = [s for s in steps[:i] if "transfer" not in s][-1]
            assert (step["stage"], step["role"]) == (reader["stage"], reader["role"])
    store = "remote store sin %5"
    (step,) = [s for s in steps if s["name"] == store]
    assert step["stage"] == 1

    timeline = popsim.Timeline()
    popsim.schedule.place_phases(timeline, plain, ROOMY, set(), 0, [0])
    unit = [i for i in timeline.intervals if i.label.get("phase") == 1 and i.label.get("pass") == "forward"]
    kinds = [i.label.get("transfer") for i in sorted(unit, key=lambda i: i.start)]
    assert kinds[:3] == [None, popsim.timeline.STREAMING_MEMORY, None]  # matmul, its input's store, sin

    points, units = overlapped["liveness"]["points"], overlapped["liveness"]["units"]
    phase2 = [p for p, u in enumerate(units) if u == [2, "forward"] and not points[p].startswith("remote ")]
    was = _store_of(plain, store)
    (now,) = [t for t in overlapped["tensors"] if t["name"] == was["name"]]
    assert (now["first"], now["last"]) == (was["first"], phase2[-1])


def test_a_kept_value_is_loaded_once_for_neighbouring_phases_on_its_ipu():
    feeds, weights = _feeds()
    expected = popir.interpreter.run(_phased_graph(popir.ops.tanh), {**feeds, **weights})
    runs = {}
    for keep in (False, True):
        spill = popsim.remote.Spill("backward", keep_adjacent=keep)
        exe = popsim.compile(_phased_graph(popir.ops.tanh), target=ROOMY, spill=spill, overlap_streaming=True)
        for name, value in weights.items():
            exe.write_variable(name, value)
        outputs = exe.run(feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(outputs[name], value, rtol=1e-4, atol=1e-4)
        runs[keep] = exe.profile.programs["train"]
    loads = {k: [s["name"] for s in p["steps"] if s["name"].startswith("remote load")] for k, p in runs.items()}
    assert len(set(loads[True])) == len(loads[True]) == len(loads[False]) - (PHASES - 1)
    # Fewer transfers; never more tile memory (the poptorch phased tests show a lower peak where activations
    # dominate it).
    assert runs[True]["total_cycles"] < runs[False]["total_cycles"]
    assert runs[True]["memory_max_tile_bytes"] <= runs[False]["memory_max_tile_bytes"]
