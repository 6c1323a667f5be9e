"""The device API refuses at build time whatever could make the engine touch memory outside a vertex's fields,
compiled tables are checked before a loader runs them, thread counts are bounded, and a forked child can run
the engine after its parent did."""

import dataclasses
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import DType, ops
from popsim import _kernels
from popsim import _opcodes as oc

TARGET = popsim.Target.small(num_tiles=2)
N = 8


def _graph():
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles([N], [0])
    x = dg.add_tensor((N,), DType.float32, here, "x", "constant", np.arange(N, dtype=np.float32))
    y = dg.add_tensor((N,), DType.float32, here, "y")
    return dg, x, y, dg.add_compute_set("cs")


def test_a_misspelled_field_is_refused():
    dg, x, y, cs = _graph()
    with pytest.raises(popsim.Error, match=r"unknown field\(s\) \['outt'\]"):
        dg.add_vertex(cs, oc.UNARY, "neg", 0, N, {"a": x.region(0, N), "outt": y.region(0, N)}, 1)


def test_n_beyond_the_region_is_refused():
    dg, x, y, cs = _graph()
    with pytest.raises(popsim.Error, match="holds 4 elements"):
        dg.add_vertex(cs, oc.UNARY, "neg", 0, N, {"a": x.region(0, N), "out": y.region(0, 4)}, 1)


def test_reduce_without_its_rows_is_refused():
    dg, x, y, cs = _graph()
    with pytest.raises(popsim.Error, match="rows == n"):
        dg.add_vertex(cs, oc.REDUCE, "sum", 0, 1, {"a": x.region(0, N), "out": y.region(0, 1)}, 1)
    dg.add_vertex(cs, oc.REDUCE, "sum", 0, 1, {"a": x.region(0, N), "out": y.region(0, 1)}, 1, rows=1, group=N)
    out = popsim.compile_device_graph(dg, outputs={"y": y}).run()["y"]
    assert out[0] == np.arange(N).sum()


@pytest.mark.parametrize("kind, sub", [(99, 0), (0, 0), ("nonsense", 0), (oc.UNARY, 99), (oc.BINARY, "plus")])
def test_unknown_kinds_and_sub_ops_are_refused(kind, sub):
    dg, x, y, cs = _graph()
    with pytest.raises(popsim.Error, match="unknown"):
        dg.add_vertex(cs, kind, sub, 0, N, {"a": x.region(0, N), "out": y.region(0, N)}, 1)


def test_a_dtype_given_as_a_string_is_refused_with_the_fix():
    dg = popsim.DeviceGraph(TARGET)
    with pytest.raises(popsim.Error, match=r"popir.DType.float32"):
        dg.add_tensor((4,), "float32")


def test_a_tensor_of_another_device_graph_is_refused():
    dg, x, y, cs = _graph()
    other, foreign, _, _ = _graph()
    with pytest.raises(popsim.Error, match="not a tensor of this DeviceGraph"):
        dg.add_vertex(cs, oc.UNARY, "neg", 0, N, {"a": foreign.region(0, N), "out": y.region(0, N)}, 1)
    with pytest.raises(popsim.Error, match="not a tensor of this DeviceGraph"):
        dg.add_copy("c", y, [foreign], np.arange(N))


def test_a_gather_size_passed_as_fparam_is_refused():
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles([N], [0])
    x, idx, out = (dg.add_tensor((N,), d, here) for d in (DType.float32, DType.int32, DType.float32))
    fields = {"a": x.region(0, N), "b": idx.region(0, N), "out": out.region(0, N)}
    with pytest.raises(popsim.Error, match="only a FILL vertex takes fparam"):
        dg.add_vertex(dg.add_compute_set("g"), oc.GATHER, 0, 0, N, fields, 1, rows=1, inner=1, fparam=N)


