"""A Device of several IPUs is one graph over all their tiles: results are unchanged, every IPU works,
exchanges between IPUs pay for the IPU-Links and every sync spans the IPUs."""

import numpy as np
import pytest

import popir
import popsim
from popir import DType, ops

SMALL = popsim.Target.small(num_tiles=8)


def test_graph_target_holds_the_tiles_of_every_ipu():
    device = popsim.Device(popsim.Target.ipu2(), 2)
    t = device.graph_target
    assert (t.name, t.num_tiles, t.tiles_per_ipu, t.num_ipus) == ("ipu2x2", 2944, 1472, 2)
    assert t.peak_flops == 2 * popsim.Target.ipu2().peak_flops
    assert t.bsp_sync_cycles == t.sync_cycles_across_ipus
    assert popsim.Device(popsim.Target.ipu2()).graph_target == popsim.Target.ipu2()
    assert t.describe_tile(1500) == "tile 1500 (IPU 1, tile 28)"
    with pytest.raises(popsim.Error, match="at least one IPU"):
        popsim.Device(popsim.Target.ipu2(), 0)
    with pytest.raises(popsim.Error, match="one-IPU target"):
        popsim.Device(t, 2)


def _mlp_graph(placed=False):
    """x @ w, relu, row sums; ``placed`` puts the matmul on IPU 0 and the rest on IPU 1."""
    g = popir.Graph("mlp")
    x = g.add_input("x", (32, 64), DType.float32)
    w = g.add_input("w", (64, 48), DType.float32, kind="parameter")
    with g.placed((0, 0) if placed else None):
        h = x @ w
    with g.placed((1, 1) if placed else None):
        g.output("y", ops.reduce_sum(ops.relu(h), axes=(1,), keepdims=False))
    return g


def _run_on_two_ipus(g):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((32, 64)).astype(np.float32)}
    w = rng.standard_normal((64, 48)).astype(np.float32)
    expected = popir.interpreter.run(g, {**feeds, "w": w})["y"]
    exe = popsim.compile(g, popsim.Device(SMALL, 2))
    exe.write_variable("w", w)
    np.testing.assert_allclose(exe.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5)
    return exe.profile.programs["mlp"]


def test_an_unannotated_graph_stays_on_ipu_0_of_a_device():
    program = _run_on_two_ipus(_mlp_graph())
    compute = np.array(program["tile_compute_cycles"])
    exchange = np.array(program["tile_exchange_bytes"])
    assert compute.size == 16 and compute[:8].any() and not compute[8:].any()
    assert not exchange[8:].any()
    one = popsim.compile(_mlp_graph(), SMALL).profile.programs["mlp"]
    # Every sync of the two-IPU program spans both IPUs.
    assert program["sync_cycles"] % SMALL.sync_cycles_across_ipus == 0
    assert one["sync_cycles"] % SMALL.sync_cycles == 0


def test_placed_nodes_run_on_their_ipu_and_activations_cross_by_inter_ipu_copies():
    program = _run_on_two_ipus(_mlp_graph(placed=True))
    compute = np.array(program["tile_compute_cycles"])
    assert compute[:8].any() and compute[8:].any()
    by_ipu = {}
    for step in program["steps"]:
        if step["kind"] == "compute":
            by_ipu.setdefault(step["ipu"], set()).add(step["name"])
    assert "matmul" in by_ipu[0] and "matmul" not in by_ipu[1]
    assert any(name.startswith("reduce") for name in by_ipu[1])
    crossing = [s for s in program["steps"] if "inter-ipu to 1" in s["name"]]
    # The 32 x 48 float32 activation crosses once, over the links of the two IPUs.
    assert len(crossing) == 1 and crossing[0]["bytes"] == 32 * 48 * 4 and crossing[0]["busiest_link_bytes"] > 0
    assert crossing[0]["ipu"] == 1 and crossing[0]["stage"] == 1


def test_a_node_placed_beyond_the_device_is_refused():
    with pytest.raises(popsim.Error, match="placed on IPU 1, but the device has 1 IPU"):
        popsim.compile(_mlp_graph(placed=True), popsim.Device(SMALL, 1))


def _copy_between(dst_tiles, link_bytes_per_second):
    """Copy a 4 KiB tensor from tiles 0-1 (IPU 0) to ``dst_tiles`` on a two-IPU device of 4-tile IPUs."""
    target = popsim.Device(popsim.Target.small(num_tiles=4, ipu_link_bytes_per_second=link_bytes_per_second), 2)
    dg = popsim.DeviceGraph(target.graph_target)
    src = dg.add_tensor((1024,), DType.float32, popsim.TileMapping.on_tiles([512, 512], [0, 1]), "src", "input")
    dst = dg.add_tensor((1024,), DType.float32, popsim.TileMapping.on_tiles([512, 512], dst_tiles), "dst")
    dg.program = [popsim.Copy("move", dst, [src], np.arange(1024))]
    exe = popsim.compile_device_graph(dg, {"src": src}, {"dst": dst})
    data = np.arange(1024, dtype=np.float32)
    np.testing.assert_array_equal(exe.run({"src": data})["dst"], data)
    return exe.profile.programs["main"]


