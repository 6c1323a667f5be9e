"""Direct convolution: CONV vertices over input windows already on their tiles give the interpreter's
result, move less over the exchange than im2col columns, and refuse a geometry outside their fields."""

import numpy as np
import pytest

import popir
import popsim
from popir import DType, ops
from popsim import _opcodes as oc
from popsim import conv_plan

TARGET = popsim.Target.small(num_tiles=16)

# (input shape, weight shape, conv2d keywords): stride, padding, dilation and groups, alone and together.
CASES = [
    ((2, 3, 7, 6), (4, 3, 3, 3), {}),
    ((1, 2, 9, 8), (3, 2, 3, 2), {"stride": 2, "padding": 1}),
    ((2, 2, 8, 9), (2, 2, 3, 3), {"padding": 2, "dilation": 2}),
    ((1, 4, 7, 7), (6, 2, 3, 3), {"stride": (2, 1), "padding": (1, 0), "groups": 2}),
    ((2, 6, 6, 5), (6, 1, 2, 3), {"stride": 2, "padding": 1, "dilation": (1, 2), "groups": 6}),
]


def _conv_graph(x_shape, w_shape, dtype, **window):
    g = popir.Graph("conv")
    x = g.add_input("x", x_shape, dtype)
    w = g.add_input("w", w_shape, dtype, kind="parameter")
    g.output("y", ops.conv2d(x, w, **window))
    return g


def _run(g, feeds, w):
    exe = popsim.compile(g, TARGET)
    exe.write_variable("w", w)
    return exe.run(feeds)["y"], exe.profile.programs[g.name]


@pytest.fixture
def direct(monkeypatch):
    """Every conv2d runs as CONV vertices, whatever the planner estimates."""
    monkeypatch.setattr(conv_plan, "direct_is_faster", lambda *args: True)


def _conv_steps(profile, name):
    return [s for s in profile["steps"] if s["name"] == name and (s.get("origin") or {}).get("op") == "conv2d"]


@pytest.mark.parametrize("x_shape, w_shape, window", CASES)
def test_conv_vertices_equal_the_interpreter_bit_for_bit(direct, x_shape, w_shape, window):
    # Small integers: every partial sum is exact in float32, so any summation order gives the same bits.
    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, x_shape).astype(np.float32)
    w = rng.integers(-3, 4, w_shape).astype(np.float32)
    g = _conv_graph(x_shape, w_shape, "float32", **window)
    got, profile = _run(g, {"x": x}, w)
    assert _conv_steps(profile, "conv"), "the conv2d did not run as CONV vertices"
    np.testing.assert_array_equal(got, popir.interpreter.run(g, {"x": x, "w": w})["y"])


# Every case above (strided ones read the gradient spaced apart), and grouped, dilated, uneven padding and
# padding wider than the kernel reaches.
GRAD_CASES = CASES + [
    ((1, 4, 6, 7), (6, 2, 3, 3), {"padding": (1, 2), "dilation": 2, "groups": 2}),
    ((1, 2, 5, 5), (2, 2, 3, 3), {"padding": 3}),
]


@pytest.mark.parametrize("wrt", ["x", "w"])
@pytest.mark.parametrize("x_shape, w_shape, window", GRAD_CASES)
def test_a_gradient_runs_as_conv_vertices_bit_for_bit(direct, x_shape, w_shape, window, wrt):
    """The input gradient, and the weight gradient (each input channel's image convolved with the output
    gradient as its kernel, each input element sent to a tile once: no im2col windows on the exchange), run as
    CONV vertices and equal the interpreter's."""
    rng = np.random.default_rng(3)
    g = popir.Graph("conv_grad")
    x = g.add_input("x", x_shape, "float32")
    w = g.add_input("w", w_shape, "float32", kind="parameter")
    y = ops.conv2d(x, w, **window)
    r = g.add_input("r", y.shape, "float32")
    loss = ops.reduce_sum(y * r, axes=(0, 1, 2, 3), keepdims=False)
    (grad,) = popir.autodiff.grad(g, loss, [x if wrt == "x" else w])
    g.output("y", grad)
    feeds = {name: rng.integers(-3, 4, v.shape).astype(np.float32) for name, v in (("x", x), ("r", r))}
    wv = rng.integers(-3, 4, w_shape).astype(np.float32)
    got, profile = _run(g, feeds, wv)
    op = "conv2d_grad_input" if wrt == "x" else "conv2d_grad_weight"
    assert [s for s in profile["steps"] if s["name"] == "conv" and s["origin"]["op"] == op], f"{op} ran no CONV vertex"
    np.testing.assert_array_equal(got, popir.interpreter.run(g, {**feeds, "w": wv})["y"])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2)])