# -- random invalid vertices ---------------------------------------------------------------------------------
def _valid_vertex(dg, kind):
    """(sub, n, fields, params) of a correct vertex of ``kind`` on tile 0."""
    here = popsim.TileMapping.on_tiles([N], [0])

    def t(dtype=DType.float32, value=None):
        return dg.add_tensor((N,), dtype, here, category="constant" if value is not None else "temporary", value=value)

    f32, i32 = t(), t(DType.int32, np.arange(N, dtype=np.int32) % 4)
    cond = t(DType.bool, np.arange(N) % 2 == 0)
    full = {name: x.region(0, N) for name, x in (("a", t()), ("b", t()), ("c", t()), ("out", f32))}
    return {
        oc.UNARY: ("exp", N, {k: full[k] for k in ("a", "out")}, {}),
        oc.BINARY: ("add", N, {k: full[k] for k in ("a", "b", "out")}, {}),
        oc.WHERE: (0, N, {**full, "a": cond.region(0, N)}, {}),
        oc.REDUCE: ("max", 2, {"a": full["a"], "out": f32.region(0, 2)}, {"rows": 2, "group": 4}),
        oc.MATMUL: (
            0,
            2,
            {"a": full["a"], "b": full["b"].tensor.region(0, 4), "out": f32.region(0, 8)},
            {"m": 4, "k": 2},
        ),
        oc.RNG: (0, N, {"a": i32.region(0, 2), "out": full["out"]}, {"first": 0}),
        oc.COPY: (0, N, {k: full[k] for k in ("a", "out")}, {}),
        oc.GATHER: (
            0,
            N,
            {"a": full["a"], "b": i32.region(0, N), "out": full["out"]},
            {"rows": 1, "inner": 1, "size": N},
        ),
        oc.FILL: (0, N, {"out": full["out"]}, {}),
    }[kind]


# A dtype each of these fields may not have (the others convert on load and store).
_WRONG_DTYPES = {
    (oc.WHERE, "a"): DType.float32,
    (oc.WHERE, "c"): DType.int32,
    (oc.MATMUL, "b"): DType.int32,
    (oc.RNG, "a"): DType.float32,
    (oc.COPY, "out"): DType.int32,
    (oc.GATHER, "b"): DType.float32,
    (oc.GATHER, "out"): DType.int32,
}
_KINDS = [oc.UNARY, oc.BINARY, oc.WHERE, oc.REDUCE, oc.MATMUL, oc.RNG, oc.COPY, oc.GATHER, oc.FILL]
_MUTATIONS = ("rename", "drop", "grow_n", "shrink_field", "bad_param", "extra_param", "sub", "dtype", "other_tile")


def _mutate(dg, kind, how, sub, n, fields, params, draw):
    fields, params = dict(fields), dict(params)
    name = draw(st.sampled_from(sorted(fields)))
    if how == "rename":
        fields[name + "x"] = fields.pop(name)
    elif how == "drop":
        fields.pop(name)
    elif how == "grow_n":
        n += draw(st.integers(1, 100))
    elif how == "shrink_field":
        r = fields[name]
        if r.stop - r.start < 2:
            return None
        fields[name] = dataclasses.replace(r, stop=r.stop - 1)
    elif how == "bad_param":
        if not params:
            return None
        key = draw(st.sampled_from(sorted(params)))
        params[key] = draw(st.sampled_from([-1] if key == "first" else [-1, 10**6]))  # RNG may start anywhere
    elif how == "extra_param":
        params["bogus"] = 1
    elif how == "sub":
        sub = len(oc.SUB_OPS[kind]) + draw(st.integers(0, 5))
    elif how == "dtype":
        if (kind, name) not in _WRONG_DTYPES:
            return None  # the field converts any dtype
        r = fields[name]
        other = _WRONG_DTYPES[kind, name]
        fields[name] = dg.add_tensor((N,), other, popsim.TileMapping.on_tiles([N], [0])).region(r.start, r.stop)
    elif how == "other_tile":
        r = fields[name]
        fields[name] = dg.add_tensor((N,), r.tensor.dtype, popsim.TileMapping.on_tiles([N], [1])).region(
            r.start, r.stop
        )
    return sub, n, fields, params


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_invalid_vertices_are_refused_at_build_time(data):
    kind = data.draw(st.sampled_from(_KINDS))
    how = data.draw(st.sampled_from(_MUTATIONS))
    dg = popsim.DeviceGraph(TARGET)
    mutated = _mutate(dg, kind, how, *_valid_vertex(dg, kind), data.draw)
    if mutated is None:
        return
    sub, n, fields, params = mutated
    with pytest.raises(popsim.Error):
        dg.add_vertex(dg.add_compute_set("cs"), kind, sub, 0, n, fields, 1, **params)