def test_exchange_between_ipus_is_bounded_by_the_links():
    slow_link = 1e9  # bytes/s: far below the tiles' own exchange rate
    within = _copy_between([2, 3], slow_link)
    across = _copy_between([4, 5], slow_link)
    assert sorted(within["tile_exchange_bytes"]) == sorted(across["tile_exchange_bytes"])
    target = popsim.Device(popsim.Target.small(num_tiles=4, ipu_link_bytes_per_second=slow_link), 2).graph_target
    assert within["exchange_cycles"] == popsim.cost.exchange_cycles(target, 2048)
    assert across["exchange_cycles"] == popsim.cost.link_cycles(target, 4096) > within["exchange_cycles"]
    # With Mk2's 320 GB/s of IPU-Links, moving 4 KiB is bounded by the receiving tiles, not the links.
    assert _copy_between([4, 5], 320e9)["exchange_cycles"] == within["exchange_cycles"]


def test_out_of_memory_names_the_ipu_of_the_tile():
    device = popsim.Device(popsim.Target.small(num_tiles=4, tile_bytes=4096), 2)
    dg = popsim.DeviceGraph(device.graph_target)
    dg.add_tensor((2048,), DType.float32, popsim.TileMapping.on_tiles([2048], [6]), "big", "variable")
    with pytest.raises(popsim.OutOfMemoryError, match=r"tile 6 \(IPU 1, tile 2\).*big"):
        popsim.compile_device_graph(dg)


def _four_stage_graph():
    """Four placed stages of equal work, one per IPU, and the gradient of the first weight."""
    g = popir.Graph("chain")
    h = g.add_input("x", (16, 32), DType.float32)
    weights = []
    for stage in range(4):
        weights.append(g.add_input(f"w{stage}", (32, 32), DType.float32, kind="parameter"))
        with g.placed((stage, stage)), g.annotate(role="forward"):
            h = ops.relu(h @ weights[-1])
    with g.placed((3, 3)), g.annotate(role="forward"):
        loss = ops.reduce_sum(h, axes=(0, 1), keepdims=False)
    g.output("grad", popir.autodiff.grad(g, loss, weights[:1])[0])
    return g


def test_a_pipelined_step_overlaps_the_ipus_and_pays_for_its_bubbles():
    device = popsim.Device(SMALL, 4)
    program = popsim.compile(_four_stage_graph(), device).profile.programs["chain"]
    micro_batches = 8
    sharded = popsim.step_schedule(program, device.graph_target, micro_batches, pipelined=False)
    pipelined = popsim.step_schedule(program, device.graph_target, micro_batches, pipelined=True)
    assert sharded.serial_cycles == sharded.total_cycles == micro_batches * program["total_cycles"]
    assert sorted(pipelined.stage_ipu.items()) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert all(pipelined.backward_cycles[s] > 0 for s in range(4))
    # Activations and gradients cross between neighbouring IPUs as copies of their own, on the IPU-Links.
    links = {link for c in pipelined.copies for link in c.links}
    assert links == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)}
    assert pipelined.total_cycles < sharded.total_cycles
    # PopART's cycles: 8 micro-batches over 4 stages take 8 + 2 * 4 - 2; some IPUs wait in the first and last.
    shown = pipelined.as_dict()
    timeline = popsim.Timeline()
    popsim.place_pipeline(timeline, pipelined, 0, [0, 1, 2, 3])
    cycles = {i.label["pipeline_cycle"] for i in timeline.intervals if "pipeline_cycle" in i.label}
    assert cycles == set(range(8 + 2 * 4 - 2)) and timeline.makespan == pipelined.total_cycles
    assert shown["ramp_up_cycles"] > 0 and shown["ramp_down_cycles"] > 0 and shown["main_cycles"] > 0
    assert all(idle > 0 for idle in shown["bubble_cycles"].values()) and len(shown["bubble_cycles"]) == 4
    timeline = pipelined.timeline()
    assert len(timeline) == 2 * 4 * micro_batches
    # IPU 1 runs micro-batch 0's forward while IPU 0 runs micro-batch 1's: the IPUs overlap.
    first = {(e["ipu"], e["micro_batch"]): e for e in timeline if e["pass"] == "forward"}
    assert first[(1, 0)]["start"] == first[(0, 1)]["start"] > first[(0, 0)]["end"]
    assert max(e["end"] for e in timeline) <= pipelined.total_cycles
    serial = sharded.timeline()
    assert all(a["end"] <= b["start"] for a, b in zip(serial, serial[1:]))  # one stage at a time
    stage = pipelined.as_dict()["stages"][2]
    assert stage == {
        "ipu": 2,
        "forward_cycles": pipelined.forward_cycles[2],
        "backward_cycles": stage["backward_cycles"],
        "copy_cycles": sum(c.cycles for c in pipelined.copies if c.stage == 2),
    }
