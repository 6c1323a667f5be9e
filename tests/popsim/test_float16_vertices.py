"""float16 MATMUL and CONV vertices widen their operands to float32 and round their result once: each equals
the same vertex run on float32 copies of its operands, rounded to float16 by NumPy, bit for bit (the engine
converts whole blocks with F16C where the CPU has it, element by element elsewhere). float16 add, sub, mul
and div run in float32 and round as NumPy's float16 arithmetic does."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import DType, ops
from popsim import _opcodes as oc

TARGET = popsim.Target.small(num_tiles=2)
# Operand scales from float16's subnormals to near its largest finite values.
SCALES = (1e-6, 1.0, 300.0)


def _tensor(dg, values, name):
    here = popsim.TileMapping.on_tiles
    flat = values.reshape(-1)
    return dg.add_tensor(flat.shape, DType(values.dtype.name), here([flat.size], [0]), name, "constant", flat)


def _one_vertex(build, out_size, out_dtype, **operands):
    """Run a compute set of one vertex on tile 0 (``build(dg, cs, fields, out)`` adds it); its output."""
    dg = popsim.DeviceGraph(TARGET)
    fields = {name: _tensor(dg, values, name) for name, values in operands.items()}
    out = dg.add_tensor((out_size,), out_dtype, popsim.TileMapping.on_tiles([out_size], [0]), "out")
    build(dg, dg.add_compute_set("vertex"), {k: t.region(0, t.shape[0]) for k, t in fields.items()}, out)
    return popsim.compile_device_graph(dg, outputs={"out": out}).run()["out"]


def _halves(rng, shape, scale):
    return (rng.normal(size=shape) * scale).astype(np.float16)


def _same_bits(got, want):
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.integers(1, 21), st.sampled_from(SCALES), st.integers(0, 2**16))
def test_a_float16_matmul_vertex_rounds_its_float32_product_once(m, k, n, scale, seed):
    rng = np.random.default_rng(seed)
    lhs, rhs = _halves(rng, (m, k), scale), _halves(rng, (k, n), scale)

    def build(out_dtype):
        def add(dg, cs, f, out):
            oc.matmul(dg.add_vertex, cs, 0, n, 1, lhs=f["lhs"], rhs=f["rhs"], out=out.region(0, m * n), m=m, k=k)

        return add

    wide = _one_vertex(
        build(DType.float32), m * n, DType.float32, lhs=lhs.astype(np.float32), rhs=rhs.astype(np.float32)
    )
    _same_bits(
        _one_vertex(build(DType.float32), m * n, DType.float32, lhs=lhs, rhs=rhs).view(np.uint32), wide.view(np.uint32)
    )
    with np.errstate(over="ignore"):
        want = wide.astype(np.float16)
    _same_bits(_one_vertex(build(DType.float16), m * n, DType.float16, lhs=lhs, rhs=rhs), want)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(3, 11),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 2),
    st.sampled_from(SCALES),
    st.integers(0, 2**16),
)
def test_a_float16_conv_vertex_rounds_its_float32_result_once(
    batch, channels, size, out_channels, kernel, stride, scale, seed
):
    rng = np.random.default_rng(seed)
    kernel = min(kernel, size)
    out_size = (size - kernel) // stride + 1
    geometry = [batch, channels, size, size, out_channels, out_size, out_size, kernel, kernel, stride, stride]
    geometry += [1, 1, 1, 1, 0, 0]  # dilation, input dilation, first row and column
    patch = _halves(rng, (batch, channels, size, size), scale)
    weights = _halves(rng, (out_channels, channels, kernel, kernel), scale)
    n = batch * out_channels * out_size * out_size

    def add(dg, cs, f, out):
        oc.conv(dg.add_vertex, cs, 0, n, 1, **f, out=out.region(0, n), patch_size=patch.size,
                weights_size=weights.size, taps=channels * kernel * kernel)  # fmt: skip

    geo = np.array(geometry, np.int32)
    wide = _one_vertex(
        add, n, DType.float32, patch=patch.astype(np.float32), weights=weights.astype(np.float32), geometry=geo
    )
    with np.errstate(over="ignore"):
        want = wide.astype(np.float16)
    _same_bits(_one_vertex(add, n, DType.float16, patch=patch, weights=weights, geometry=geo), want)


def _float16_values(rng, shape, scale):
    """float16 values of a scale, with NaNs, infinities, signed zeros and subnormals mixed in."""
    x = _halves(rng, max(1, int(np.prod(shape))), scale)
    special = rng.random(x.shape) < 0.2
    x[special] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6e-8, -6e-8], np.float16), int(special.sum()))
    return x.reshape(shape)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["add", "sub", "mul", "div"]),
    st.sampled_from([(), (0,), (1,)]),  # the first or second operand a scalar, or neither
    st.integers(1, 600),
    st.sampled_from(SCALES),
    st.integers(0, 2**16),
)
def test_float16_arithmetic_in_float32_rounds_as_numpy_does(op, scalar_at, n, scale, seed):
    rng = np.random.default_rng(seed)
    shapes = [(n,), (n,)]
    for i in scalar_at:
        shapes[i] = ()
    g = popir.Graph("arith")
    x, y = g.add_input("x", shapes[0], "float16"), g.add_input("y", shapes[1], "float16")
    g.output("z", getattr(ops, op)(x, y))
    feeds = {"x": _float16_values(rng, shapes[0], scale), "y": _float16_values(rng, shapes[1], scale)}
    got = popsim.compile(g, TARGET).run(feeds)["z"]
    with np.errstate(all="ignore"):
        want = popir.interpreter.run(g, feeds)["z"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    _same_bits(got[~np.isnan(want)], want[~np.isnan(want)])