@pytest.mark.parametrize("x_shape, w_shape, window", CASES[1::2])
def test_conv_vertices_match_the_interpreter_on_random_values(direct, x_shape, w_shape, window, dtype, tol):
    rng = np.random.default_rng(1)
    x = rng.normal(size=x_shape).astype(dtype)
    w = rng.normal(size=w_shape).astype(dtype)
    g = _conv_graph(x_shape, w_shape, dtype, **window)
    got, _ = _run(g, {"x": x}, w)
    want = popir.interpreter.run(g, {"x": x, "w": w})["y"]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_a_3x3_conv_exchanges_less_than_im2col_columns(monkeypatch):
    # Enough channels that the planner picks CONV vertices by itself; the same conv with the kernel folded
    # into a matmul's K (the im2col lowering) moves each input element once per tap that reads it.
    x_shape, w_shape = (2, 16, 12, 12), (16, 16, 3, 3)
    rng = np.random.default_rng(2)
    x, w = rng.normal(size=x_shape).astype(np.float32), rng.normal(size=w_shape).astype(np.float32)
    g = _conv_graph(x_shape, w_shape, "float32", padding=1)
    moved = {}
    for lowering in ("direct", "im2col"):
        if lowering == "im2col":
            monkeypatch.setattr(conv_plan, "direct_is_faster", lambda *args: False)
        got, profile = _run(g, {"x": x}, w)
        assert bool(_conv_steps(profile, "conv")) == (lowering == "direct")
        exchanges = [s for s in profile["steps"] if s["kind"] == "exchange" and s["origin"]["op"] == "conv2d"]
        moved[lowering] = sum(s["bytes"] for s in exchanges)
        np.testing.assert_allclose(got, popir.interpreter.run(g, {"x": x, "w": w})["y"], rtol=1e-4, atol=1e-4)
    assert moved["direct"] < moved["im2col"]


def test_each_patch_holds_distinct_input_elements_and_no_padding():
    # A task's patch is the union of its windows: each input element once, padding not exchanged at all.
    spec = conv_plan.ConvSpec(1, 2, 4, 8, (10, 10), (10, 10), (3, 3), (1, 1), (1, 1), (1, 1))
    plan = conv_plan.plan_conv(TARGET, spec, DType.float32)
    x_index = np.arange(2 * 4 * 10 * 10).reshape(1, 2, 4, 10, 10)
    w_index = np.arange(8 * 4 * 9).reshape(1, 8, 4, 3, 3)
    patches, *_ = conv_plan._layout(spec, plan, x_index, w_index)
    for patch in patches:
        assert patch.min() >= 0 and np.unique(patch).size == patch.size
    assert sum(p.size for p in patches) < 9 * x_index.size  # im2col columns hold every element per tap


