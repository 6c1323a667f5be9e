"""Provenance in the profile: each compute set, exchange and tensor names the popir node it came from, tile
memory is broken down by tensor and category, and memory liveness covers the program."""

import json

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import provenance
from popsim.provenance import CATEGORIES


def _training_graph():
    """A linear layer, its loss, autodiff and a momentum-SGD update, annotated as a frontend would."""
    g = popir.Graph("train")
    x = g.add_input("x", (8, 16), "float32")
    w = g.add_input("fc.weight", (16, 4), "float32", kind="parameter")
    v = g.add_input("fc.weight.momentum", (16, 4), "float32", kind="optimizer_state")
    with g.annotate(module="fc", aten="aten.mm.default", source="net.py:3: y = x @ w", role="forward"):
        y = x @ w
    with g.annotate(module="", aten="aten.sum.default", source="net.py:4: loss = y.sum()", role="forward"):
        loss = ops.reduce_sum(y * y, axes=(0, 1), keepdims=False)
    g.output("loss", loss)
    (dw,) = popir.autodiff.grad(g, loss, [w])
    with g.annotate(module="fc", role="optimizer"):
        new_v = v * 0.9 + dw
        g.update(v, new_v)
        g.update(w, w - new_v * 0.01)
    return g


def _profile():
    exe = popsim.compile(_training_graph(), popsim.Target.small())
    return exe, exe.profile.programs["train"]


def test_steps_name_the_module_aten_op_source_line_and_role_they_came_from():
    _, p = _profile()
    origins = [s["origin"] for s in p["steps"] if s["kind"] != "host" and s.get("origin")]
    assert {o.get("role") for o in origins} == {"forward", "backward", "optimizer"}
    matmuls = [o for o in origins if o.get("aten") == "aten.mm.default"]
    assert {o["role"] for o in matmuls} == {"forward", "backward"}
    assert all(o["module"] == "fc" and o["source"] == "net.py:3: y = x @ w" for o in matmuls)
    compute = [s for s in p["steps"] if s["kind"] == "compute"]
    assert all(s["origin"] and s["tiles"] > 0 and s["ipus"] == [0] for s in compute)


def test_memory_is_broken_down_by_tensor_and_category_per_tile():
    exe, p = _profile()
    by_category = {k: np.array(v) for k, v in p["memory_by_category"].items()}
    assert set(by_category) == set(CATEGORIES)
    tensors = p["tensors"]
    kinds = {t["category"] for t in tensors}
    assert {"variables", "optimizer state", "inputs", "activations", "gradients", "temporaries"} <= kinds
    names = {t["name"]: t for t in tensors}
    assert names["fc.weight"]["category"] == "variables"
    assert names["fc.weight.momentum"]["category"] == "optimizer state"
    assert names["x"]["category"] == "inputs"
    # Each tensor's bytes per tile add up to its category's bytes per tile, and to the tensor's size.
    rebuilt = {k: np.zeros(exe.target.num_tiles, np.int64) for k in CATEGORIES}
    for t in tensors:
        for first, count, nbytes in t["tile_runs"]:
            rebuilt[t["category"]][first : first + count] += nbytes
        assert sum(count * nbytes for _, count, nbytes in t["tile_runs"]) == t["bytes"]
    for k in CATEGORIES:
        np.testing.assert_array_equal(rebuilt[k], by_category[k])
    assert names["fc.weight"]["bytes"] == 16 * 4 * 4
    # Runs are maximal: neighbouring runs differ in bytes or are not adjacent.
    for t in tensors:
        runs = t["tile_runs"]
        assert all(a[0] + a[1] != b[0] or a[2] != b[2] for a, b in zip(runs, runs[1:]))
    gradients = [t for t in tensors if t["category"] == "gradients"]
    assert all(t["role"] == "backward" for t in gradients)
    assert len(p["tile_budget_bytes"]) == exe.target.num_tiles
    assert all(b <= exe.target.tile_bytes for b in p["tile_budget_bytes"])


def test_liveness_covers_every_program_point_and_keeps_variables_resident():
    _, p = _profile()
    live = p["liveness"]
    points = len(live["points"])
    assert points == len(live["modules"]) > 3
    curves = {k: np.array(v) for k, v in live["bytes"].items()}
    assert all(c.shape == (points,) and (c >= 0).all() for c in curves.values())
    assert (curves["variables"] == 16 * 4 * 4).all()
    assert curves["activations"].max() > 0 and curves["gradients"].max() > 0
    assert curves["inputs"][0] == 8 * 16 * 4