@pytest.mark.parametrize("kind", _KINDS)
def test_each_valid_vertex_builds_and_runs(kind):
    dg = popsim.DeviceGraph(TARGET)
    sub, n, fields, params = _valid_vertex(dg, kind)
    dg.add_vertex(dg.add_compute_set("cs"), kind, sub, 0, n, fields, 1, **params)
    popsim.compile_device_graph(dg, outputs={"out": fields["out"].tensor}).run()


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.integers(-2, 14),
    sub=st.integers(-2, 40),
    n=st.integers(-2, 20),
    spans=st.lists(st.tuples(st.sampled_from(["a", "b", "c", "out", "d", "zz"]), st.integers(0, 8), st.integers(1, 9))),
    params=st.dictionaries(
        st.sampled_from(["rows", "group", "m", "k", "first", "inner", "size", "scalars"]), st.integers(-1, 9)
    ),
)
def test_whatever_add_vertex_accepts_runs_inside_tile_memory(kind, sub, n, spans, params):
    """Random vertices: each is refused with a popsim.Error, or it runs (in this process, so a write outside
    tile memory would crash the test run)."""
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles([N], [0])
    t = dg.add_tensor((N,), DType.int32, here, "t", "constant", np.arange(N, dtype=np.int32) % 3)
    fields = {name: t.region(lo, min(lo + size, N)) for name, lo, size in spans if lo < N}
    try:
        dg.add_vertex(dg.add_compute_set("cs"), kind, sub, 0, n, fields, 1, **params)
    except popsim.Error:
        return
    exe = popsim.compile_device_graph(dg, outputs={"t": t})
    exe.validate()
    try:
        exe.run()
    except popsim.IndexRangeError as exc:
        assert exc.count > 0 and "out of range" in str(exc)


# -- batches of vertices ---------------------------------------------------------------------------------------
_PER_VERTEX_MUTATIONS = ("grow_n", "shrink_field", "bad_param")


def _as_batch(vertices):
    """(n, fields, params) of ``add_vertices`` for a list of (n, fields, params) sharing field tensors."""
    n = [v[0] for v in vertices]
    fields = {
        name: r.tensor.regions([v[1][name].start for v in vertices], [v[1][name].stop for v in vertices])
        for name, r in vertices[0][1].items()
    }
    params = {name: [v[2][name] for v in vertices] for name in vertices[0][2]}
    return n, fields, params


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_batch_with_one_invalid_vertex_is_refused_whole(data):
    """add_vertices checks every vertex of a batch with array operations, as strictly as add_vertex: one bad
    vertex among valid ones refuses the batch, and nothing is added."""
    kind = data.draw(st.sampled_from(_KINDS))
    how = data.draw(st.sampled_from(_PER_VERTEX_MUTATIONS))
    dg = popsim.DeviceGraph(TARGET)
    sub, n, fields, params = _valid_vertex(dg, kind)
    mutated = _mutate(dg, kind, how, sub, n, fields, params, data.draw)
    if mutated is None:
        return
    position = data.draw(st.integers(0, 2))
    vertices = [(n, fields, params)] * 3
    vertices[position] = mutated[1:]
    cs = dg.add_compute_set("cs")
    with pytest.raises(popsim.Error):
        dg.add_vertices(cs, kind, sub, [0, 0, 0], *_as_batch(vertices)[:2], 1, **_as_batch(vertices)[2])
    assert cs.num_vertices == 0