def test_a_conv_vertex_whose_geometry_is_not_its_fields_is_refused():
    dg = popsim.DeviceGraph(TARGET)
    mapping = popsim.TileMapping.on_tiles([8], [0])
    patch = dg.add_tensor((8,), DType.float32, mapping)
    weights = dg.add_tensor((8,), DType.float32, mapping)
    out = dg.add_tensor((8,), DType.float32, mapping)
    short = dg.add_tensor((3,), DType.int32, popsim.TileMapping.on_tiles([3], [0]))
    cs = dg.add_compute_set("conv")
    with pytest.raises(popsim.Error, match="geometry words"):
        oc.conv(
            dg.add_vertex, cs, 0, 8, 1, patch=patch.region(0, 8), weights=weights.region(0, 8),
            geometry=short.region(0, 3), out=out.region(0, 8), patch_size=8, weights_size=8, taps=8,
        )  # fmt: skip


def test_conv_vertices_count_their_flops_and_never_beat_the_amp(direct):
    x_shape, w_shape, window = CASES[3]
    g = _conv_graph(x_shape, w_shape, "float32", **window)
    _, profile = _run(g, {"x": np.ones(x_shape, np.float32)}, np.ones(w_shape, np.float32))
    o, cg, kh, kw = w_shape
    n, _, oh, ow = g.nodes[-1].outputs[0].shape
    assert profile["flops"] == 2 * n * o * oh * ow * cg * kh * kw
    assert profile["compute_cycles"] >= profile["flops"] / 2 / (TARGET.amp_macs(DType.float32) * TARGET.num_tiles)


def test_float16_partials_round_once_from_float32_accumulation(direct):
    x_shape, w_shape, window = CASES[1]
    rng = np.random.default_rng(4)
    x = rng.normal(size=x_shape).astype(np.float16)
    w = rng.normal(size=w_shape).astype(np.float16)
    g = _conv_graph(x_shape, w_shape, "float16", **window)
    exe = popsim.compile(g, TARGET, partials_type="float16")
    exe.write_variable("w", w)
    got = exe.run({"x": x})["y"]
    # The vertex accumulates in float32 and rounds into its float16 partials, which are summed in float16.
    want = popir.interpreter.run(g, {"x": x, "w": w})["y"]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def _hand_built_conv(geometry):
    """One CONV vertex on tile 0 over a 1x1x3x3 patch and 2x1x2x2 weights, its geometry as given."""
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles
    patch = dg.add_tensor((9,), DType.float32, here([9], [0]), "patch", "constant", np.arange(9, dtype=np.float32))
    weights = dg.add_tensor((8,), DType.float32, here([8], [0]), "w", "constant", np.arange(8, dtype=np.float32))
    words = len(oc.CONV_GEOMETRY)
    geom = dg.add_tensor(
        (words,), DType.int32, here([words], [0]), "geometry", "constant", np.array(geometry, np.int32)
    )
    out = dg.add_tensor((8,), DType.float32, here([8], [0]), "out")
    cs = dg.add_compute_set("conv")
    fields = {"patch": patch.region(0, 9), "weights": weights.region(0, 8), "geometry": geom.region(0, words)}
    oc.conv(dg.add_vertex, cs, 0, 8, 1, **fields, out=out.region(0, 8), patch_size=9, weights_size=8, taps=4)
    return popsim.compile_device_graph(dg, outputs={"out": out})


# batch, channels, rows, cols, out_channels, out_rows, out_cols, kernel 2x2, stride 1, dilation 1, input
# dilation 1, first (0, 0)
GEOMETRY = [1, 1, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0]


def test_a_hand_built_conv_vertex_runs_its_geometry():
    got = _hand_built_conv(GEOMETRY).run()["out"]
    x, w = np.arange(9).reshape(3, 3), np.arange(8).reshape(2, 2, 2)
    want = [[(x[y : y + 2, c : c + 2] * w[o]).sum() for y in range(2) for c in range(2)] for o in range(2)]
    np.testing.assert_array_equal(got, np.array(want, np.float32).reshape(-1))


