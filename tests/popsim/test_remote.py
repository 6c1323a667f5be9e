"""Streaming memory (remote buffers): a variable named in ``compile(remote=...)`` lives off the tiles, is
loaded into a tile buffer before its readers (once per phase, or per reader) and stored back after its update:
the same numbers as in tile memory, a lower tile-memory peak, more cycles."""

import numpy as np
import pytest

import popir
import popsim
from popsim.remote import Spill

TARGET = popsim.Target.small(num_tiles=8, tile_bytes=65_536)
ROOMY = popsim.Target.small(num_tiles=8, tile_bytes=256 * 1024)
SIZE = 48
LAYERS = 3


def _step_graph():
    """x @ w0 @ w1 @ w2 out; each w updated to w - 0.1 * w (an optimizer-like state update)."""
    g = popir.Graph("step")
    x = g.add_input("x", (SIZE, SIZE), "float32")
    ws = [g.add_input(f"w{i}", (SIZE, SIZE), "float32", kind="parameter") for i in range(LAYERS)]
    y = x
    for w in ws:
        y = popir.ops.matmul(y, w)
    g.output("y", y)
    for w in ws:
        g.update(w, popir.ops.sub(w, popir.ops.mul(w, g.constant(np.float32(0.1)))))
    return g


def _run(remote, steps=3, remote_loads="phase"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SIZE, SIZE)).astype(np.float32) / SIZE
    ws = [rng.standard_normal((SIZE, SIZE)).astype(np.float32) for _ in range(LAYERS)]
    exe = popsim.compile(_step_graph(), target=TARGET, remote=remote, remote_loads=remote_loads)
    for i, w in enumerate(ws):
        exe.write_variable(f"w{i}", w)
    for _ in range(steps):
        expected = x
        for w in ws:
            expected = expected @ w
        np.testing.assert_allclose(exe.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-5)
        ws = [w - w * np.float32(0.1) for w in ws]
    for i, w in enumerate(ws):
        np.testing.assert_allclose(exe.read_variable(f"w{i}"), w, rtol=1e-6)
    return exe.profile.programs["step"]


def test_streamed_variables_give_the_same_numbers_with_less_tile_memory_and_more_cycles():
    on_chip = _run(remote=())
    # Loaded once per phase, the weights' buffers are all live at their updates, as on chip: no saving there.
    per_phase = _run(remote={f"w{i}" for i in range(LAYERS)})
    assert per_phase["memory_max_tile_bytes"] <= on_chip["memory_max_tile_bytes"]
    streamed = _run(remote={f"w{i}" for i in range(LAYERS)}, remote_loads="reader")
    assert streamed["memory_max_tile_bytes"] < on_chip["memory_max_tile_bytes"]
    assert streamed["total_cycles"] > on_chip["total_cycles"]
    names = [s["name"] for s in streamed["steps"]]
    assert "remote load w0" in names and "remote store w0" in names
    assert streamed["streaming_memory_bytes"] == LAYERS * SIZE * SIZE * 4
    assert on_chip["streaming_memory_bytes"] == 0


def test_streamed_variables_fit_where_tile_memory_does_not():
    tiny = popsim.Target.small(num_tiles=4, tile_bytes=16_384)  # 64 KiB of tiles; the weights take 27 KiB each
    with pytest.raises(popsim.OutOfMemoryError):
        popsim.compile(_step_graph(), target=tiny)
    streamed = {f"w{i}" for i in range(LAYERS)}
    # Held from its matmul to its update (one phase), each weight's buffer does not fit; loaded per reader it does.
    with pytest.raises(popsim.OutOfMemoryError):
        popsim.compile(_step_graph(), target=tiny, remote=streamed)
    exe = popsim.compile(_step_graph(), target=tiny, remote=streamed, remote_loads="reader")
    assert exe.profile.programs["step"]["memory_max_tile_bytes"] <= tiny.tile_bytes


def test_a_streamed_variable_is_loaded_once_per_phase_for_all_its_readers():
    streamed = {f"w{i}" for i in range(LAYERS)}
    per_phase, per_reader = _run(remote=streamed), _run(remote=streamed, remote_loads="reader")
    loads = [[s["name"] for s in p["steps"]].count("remote load w0") for p in (per_phase, per_reader)]
    assert loads == [1, 3]  # w0 is read by its matmul and its update's mul and sub, all in one phase
    assert per_phase["total_cycles"] < per_reader["total_cycles"]
    assert per_phase["memory_max_tile_bytes"] >= per_reader["memory_max_tile_bytes"]
    with pytest.raises(popsim.Error, match="remote_loads must be one of"):
        popsim.compile(_step_graph(), target=TARGET, remote=streamed, remote_loads="once")


def test_remote_must_name_variables():
    with pytest.raises(popsim.Error, match="'x'.*no variable"):
        popsim.compile(_step_graph(), target=TARGET, remote={"x"})