@pytest.mark.parametrize("kind", _KINDS)
def test_a_valid_batch_builds_the_rows_of_its_vertices_added_one_by_one(kind):
    def build(batched):
        dg = popsim.DeviceGraph(TARGET)
        sub, n, fields, params = _valid_vertex(dg, kind)
        cs = dg.add_compute_set("cs")
        if batched:
            n_, fields_, params_ = _as_batch([(n, fields, params)] * 3)
            dg.add_vertices(cs, kind, sub, [0, 0, 0], n_, fields_, [1, 2, 3], **params_)
        else:
            for cycles in (1, 2, 3):
                dg.add_vertex(cs, kind, sub, 0, n, fields, cycles, **params)
        exe = popsim.compile_device_graph(dg, outputs={"out": fields["out"].tensor})
        flat = exe._programs["main"][0]
        return flat.instructions, flat.phase_cycles, exe.run()["out"]

    for one, batch in zip(build(False), build(True)):
        np.testing.assert_array_equal(one, batch)


def _neg_batch(dg, tiles, starts, stops):
    x = dg.add_tensor((2 * N,), DType.float32, popsim.TileMapping.on_tiles([N, N], [0, 1]))
    y = dg.add_tensor((2 * N,), DType.float32, popsim.TileMapping.on_tiles([N, N], [0, 1]))
    fields = {"a": x.regions(starts, stops), "out": y.regions(starts, stops)}
    n = np.asarray(stops) - np.asarray(starts)
    return dg.add_vertices(dg.add_compute_set("cs"), "UNARY", "neg", tiles, n, fields, 1)


@pytest.mark.parametrize(
    "tiles, starts, stops, message",
    [
        ([0, 2], [0, N], [N, 2 * N], "not a tile of the target"),
        ([0, 0], [0, N], [N, 2 * N], "lives on tile 1"),
        ([0, 1], [0, N - 2], [N, 2 * N], "span tiles"),
        ([0, 1], [0, N], [N, 2 * N + 1], "outside"),
        ([0, 1], [0, N], [0, 2 * N], "outside"),
        ([0, 1], [0, N], [N], "1 values for 2 vertices"),
        ([0.0, 1.0], [0, N], [N, 2 * N], "must be integers"),
    ],
)
def test_a_batch_reaching_another_tile_or_outside_its_tensor_is_refused(tiles, starts, stops, message):
    dg = popsim.DeviceGraph(TARGET)
    with pytest.raises(popsim.Error, match=message):
        _neg_batch(dg, tiles, starts, stops)


def test_a_batch_runs_each_vertex_on_its_own_tile():
    dg = popsim.DeviceGraph(TARGET)
    batch = _neg_batch(dg, [0, 1], [0, N], [N, 2 * N])
    y = batch.fields["out"].tensor
    x = batch.fields["a"].tensor
    dg.program.insert(0, popsim.Copy("load", x, [y], np.arange(2 * N)))
    exe = popsim.compile_device_graph(dg, inputs={"y": y}, outputs={"y": y})
    np.testing.assert_array_equal(exe.run({"y": np.arange(2 * N, dtype=np.float32)})["y"], -np.arange(2 * N))


# -- compiled tables -----------------------------------------------------------------------------------------
def _compiled():
    g = popir.Graph("g")
    x = g.add_input("x", (6, 5), "float32")
    idx = g.add_input("i", (4,), "int32")
    y = ops.gather(ops.exp(x) * 2.0 + x, idx, axis=0)
    g.output("y", ops.reduce_sum(y @ ops.transpose(x, perm=(1, 0)), axes=(1,), keepdims=False))
    exe = popsim.compile(g, popsim.Target.small(num_tiles=4))
    feeds = {"x": np.ones((6, 5), np.float32), "i": np.array([0, 5, 2, 1], np.int32)}
    return exe, feeds


def test_a_compiled_program_passes_validation():
    exe, _ = _compiled()
    exe.validate()


_TABLES = ("phases", "instructions", "copies", "stream_rows")


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(table=st.sampled_from(_TABLES[:3]), where=st.floats(0, 1, exclude_max=True), value=st.integers(-(2**33), 2**33))
def test_corrupt_tables_are_refused_or_run_safely(table, where, value):
    """A bit of a compiled table changed (as in a damaged executable file): validate() refuses it, or running
    it stays inside tile memory (an invalid result, but no crash)."""
    exe, feeds = _compiled()
    flat = exe._programs["g"][0]
    array = getattr(flat, table).copy()
    if array.size == 0:
        return
    flat_view = array.reshape(-1)
    flat_view[int(where * flat_view.size)] = np.clip(value, *_bounds(array.dtype))
    setattr(flat, table, array)
    try:
        exe.validate()
    except popsim.Error:
        return
    try:
        exe.run(feeds)
    except popsim.Error:
        pass