def _windowed_reference(geometry):
    """NumPy's result of the hand-built vertex: the 3x3 patch spread to its spaced positions, each output the
    sum over 2x2 taps of weights times the spaced element under the tap (zero off the patch or between)."""
    geo = dict(zip(oc.CONV_GEOMETRY, geometry))
    ur, uc = geo["in_dilation_rows"], geo["in_dilation_cols"]
    spread = np.zeros((2 * ur + 1, 2 * uc + 1), np.float32)
    spread[::ur, ::uc] = np.arange(9).reshape(3, 3)

    def at(r, c):
        return spread[r, c] if 0 <= r < spread.shape[0] and 0 <= c < spread.shape[1] else 0.0

    w = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    out = np.zeros((2, geo["out_rows"], geo["out_cols"]), np.float32)
    for o, y, x, i, j in np.ndindex(*out.shape, 2, 2):
        r = geo["first_row"] + y * geo["stride_rows"] + i * geo["dilation_rows"]
        c = geo["first_col"] + x * geo["stride_cols"] + j * geo["dilation_cols"]
        out[o, y, x] += w[o, i, j] * at(r, c)
    return out.reshape(-1)


# Strided windows over spaced columns (the period of outputs that land on an element and its column step),
# padding before the patch, and spaced rows: (out_rows, out_cols, stride, dilation, in_dilation, first).
SPACED_GEOMETRIES = [
    (1, 4, (1, 2), (2, 1), (2, 3), (0, -2)),
    (2, 2, (1, 2), (1, 1), (1, 2), (-1, -1)),
    (1, 4, (2, 3), (1, 2), (3, 2), (-2, -3)),
    (4, 1, (1, 1), (1, 1), (2, 1), (-3, 1)),
]


@pytest.mark.parametrize("oh, ow, stride, dilation, in_dilation, first", SPACED_GEOMETRIES)
def test_a_hand_built_conv_vertex_reads_spaced_strided_windows(oh, ow, stride, dilation, in_dilation, first):
    geometry = [1, 1, 3, 3, 2, oh, ow, 2, 2, *stride, *dilation, *in_dilation, *first]
    got = _hand_built_conv(geometry).run()["out"]
    np.testing.assert_array_equal(got, _windowed_reference(geometry))


def test_the_engine_traps_a_geometry_that_disagrees_with_the_vertex_fields():
    # The geometry sits in tile memory, where a program could change it: the engine checks it against the
    # sizes in the vertex's own row before reading anything, and traps instead of reading past the patch.
    too_big = list(GEOMETRY)
    too_big[oc.CONV_GEOM["rows"]] = 30
    with pytest.raises(popsim.Error, match="trapped"):
        _hand_built_conv(too_big).run()


def _conv_stack(monkeypatch, reuse):
    """Three identical padded 3x3 convs with relu and the input's gradient (so the gradient convs repeat too);
    returns the results, the profile, how many layouts were built, and the graph and feeds."""
    built = []
    layout = conv_plan._conv_layout
    monkeypatch.setattr(conv_plan, "_conv_layout", lambda *a: built.append(1) or layout(*a))
    if not reuse:  # every key distinct: each conv is laid out from scratch
        monkeypatch.setattr(conv_plan, "_index_key", lambda index: object())
    g = popir.Graph("convs")
    h = x = g.add_input("x", (2, 4, 6, 6), "float32")
    weights = [g.add_input(f"w{i}", (4, 4, 3, 3), "float32", kind="parameter") for i in range(3)]
    for w in weights:
        h = ops.relu(ops.conv2d(h, w, padding=1))
    loss = ops.reduce_sum(h * h, axes=(0, 1, 2, 3), keepdims=False)
    (gx,) = popir.autodiff.grad(g, loss, [x])
    g.output("loss", loss)
    g.output("gx", gx)
    exe = popsim.compile(g, TARGET)
    rng = np.random.default_rng(5)
    values = {w.name: rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32) for w in weights}
    for name, value in values.items():
        exe.write_variable(name, value)
    feeds = {"x": rng.normal(size=(2, 4, 6, 6)).astype(np.float32)}
    return exe.run(feeds), exe.profile.programs["convs"], len(built), g, {**feeds, **values}


