"""compile(..., overlap_streaming=True): the allocator holds a phase's streaming-memory loads from the start
of the phase before and its stored tensors to the end of the phase after (within one pass), as
``place_phases`` overlaps those transfers with the neighbouring phases' compute."""

import numpy as np
import pytest

import popir
import popsim

ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=256 * 1024)
PHASES, WIDTH, BATCH = 3, 16, 128


def _phased_graph():
    """One sin(h @ w) layer per phase on IPU 0: the backward pass reads every phase's activations."""
    g = popir.Graph("train")
    h = g.add_input("x", (BATCH, WIDTH), "float32")
    ws = [g.add_input(f"w{p}", (WIDTH, WIDTH), "float32", kind="parameter") for p in range(PHASES)]
    with g.annotate(role="forward"):
        for p, w in enumerate(ws):
            with g.placed((p, 0)):
                h = popir.ops.sin(popir.ops.matmul(h, w))
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
    """{(phase, pass): [first point, last point]} of each unit's compute: a store runs with its own unit's
    transfers though it sits after the last reader of what it stores, which may be in the next unit."""
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
