"""slice_update of a variable by its own new value is a copy of the slice's elements only, into the variable;
when the old value is still read, the update makes a new tensor instead. Numbers equal popir's interpreter."""

import numpy as np

import popir
import popsim
from popir import ops

SHAPE, STEP = (6, 50), 3
SIZE = SHAPE[0] * SHAPE[1]
TARGET = popsim.Target.small(num_tiles=4)


def _sharded_update(keep_old=False, select=False):
    """w's elements 0, STEP, 2 x STEP... of w flattened take 0.5 x themselves + g, the rest stay: as a
    slice_update (or as a select over the whole of w); ``keep_old`` also outputs the old w."""
    g = popir.Graph("step")
    w = g.add_input("w", SHAPE, "float32", kind="parameter")
    grad = g.add_input("g", (SIZE // STEP,), "float32")
    flat = ops.reshape(w, shape=(SIZE,))
    shard = ops.slice(flat, starts=(0,), stops=(SIZE,), steps=(STEP,)) * 0.5 + grad
    if select:
        rows = (SIZE // STEP, STEP)
        spread = ops.reshape(ops.broadcast_to(ops.reshape(shard, shape=(rows[0], 1)), shape=rows), shape=(SIZE,))
        new = ops.where(g.constant(np.arange(SIZE) % STEP == 0), spread, flat)
    else:
        new = ops.slice_update(flat, shard, starts=(0,), stops=(SIZE,), steps=(STEP,))
    g.update(w, ops.reshape(new, shape=SHAPE))
    if keep_old:
        g.output("old", w * 1.0)
    return g


def _run(graph):
    exe = popsim.compile(graph, TARGET)
    rng = np.random.default_rng(0)
    values = {"w": rng.standard_normal(SHAPE).astype(np.float32)}
    feeds = {"g": rng.standard_normal(graph.input("g").shape).astype(np.float32)}
    exe.write_variable("w", values["w"])
    outputs = exe.run(feeds)
    expected_outputs, updates = popir.interpreter.step(graph, {**values, **feeds})
    np.testing.assert_array_equal(exe.read_variable("w"), updates["w"])
    for name, value in expected_outputs.items():
        np.testing.assert_array_equal(outputs[name], value)
    return exe.profile.programs["step"]


def test_a_slice_update_of_a_variable_copies_the_slice_into_it_and_costs_less_than_a_whole_select():
    profile = _run(_sharded_update())
    names = [step["name"] for step in profile["steps"]]
    assert not any(name.startswith("update w") for name in names)  # written in place
    assert any("slice_update" in name for name in names)
    selected = _run(_sharded_update(select=True))
    assert profile["total_cycles"] < selected["total_cycles"]
    assert profile["memory_max_tile_bytes"] < selected["memory_max_tile_bytes"]


def test_a_slice_update_whose_old_value_is_still_read_makes_a_new_tensor():
    profile = _run(_sharded_update(keep_old=True))
    assert any(step["name"].startswith("update w") for step in profile["steps"])


def _buffers(profile):
    """The ops whose results take tile memory of their own while the program runs (not variables, inputs or
    constants)."""
    return [t["op"] for t in profile["tensors"] if t["category"] in ("activations", "temporaries")]


def test_an_elementwise_result_is_computed_in_the_buffer_of_a_slice_it_alone_reads():
    """The shard's new value (0.5 x shard + g) overwrites the shard sliced out of w, which nothing reads after
    it: one shard-sized buffer, not two."""
    assert _buffers(_run(_sharded_update())) == ["slice"]


def test_a_slice_read_by_another_node_too_keeps_its_own_buffer():
    g = popir.Graph("step")
    w = g.add_input("w", SHAPE, "float32", kind="parameter")
    grad = g.add_input("g", (SIZE // STEP,), "float32")
    flat = ops.reshape(w, shape=(SIZE,))
    shard = ops.slice(flat, starts=(0,), stops=(SIZE,), steps=(STEP,))
    new = ops.slice_update(flat, shard * 0.5 + grad, starts=(0,), stops=(SIZE,), steps=(STEP,))
    g.update(w, ops.reshape(new, shape=SHAPE))
    g.output("again", shard * 2.0)  # read after the update's vertex: its buffer must still hold the slice
    buffers = _buffers(_run(g))
    assert buffers.count("slice") == 1 and len(buffers) == 3  # the slice, the update's shard, the output