def test_each_tiles_peak_point_is_where_its_live_tensor_bytes_peak_and_the_allocator_holds_them():
    exe, p = _profile()
    points = len(p["liveness"]["points"])
    live = np.zeros((points, exe.target.num_tiles), np.int64)  # bytes live on each tile at each point
    for t in p["tensors"]:
        last = points - 1 if t["last"] is None else min(t["last"], points - 1)
        for first, count, nbytes in t["tile_runs"]:
            live[max(t["first"], 0) : last + 1, first : first + count] += nbytes
    peaks = p["liveness"]["tile_peak_points"]
    assert len(peaks) == exe.target.num_tiles
    for tile, at in enumerate(peaks):
        if not live[:, tile].any():
            assert at is None
            continue
        # The earliest point of the most bytes; the allocator's peak there holds them, plus padding and gaps.
        assert at == int(np.argmax(live[:, tile]))
        assert live[at, tile] <= p["memory"]["tensors"][tile]
    assert any(at is not None and at > 0 for at in peaks)


def test_a_fused_compute_set_credits_every_node_it_computes():
    g = popir.Graph("main")
    x = g.add_input("x", (8, 16), "float32")
    w = g.add_input("fc.weight", (16, 8), "float32", kind="parameter")
    b = g.add_input("b", (8, 8), "float32")
    with g.annotate(module="fc", aten="aten.mm.default", source="net.py:3: y = x @ w", role="forward"):
        y = x @ w
    with g.annotate(module="act", aten="aten.relu.default", source="net.py:4: h = y.relu()", role="forward"):
        h = ops.relu(y)
    with g.annotate(module="out", aten="aten.add.Tensor", source="net.py:5: z = h + b", role="forward"):
        g.output("z", h + b)
    profile = popsim.compile(g, popsim.Target.small()).profile
    (fused,) = [s for s in profile.programs["main"]["steps"] if s.get("fused")]
    assert [(o["module"], o["elements"]) for o in fused["fused"]] == [("act", 64), ("out", 64)]
    rows = {r["module"]: r for r in profile.operations("main")}
    # Equal elements, equal shares: the relu's line gets its half of the fused cycles.
    assert rows["act"]["compute_cycles"] + rows["out"]["compute_cycles"] == fused["cycles"]
    assert abs(rows["act"]["compute_cycles"] - rows["out"]["compute_cycles"]) <= 1
    assert rows["act"]["steps"] == rows["out"]["steps"] == 1
    assert sum(r["cycles"] for r in rows.values()) == sum(s["cycles"] for s in profile.programs["main"]["steps"])
    text = profile.summary()
    assert "act (forward, aten.relu.default) at net.py:4: h = y.relu()" in text
    assert "out (forward, aten.add.Tensor) at net.py:5: z = h + b" in text


def test_a_node_lowered_before_its_reader_when_the_fused_vertex_is_full_is_credited_to_itself():
    g = popir.Graph("main")
    xs = [g.add_input(f"x{i}", (8, 8), "float32") for i in range(7)]
    with g.annotate(module="a", aten="aten.mul.Tensor", source="net.py:3: a = x0 * x1", role="forward"):
        a = xs[0] * xs[1]
    with g.annotate(module="b", aten="aten.add.Tensor", source="net.py:4: b = x2 + ... + x6", role="forward"):
        b = xs[2] + xs[3] + xs[4] + xs[5] + xs[6]
    with g.annotate(module="c", aten="aten.add.Tensor", source="net.py:5: c = a + b", role="forward"):
        g.output("c", a + b)  # seven leaves: more than one fused vertex holds
    profile = popsim.compile(g, popsim.Target.small()).profile
    rows = {r["module"]: r for r in profile.operations("main")}
    assert {"a", "b", "c"} <= set(rows)
    assert all(rows[m]["compute_cycles"] > 0 for m in "abc")
    assert sum(r["cycles"] for r in rows.values()) == sum(s["cycles"] for s in profile.programs["main"]["steps"])