def test_streamed_variables_survive_to_bytes():
    exe = popsim.compile(_step_graph(), target=TARGET, remote={"w1"})
    w = np.arange(SIZE * SIZE, dtype=np.float32).reshape(SIZE, SIZE)
    exe.write_variable("w1", w)
    again = popsim.Executable.from_bytes(exe.to_bytes())
    np.testing.assert_array_equal(again.read_variable("w1"), w)
    x = np.eye(SIZE, dtype=np.float32)
    np.testing.assert_allclose(again.run({"x": x})["y"], exe.run({"x": x})["y"])


def _trained_graph(layers=6, width=32, batch=256):
    """sin(... sin(x @ w) ... @ w): the backward pass reads every forward activation."""
    g = popir.Graph("train")
    x = g.add_input("x", (batch, width), "float32")
    w = g.add_input("w", (width, width), "float32", kind="parameter")
    h = x
    with g.annotate(role="forward"):
        for _ in range(layers):
            h = popir.ops.sin(popir.ops.matmul(h, w))
        loss = popir.ops.reduce_sum(h, axes=(0, 1), keepdims=False)
    (grad,) = popir.autodiff.grad(g, loss, [w])
    g.output("loss", loss)
    g.output("grad", grad)
    return g


@pytest.mark.parametrize("mode", ["backward", "phase"])
def test_spilled_activations_give_the_same_gradient_with_less_tile_memory(mode):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((256, 32)).astype(np.float32)}
    w = (rng.standard_normal((32, 32)) / 6).astype(np.float32)
    runs = {}
    for spill in (None, mode):
        exe = popsim.compile(_trained_graph(), target=ROOMY, spill=spill)
        exe.write_variable("w", w)
        runs[spill] = exe.run(feeds), exe.profile.programs["train"]
    expected = popir.interpreter.run(_trained_graph(), {**feeds, "w": w})
    for name in ("loss", "grad"):
        np.testing.assert_allclose(runs[mode][0][name], expected[name], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(runs[mode][0][name], runs[None][0][name], rtol=1e-5, atol=1e-5)
    assert runs[mode][1]["memory_max_tile_bytes"] < runs[None][1]["memory_max_tile_bytes"]
    assert runs[mode][1]["total_cycles"] > runs[None][1]["total_cycles"]


def test_a_spill_leaves_values_below_its_minimum_size_on_the_chip():
    def stored(min_elements):
        exe = popsim.compile(_trained_graph(), target=ROOMY, spill=Spill("backward", min_elements))
        return [s["name"] for s in exe.profile.programs["train"]["steps"] if s["name"].startswith("remote store")]

    activation = 256 * 32  # each sin output the backward pass reads
    assert len(stored(activation)) >= 6
    assert stored(activation + 1) == []


def test_an_unknown_spill_mode_is_refused():
    with pytest.raises(popsim.Error, match="spill mode must be None or one of"):
        popsim.compile(_trained_graph(), target=TARGET, spill="always")


def test_a_variable_sharded_over_replicas_moves_and_holds_one_replica_s_shard():
    whole = popsim.compile(_step_graph(), target=ROOMY, remote={"w0", "w1"})
    sharded = popsim.compile(_step_graph(), target=ROOMY, remote={"w0", "w1"}, shards={"w0": 4})
    x = np.eye(SIZE, dtype=np.float32)
    for exe in (whole, sharded):
        exe.write_variable("w0", np.full((SIZE, SIZE), 2.0, np.float32))
    np.testing.assert_array_equal(sharded.run({"x": x})["y"], whole.run({"x": x})["y"])
    np.testing.assert_array_equal(sharded.read_variable("w0"), whole.read_variable("w0"))
    moved = {s["name"]: s["bytes"] for s in sharded.profile.programs["step"]["steps"] if "remote" in s["name"]}
    assert moved["remote load w0"] == moved["remote store w0"] == SIZE * SIZE * 4 // 4
    assert moved["remote load w1"] == SIZE * SIZE * 4
    step, whole_step = sharded.profile.programs["step"], whole.profile.programs["step"]
    assert step["streaming_memory_bytes"] == whole_step["streaming_memory_bytes"] - SIZE * SIZE * 4 * 3 // 4
    assert step["total_cycles"] < whole_step["total_cycles"]
    again = popsim.Executable.from_bytes(sharded.to_bytes())
    again.run({"x": x})
    assert again.last_run_cycles == sharded.last_run_cycles


def test_shards_must_name_remote_variables_and_a_replica_count():
    with pytest.raises(popsim.Error, match="'w2' is not a remote variable"):
        popsim.compile(_step_graph(), target=TARGET, remote={"w0"}, shards={"w2": 2})
    with pytest.raises(popsim.Error, match="positive whole number of replicas"):
        popsim.compile(_step_graph(), target=TARGET, remote={"w0"}, shards={"w0": 0})
