"""Every op of the database: shape rules against the references' real outputs, float16 against float32, and
the semantics torch users rely on (VJPs are checked in test_autodiff.py). No torch here."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opdb import OPDB, composites, primitives

import popir
from popir import ops

PRIMITIVES = [e.name for e in primitives()]
# One example per op costs ~25 ms; fewer examples than the profile keep this file near 30 s.
PER_OP = settings(max_examples=min(settings.default.max_examples, 10))


def _raw_outputs(graph, feeds):
    """Run each node's reference and check its raw result against the node's inferred types."""
    env = {v.id: np.asarray(feeds[v.name]).astype(v.dtype.numpy) for v in graph.inputs}
    for node in graph.nodes:
        result = popir.get_op(node.op).ref(*[env[v.id] for v in node.inputs], **node.attrs)
        results = result if isinstance(result, tuple) else (result,)
        assert len(results) == len(node.outputs), node.describe()
        for value, array in zip(node.outputs, results):
            array = np.asarray(array)
            assert array.shape == value.shape, f"{node.describe()}: reference gave {array.shape}, rule {value.type}"
            assert array.dtype == value.dtype.numpy, (
                f"{node.describe()}: reference gave {array.dtype}, rule {value.type}"
            )
            env[value.id] = array
    return env


@pytest.mark.parametrize("name", PRIMITIVES + [e.name for e in composites()])
@PER_OP
@given(data=st.data())
def test_shape_rule_matches_reference(name, data):
    entry = OPDB[name]
    for dtype in entry.dtypes:
        graph, feeds = entry.make_graph(data.draw(entry.samples(dtype)))
        graph.verify()
        _raw_outputs(graph, feeds)


@pytest.mark.parametrize("name", [e.name for e in OPDB.values() if "float16" in e.dtypes])
@PER_OP
@given(data=st.data())
def test_float16_matches_float32(name, data):
    entry = OPDB[name]
    sample = data.draw(entry.samples("float16"))
    graph16, feeds = entry.make_graph(sample)
    out16 = popir.interpreter.run(graph16, feeds)
    feeds32 = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
    graph32, _ = entry.make_graph(type(sample)(feeds32, {**sample.attrs, **_dtype_attr(sample, "float32")}))
    out32 = popir.interpreter.run(graph32, feeds32)
    for key, value in out16.items():
        expected = out32[key].astype(np.float32)
        np.testing.assert_allclose(value.astype(np.float32), expected, rtol=entry.fp16_rtol, atol=entry.fp16_atol)


def _dtype_attr(sample, dtype):
    return {"dtype": dtype} if "dtype" in sample.attrs else {}


# -- semantics ---------------------------------------------------------------------------------------------
def _run(build, **feeds):
    graph = popir.Graph()
    values = {k: graph.add_input(k, np.shape(v), np.asarray(v).dtype) for k, v in feeds.items()}
    result = build(**values)
    results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    for i, r in enumerate(results):
        graph.output(f"out{i}", r)
    out = popir.interpreter.run(graph, feeds)
    return out["out0"] if len(results) == 1 else tuple(out[f"out{i}"] for i in range(len(results)))


def _grad(build, wrt, **feeds):
    graph = popir.Graph()
    values = {k: graph.add_input(k, np.shape(v), np.asarray(v).dtype) for k, v in feeds.items()}
    loss = ops.reduce_sum(build(**values), axes=None, keepdims=False)
    (g,) = popir.autodiff.grad(graph, loss, [values[wrt]])
    graph.output("g", g)
    return popir.interpreter.run(graph, feeds)["g"]


def test_random_uniform_follows_the_bit_recipe():
    seed = np.array([12345, -7], np.int32)

    def reference(i):
        m = 0xFFFFFFFF
        h = ((i * 0x9E3779B9 + (12345 & m)) & m) ^ (((-7 & m) * 0x85EBCA6B) & m)
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m
        h ^= h >> 16
        return np.float32((h >> 8) * 2.0**-24)

    got = _run(lambda seed: ops.random_uniform(seed, shape=(3, 5), dtype="float32"), seed=seed)
    np.testing.assert_array_equal(got.ravel(), [reference(i) for i in range(15)])
    assert 0.0 <= got.min() and got.max() < 1.0
    again = _run(lambda seed: ops.random_uniform(seed, shape=(3, 5), dtype="float32"), seed=seed)
    np.testing.assert_array_equal(got, again)


def test_dropout_keeps_expected_fraction_and_scales():
    x = np.ones((100, 100), np.float32)
    y = _run(lambda x, seed: ops.dropout(x, 0.3, seed), x=x, seed=np.array([1, 2], np.int32))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)


def test_relu_gradient_is_zero_at_zero_and_maximum_splits_ties():
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(_grad(lambda x: ops.relu(x), "x", x=x), [0, 0, 1])
    b = np.array([0.0, 0.0, 0.0], np.float32)
    np.testing.assert_array_equal(_grad(lambda x, b: ops.maximum(x, b), "x", x=x, b=b), [0, 0.5, 1])


def test_reduce_max_gradient_is_shared_between_ties_like_amax():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], np.float32)
    g = _grad(lambda x: ops.reduce_max(x, axes=(1,), keepdims=False), "x", x=x)
    np.testing.assert_array_equal(g, [[0, 0.5, 0.5], [1, 0, 0]])


def test_argmax_takes_the_first_maximum_as_int32():
    x = np.array([[1.0, 3.0, 3.0], [5.0, 5.0, 1.0]], np.float32)
    got = _run(lambda x: ops.argmax(x, axis=1, keepdims=False), x=x)
    assert got.dtype == np.int32 and got.tolist() == [1, 0]


def test_integer_division_floors_and_cast_truncates():
    a, b = np.array([7, -7, 7], np.int32), np.array([2, 2, -2], np.int32)
    assert _run(lambda a, b: ops.div(a, b), a=a, b=b).tolist() == [3, -4, -4]
    x = np.array([1.7, -1.7], np.float32)
    assert _run(lambda x: ops.cast(x, dtype="int32"), x=x).tolist() == [1, -1]


def test_float16_sum_and_matmul_accumulate_in_float32():
    x = np.full((4096,), 0.1, np.float16)
    total = _run(lambda x: ops.reduce_sum(x, axes=None, keepdims=False), x=x)
    assert total.dtype == np.float16 and abs(float(total) - 409.6) < 0.5
    a, b = np.full((1, 4096), 0.1, np.float16), np.ones((4096, 1), np.float16)
    assert abs(float(_run(lambda a, b: ops.matmul(a, b), a=a, b=b)[0, 0]) - 409.6) < 0.5


def test_log_softmax_is_stable_for_large_logits():
    x = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    got = _run(lambda x: ops.log_softmax(x, axis=1), x=x)
    np.testing.assert_allclose(got, [[0.0, -1000.0, -2000.0]])


def test_max_pool_gradient_goes_to_the_first_maximum():
    x = np.array([[[[1.0, 1.0], [0.0, 1.0]]]], np.float32)
    g = _grad(lambda x: ops.max_pool2d(x, 2), "x", x=x)
    np.testing.assert_array_equal(g, [[[[1, 0], [0, 0]]]])


def test_cross_entropy_ignores_ignore_index():
    logits = np.array([[2.0, 0.0], [0.0, 5.0]], np.float32)
    target = np.array([0, -100], np.int32)
    got = _run(lambda logits, target: ops.cross_entropy(logits, target), logits=logits, target=target)
    np.testing.assert_allclose(got, np.log1p(np.exp(-2.0)), rtol=1e-6)


# -- wave 2 semantics ----------------------------------------------------------------------------------------
def test_sort_is_stable_and_topk_takes_the_largest():
    x = np.array([[3.0, 1.0, 3.0, 2.0]], np.float32)
    values, indices = _run(lambda x: ops.sort(x, axis=1, descending=True), x=x)
    assert values.tolist() == [[3, 3, 2, 1]] and indices.tolist() == [[0, 2, 3, 1]] and indices.dtype == np.int32
    values, indices = _run(lambda x: ops.topk(x, 2, axis=1, largest=False), x=x)
    assert values.tolist() == [[1, 2]] and indices.tolist() == [[1, 3]]


def test_cumsum_forward_and_reverse():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    assert _run(lambda x: ops.cumsum(x, axis=0), x=x).tolist() == [1, 3, 6]
    assert _run(lambda x: ops.cumsum(x, axis=0, reverse=True), x=x).tolist() == [6, 5, 3]
    assert _grad(lambda x: ops.cumsum(x, axis=0), "x", x=x).tolist() == [3, 2, 1]


def test_remainder_takes_the_sign_of_the_divisor_like_torch():
    a, b = np.array([5, -5, 5, -5], np.int32), np.array([3, 3, -3, -3], np.int32)
    assert _run(lambda a, b: ops.remainder(a, b), a=a, b=b).tolist() == [2, 1, -1, -2]


def test_rounding_is_half_to_even_and_trunc_goes_toward_zero():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.7, 1.7], np.float32)
    assert _run(lambda x: ops.round(x), x=x).tolist() == [0, 2, 2, -0, -2, 2]
    assert _run(lambda x: ops.trunc(x), x=x).tolist() == [0, 1, 2, -0, -1, 1]


def test_bitwise_ops_on_ints_and_bools():
    a, b = np.array([12, -1], np.int32), np.array([10, 7], np.int32)
    assert _run(lambda a, b: ops.bitwise_and(a, b), a=a, b=b).tolist() == [8, 7]
    assert _run(lambda a, b: ops.bitwise_xor(a, b), a=a, b=b).tolist() == [6, -8]
    assert _run(lambda a: ops.bitwise_not(a), a=np.array([True, False])).tolist() == [False, True]
    g = popir.Graph()
    with pytest.raises(popir.IRError, match="int32 or bool"):
        ops.bitwise_or(g.add_input("f", (2,), "float32"), g.add_input("h", (2,), "float32"))


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("reflect", [2, 1, 2, 3, 2]),
        ("replicate", [1, 1, 2, 3, 3]),
        ("circular", [3, 1, 2, 3, 1]),
        ("constant", [0, 1, 2, 3, 0]),
    ],
)
def test_pad_modes(mode, expected):
    x = np.array([[[1.0, 2.0, 3.0]]], np.float32)
    got = _run(lambda x: ops.pad_mode(x, pads=((0, 0), (0, 0), (1, 1)), mode=mode), x=x)
    assert got.ravel().tolist() == expected


def test_roll_split_stack_round_trip():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert _run(lambda x: ops.roll(x, 1, 1), x=x).tolist() == [[2, 0, 1], [5, 3, 4]]
    parts = _run(lambda x: ops.split(x, 2, axis=1), x=x)
    assert [p.shape for p in parts] == [(2, 2), (2, 1)]
    np.testing.assert_array_equal(_run(lambda x: ops.stack(ops.split(x, 1, axis=0), axis=0), x=x)[:, 0], x)


def test_adaptive_pool_uses_torch_bins():
    x = np.arange(5, dtype=np.float32).reshape(1, 1, 1, 5)
    got = _run(lambda x: ops.adaptive_avg_pool2d(x, (1, 3)), x=x)
    np.testing.assert_allclose(got.ravel(), [0.5, 2.0, 3.5])


def test_binary_cross_entropy_clamps_log_at_minus_100():
    p, t = np.array([0.0, 1.0], np.float32), np.array([1.0, 0.0], np.float32)
    with np.errstate(divide="ignore"):  # log(0) = -inf before the clamp, as in torch
        got = _run(lambda p, t: ops.binary_cross_entropy(p, t, reduction="none"), p=p, t=t)
    np.testing.assert_allclose(got, [100.0, 100.0])


def test_lstm_cell_with_zero_weights_halves_the_cell_state():
    x, h, c = np.ones((1, 2), np.float32), np.zeros((1, 3), np.float32), np.full((1, 3), 2.0, np.float32)
    w_ih, w_hh = np.zeros((12, 2), np.float32), np.zeros((12, 3), np.float32)
    h1, c1 = _run(lambda x, h, c, w_ih, w_hh: ops.lstm_cell(x, h, c, w_ih, w_hh), x=x, h=h, c=c, w_ih=w_ih, w_hh=w_hh)
    np.testing.assert_allclose(c1, 1.0)  # sigmoid(0) * 2 + sigmoid(0) * tanh(0)
    np.testing.assert_allclose(h1, 0.5 * np.tanh(1.0), rtol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_every_target_ignored_is_nan_with_zero_gradient(smoothing):
    # torch: the mean over zero counted targets is 0/0 = NaN, while the backward pass writes no gradient.
    g = popir.Graph("ce")
    x = g.add_input("x", (3, 4), "float32")
    t = g.add_input("t", (3,), "int32")
    loss = ops.cross_entropy(x, t, ignore_index=-100, label_smoothing=smoothing)
    g.output("loss", loss)
    g.output("grad", popir.autodiff.grad(g, loss, [x])[0])
    feeds = {"x": np.ones((3, 4), np.float32), "t": np.full(3, -100, np.int32)}
    with np.errstate(invalid="ignore"):
        out = popir.interpreter.run(g, feeds)
    assert np.isnan(out["loss"])
    np.testing.assert_array_equal(out["grad"], np.zeros((3, 4), np.float32))