def test_an_exchange_phase_shared_by_copies_of_two_nodes_credits_each_by_the_bytes_it_receives():
    g = popir.Graph("main")
    x1 = g.add_input("x1", (8, 16), "float32")
    x2 = g.add_input("x2", (8, 16), "float32")
    w = g.add_input("w", (16, 8), "float32", kind="parameter")
    with g.annotate(module="t", aten="aten.t.default", source="net.py:3: a = x1.t()", role="forward"):
        g.output("a", ops.transpose(x1, perm=(1, 0)))
    with g.annotate(module="m", aten="aten.mm.default", source="net.py:4: y = x2 @ w", role="forward"):
        g.output("y", x2 @ w)
    profile = popsim.compile(g, popsim.Target.small()).profile
    steps = profile.programs["main"]["steps"]
    # The transpose's copy and the matmul's operand copies share one exchange phase.
    (shared,) = [s for s in steps if s.get("merged")]
    parts = {o["module"]: o["bytes"] for o in shared["merged"]}
    assert set(parts) == {"t", "m"} and sum(parts.values()) == shared["bytes"]
    assert 0 < parts["t"] <= 8 * 16 * 4  # the transpose receives at most all of x1
    rows = {r["module"]: r for r in profile.operations("main")}
    assert rows["t"]["steps"] == 1 and rows["t"]["exchange_bytes"] == parts["t"]
    share = shared["cycles"] * parts["t"] // shared["bytes"]
    assert rows["t"]["exchange_cycles"] == share > 0
    assert sum(r["cycles"] for r in rows.values()) == sum(s["cycles"] for s in steps)
    assert "t (forward, aten.t.default) at net.py:3: a = x1.t()" in profile.summary()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_flops_utilisation_is_against_the_amp_peak_of_the_matmuls_dtype(dtype):
    g = popir.Graph("main")
    x = g.add_input("x", (8, 32), dtype)
    w = g.add_input("w", (32, 16), dtype, kind="parameter")
    g.output("y", x @ w)
    target = popsim.Target.small()
    p = popsim.compile(g, target).profile.programs["main"]
    assert p["flops_by_dtype"] == {dtype: p["flops"]} and p["flops"] >= 2 * 8 * 32 * 16
    peak_per_cycle = 2 * target.amp_macs(dtype) * target.num_tiles
    assert p["flops_utilisation"] == pytest.approx(p["flops"] / peak_per_cycle / p["total_cycles"])


def test_summary_names_modules_and_source_lines_and_the_json_round_trips():
    exe, _ = _profile()
    text = exe.profile.summary()
    assert "fc (forward, aten.mm.default) at net.py:3: y = x @ w" in text
    assert "fc (backward, aten.mm.default)" in text
    rows = exe.profile.operations("train")
    assert rows == sorted(rows, key=lambda r: (-r["cycles"], -r["memory_bytes"]))
    assert sum(r["cycles"] for r in rows) == sum(s["cycles"] for s in exe.profile.programs["train"]["steps"])
    loaded = json.loads(exe.profile.to_json())
    assert loaded["programs"]["train"]["tensors"] == exe.profile.programs["train"]["tensors"]
    again = popsim.Executable.from_bytes(exe.to_bytes())
    assert again.profile.summary() == text


def test_tile_peak_points_are_the_earliest_points_of_each_tiles_most_live_bytes():
    """On random spans (several per tile, some empty, some tiles holding none), each tile's peak point is
    the earliest point where the bytes of the spans live on it peak, as a point-by-point count gives."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        num_tiles, num_points = int(rng.integers(1, 8)), int(rng.integers(1, 12))
        spans = []
        for _ in range(int(rng.integers(0, 10))):
            tiles = np.sort(rng.choice(num_tiles, int(rng.integers(1, num_tiles + 1)), replace=False))
            start = int(rng.integers(0, num_points))
            stop = int(rng.integers(start, num_points + 1))
            spans.append((tiles, rng.integers(1, 100, tiles.size), start, stop))
        live = np.zeros((num_tiles, num_points + 1), np.int64)
        for tiles, nbytes, start, stop in spans:
            live[tiles, start:stop] += nbytes[:, None]
        expected = [int(row.argmax()) if row.max() > 0 else None for row in live]
        assert provenance.tile_peak_points(spans, num_tiles) == expected