def _bounds(dtype):
    info = np.iinfo(dtype)
    return info.min, info.max


# -- threads -------------------------------------------------------------------------------------------------
def test_thread_counts_are_bounded(monkeypatch):
    monkeypatch.setenv("POPSIM_NUM_THREADS", "100000")
    with pytest.raises(popsim.Error, match=f"from 1 to {_kernels.MAX_THREADS}"):
        _compiled()
    monkeypatch.setenv("POPSIM_NUM_THREADS", "2")
    exe, feeds = _compiled()
    exe.num_threads = 100000
    with pytest.raises(popsim.Error, match="num_threads"):
        exe.run(feeds)


def test_a_huge_thread_count_exits_cleanly_in_a_fresh_process():
    code = "import popsim, popir; popsim.compile(popir.Graph('g'))"
    env = {**os.environ, "POPSIM_NUM_THREADS": "100000"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "POPSIM_NUM_THREADS must be an integer from 1 to" in done.stderr


def _run_in_child(queue):
    exe, feeds = _compiled()
    exe.num_threads = 2
    queue.put(exe.run(feeds)["y"])


def test_a_forked_child_runs_the_engine_after_its_parent():
    exe, feeds = _compiled()
    exe.num_threads = 2
    expected = exe.run(feeds)["y"]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_in_child, args=(queue,))
    child.start()
    child.join(120)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
    np.testing.assert_array_equal(queue.get(timeout=10), expected)


# -- random invalid programs ---------------------------------------------------------------------------------
def _program_case(dg, x, y, how):
    """A program step (or compile arguments) broken in one way; building or compiling it must fail."""
    other = popsim.DeviceGraph(TARGET).add_tensor((N,), DType.float32, popsim.TileMapping.on_tiles([N], [0]))
    flag = dg.add_tensor((2,), DType.float32, popsim.TileMapping.on_tiles([2], [0]))
    cases = {
        "negative_repeat": lambda: popsim.Repeat(-1, []),
        "fractional_repeat": lambda: popsim.Repeat(1.5, []),
        "float_condition": lambda: popsim.If(flag.region(0, 1), []),
        "wide_condition": lambda: popsim.If(flag, []),
        "copy_index_outside": lambda: popsim.Copy("c", y, [x], np.arange(N) + 1),
        "copy_short_index": lambda: popsim.Copy("c", y, [x], np.arange(N - 1)),
        "copy_dtype": lambda: popsim.Copy("c", dg.add_tensor((2,), DType.int32, flag.mapping), [x], np.arange(2)),
        "stream_of_array": lambda: popsim.StreamCopy("s", np.zeros(N)),
        "not_a_step": lambda: 42,
        "foreign_copy": lambda: popsim.Copy("c", y, [other], np.arange(N)),
        "foreign_output": lambda: {"outputs": {"y": other}},
        "array_output": lambda: {"outputs": {"y": np.zeros(N)}},
    }
    return cases[how]()


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    how=st.sampled_from(
        [
            "negative_repeat",
            "fractional_repeat",
            "float_condition",
            "wide_condition",
            "copy_index_outside",
            "copy_short_index",
            "copy_dtype",
            "stream_of_array",
            "not_a_step",
            "foreign_copy",
            "foreign_output",
            "array_output",
        ]
    ),
    nest=st.integers(0, 2),
)
def test_random_invalid_programs_are_refused_before_they_run(how, nest):
    dg, x, y, _ = _graph()
    with pytest.raises(popsim.Error):
        step = _program_case(dg, x, y, how)
        arguments = step if isinstance(step, dict) else {}
        if not arguments:
            for _ in range(nest):  # bury the broken step inside loops
                step = popsim.Repeat(2, [step])
            dg.program = [step]
        popsim.compile_device_graph(dg, **arguments)