def test_repeated_conv_layers_reuse_their_layout_and_match_a_fresh_one_exactly(direct, monkeypatch):
    reused, reused_profile, reused_layouts, g, feeds = _conv_stack(monkeypatch, reuse=True)
    monkeypatch.undo()
    monkeypatch.setattr(conv_plan, "direct_is_faster", lambda *args: True)
    fresh, fresh_profile, fresh_layouts, *_ = _conv_stack(monkeypatch, reuse=False)
    # Forward convs 2 and 3 reuse the first one's layout, and likewise the input gradients.
    assert fresh_layouts == 6 and reused_layouts < fresh_layouts
    for name in fresh:
        np.testing.assert_array_equal(reused[name], fresh[name])
    assert reused_profile["steps"] == fresh_profile["steps"]
    assert reused_profile["total_cycles"] == fresh_profile["total_cycles"]
    want = popir.interpreter.run(g, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(reused[name], value, rtol=1e-4, atol=1e-4)


def test_a_loaded_conv_row_reaching_past_its_tile_is_refused(direct):
    x_shape, w_shape, window = CASES[0]
    exe = popsim.compile(_conv_graph(x_shape, w_shape, "float32", **window), TARGET)
    exe.validate()
    flat = exe._programs["conv"][0]
    table = flat.instructions.copy()
    row = np.flatnonzero(table[:, oc.COL["op"]] == oc.CONV)[0]
    table[row, oc.COL["p0"]] = TARGET.tile_bytes  # the patch's extent now runs past the tile's memory
    flat.instructions = table
    with pytest.raises(popsim.Error, match="invalid compiled program"):
        exe.validate()


def test_the_conv_plan_keeps_within_the_available_memory_proportion():
    target = popsim.Target.small(num_tiles=64)
    # One image: its K-split partials and their reduction take less than the fastest plan's patches.
    spec = conv_plan.ConvSpec(1, 1, 16, 32, (32, 32), (32, 32), (3, 3), (1, 1), (1, 1), (1, 1))

    def plan(proportion):
        return conv_plan.plan_conv(target, spec, DType.float32, available_memory=proportion)

    fastest = plan(1.0)
    assert plan(fastest.memory / target.tile_bytes) == fastest  # a proportion it fits keeps it
    # Below what the fastest plan needs, the plan changes; when no split fits, the least memory wins.
    tight = plan(0.9 * fastest.memory / target.tile_bytes)
    assert tight.memory < fastest.memory
    assert tight.memory <= 0.9 * fastest.memory or tight.memory == plan(1e-9).memory


def _conv_vertex(geometry, patch, weights):
    """One CONV vertex on tile 0 over the given float32 patch and weights, its geometry as given."""
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles
    geo = dict(zip(oc.CONV_GEOMETRY, geometry))
    n = geo["batch"] * geo["out_channels"] * geo["out_rows"] * geo["out_cols"]
    words = len(oc.CONV_GEOMETRY)
    tensors = {}
    for name, value, dtype in (("patch", patch, DType.float32), ("w", weights, DType.float32),
                               ("geometry", np.array(geometry, np.int32), DType.int32)):  # fmt: skip
        tensors[name] = dg.add_tensor((value.size,), dtype, here([value.size], [0]), name, "constant", value.ravel())
    out = dg.add_tensor((n,), DType.float32, here([n], [0]), "out")
    cs = dg.add_compute_set("conv")
    fields = {"patch": tensors["patch"].region(0, patch.size), "weights": tensors["w"].region(0, weights.size)}
    fields["geometry"] = tensors["geometry"].region(0, words)
    sizes = {"patch_size": patch.size, "weights_size": weights.size, "taps": weights.size // geo["out_channels"]}
    oc.conv(dg.add_vertex, cs, 0, n, 1, **fields, out=out.region(0, n), **sizes)
    return popsim.compile_device_graph(dg, outputs={"out": out}).run()["out"]


def _ascending_tap_reference(geometry, patch, weights):
    """The CONV vertex's float32 result for an unspaced input: each output summed over its taps in ascending
    order from zero, one rounded multiply and one rounded add per tap (zero where a window reads padding)."""
    geo = dict(zip(oc.CONV_GEOMETRY, geometry))
    oh, ow, first_row, first_col = geo["out_rows"], geo["out_cols"], geo["first_row"], geo["first_col"]
    out = np.zeros((geo["batch"], geo["out_channels"], oh, ow), np.float32)
    w = weights.reshape(geo["out_channels"], -1)
    ys, xs = np.arange(oh)[:, None], np.arange(ow)[None, :]
    for t, (c, i, j) in enumerate(np.ndindex(geo["channels"], geo["kernel_rows"], geo["kernel_cols"])):
        r = first_row + ys * geo["stride_rows"] + i * geo["dilation_rows"]
        q = first_col + xs * geo["stride_cols"] + j * geo["dilation_cols"]
        inside = (r >= 0) & (r < geo["rows"]) & (q >= 0) & (q < geo["cols"])
        column = np.where(inside, patch[:, c, np.clip(r, 0, geo["rows"] - 1), np.clip(q, 0, geo["cols"] - 1)], 0)
        with np.errstate(invalid="ignore"):  # inf * 0 over padding is NaN, as on the tile
            out = out + w[None, :, t, None, None] * column.astype(np.float32)[:, None]
    return out.reshape(-1)


# Unit column stride and unspaced input (the implicit GEMM that reads window rows in place, its output
# channels in strips of up to 8): (batch, channels, rows, cols, out_channels, out_rows, out_cols, kernel,
# stride_rows, dilation, first) with output rows narrower than, equal to and wider than one 8-wide vector,
# and padding on every side.
IMPLICIT_GEOMETRIES = [
    (2, 3, 6, 5, 3, 6, 5, (3, 3), 1, (1, 1), (-1, -1)),
    (1, 2, 16, 16, 8, 8, 16, (3, 3), 2, (1, 1), (-1, -1)),
    (2, 2, 9, 17, 1, 5, 19, (3, 2), 1, (2, 3), (-2, -4)),
    (1, 4, 5, 12, 5, 4, 8, (1, 1), 1, (1, 1), (1, 2)),
    (1, 8, 10, 10, 13, 10, 10, (3, 3), 1, (1, 1), (-1, -1)),
]


@pytest.mark.parametrize("batch, ch, rows, cols, oc_, oh, ow, kernel, sr, dilation, first", IMPLICIT_GEOMETRIES)
def test_the_implicit_conv_gemm_sums_taps_in_ascending_order_bit_for_bit(
    batch, ch, rows, cols, oc_, oh, ow, kernel, sr, dilation, first
):
    rng = np.random.default_rng(1)
    geometry = [batch, ch, rows, cols, oc_, oh, ow, *kernel, sr, 1, *dilation, 1, 1, *first]
    patch = rng.normal(size=(batch, ch, rows, cols)).astype(np.float32)
    weights = rng.normal(size=(oc_, ch, *kernel)).astype(np.float32)
    got = _conv_vertex(geometry, patch, weights)
    np.testing.assert_array_equal(got, _ascending_tap_reference(geometry, patch, weights))


def test_an_infinite_weight_over_padding_gives_nan_as_the_window_columns_do():
    # inf * 0 is NaN: a tap over padding is still multiplied and added, never skipped.
    geometry = [1, 1, 4, 4, 2, 4, 4, 3, 3, 1, 1, 1, 1, 1, 1, -1, -1]
    patch = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) + 1
    weights = np.ones((2, 1, 3, 3), np.float32)
    weights[1, 0, 0, 0] = np.inf
    got = _conv_vertex(geometry, patch, weights).reshape(2, 4, 4)
    np.testing.assert_array_equal(got, _ascending_tap_reference(geometry, patch, weights).reshape(2, 4, 4))
    assert np.isnan(got[1, 0]).all() and np.isnan(got[1, :, 0]).all() and np.isinf(got[1, 1:, 1:]).all()


class _Node:
    """What direct_is_faster reads of a lowering: its target, partials dtype and memory proportion."""

    target, partials_type, available_memory = TARGET, DType.float32, 0.6


def test_few_channel_blocks_fold_the_kernel_columns_and_so_run_as_conv_vertices(monkeypatch):
    # One input channel per block and a 5-wide kernel fill one AMP weight load: the vertices reload weights
    # once per kernel row, not per kernel position, which makes CONV vertices the planner's own choice here.
    x_shape, w_shape = (2, 12, 9, 9), (5, 12, 5, 5)
    spec = conv_plan.ConvSpec(1, 2, 12, 5, (9, 9), (5, 5), (5, 5), (1, 1), (1, 1), (0, 0))
    assert conv_plan.plan_conv(TARGET, spec, DType.float32).fold
    assert conv_plan.direct_is_faster(_Node, spec, DType.float32)
    rng = np.random.default_rng(6)
    x = rng.integers(-4, 5, x_shape).astype(np.float32)
    w = rng.integers(-3, 4, w_shape).astype(np.float32)
    g = _conv_graph(x_shape, w_shape, "float32")
    got, profile = _run(g, {"x": x}, w)
    assert _conv_steps(profile, "conv"), "the conv2d did not run as CONV vertices"
    np.testing.assert_array_equal(got, popir.interpreter.run(g, {"x": x, "w": w})["y"])
    # Without folding, the same convolution is estimated slower than its im2col matmul.
    monkeypatch.setattr(conv_plan, "_folds", lambda spec: np.array([False]))
    conv_plan.plan_conv.cache_clear()
    assert not conv_plan.direct_is_faster(_Node, spec, DType.float32)
    conv_plan.plan_conv.cache_clear()


@pytest.mark.parametrize("dilation, in_dilation", [((1, 2), (1, 1)), ((1, 1), (1, 2))])
def test_only_unit_spaced_kernel_columns_fold(dilation, in_dilation):
    # Dilated or spaced columns are no view of the patch: the same few-channel conv folds only when unit-spaced.
    spec = conv_plan.ConvSpec(1, 2, 12, 5, (9, 9), (3, 3), (3, 3), (1, 1), dilation, (0, 0), in_dilation)
    assert not conv_plan.plan_conv(TARGET, spec, DType.float32).fold
    assert conv_plan.plan_conv(TARGET, spec._replace(dilation=(1, 1), in_dilation=(1, 1)), DType.float32).fold


@pytest.mark.parametrize("channels, loads", [(1, 3), (3, 6), (8, 9), (16, 18)])
def test_folded_vertices_load_weights_per_kernel_row_and_amp_channel_group(channels, loads):
    # A 3x3 kernel reloads at its 9 positions; folded, once per kernel row and 8 float32 channels of the
    # 3 * channels folded ones: fewer loads only while the channels alone leave AMP lanes idle.
    spec = conv_plan.ConvSpec(1, 1, channels, 4, (8, 8), (6, 6), (3, 3), (1, 1), (1, 1), (0, 0))
    folded, unfolded = (conv_plan.vertex_cycles(TARGET, spec, f, channels, 4, 36, DType.float32) for f in (1, 0))
    assert folded - unfolded == (loads - 9) * popsim.cost.CONV_WEIGHT_LOAD_CYCLES[4]
    # The plan folds exactly when its own channel block loads fewer weights folded.
    plan = conv_plan.plan_conv(TARGET, spec, DType.float32)
    assert plan.fold == (3 * -(-plan.blocks[3] * 3 // conv_plan.AMP_INPUT_CHANNELS[4]) < 9)
