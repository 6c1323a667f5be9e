"""Bad input raises popir.IRError naming the node (op, operand types, attributes, source line) and the shapes."""

import numpy as np
import pytest

import popir
from popir import ops


def _inputs(*specs):
    g = popir.Graph()
    return g, [g.add_input(f"x{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)]


@pytest.mark.parametrize(
    "call, specs, pattern",
    [
        (
            ops.add,
            [((2, 3), "float32"), ((4,), "float32")],
            r"add\(%0: float32\[2,3\], %1: float32\[4\]\).*do not broadcast",
        ),
        (ops.mul, [((2,), "float32"), ((2,), "int32")], r"mul\(%0: float32\[2\], %1: int32\[2\]\).*dtypes differ"),
        (
            ops.matmul,
            [((2, 3), "float32"), ((4, 5), "float32")],
            r"matmul\(.*float32\[2,3\].*float32\[4,5\].*contraction",
        ),
        (ops.matmul, [((2, 2, 3), "float32"), ((3, 3, 1), "float32")], r"matmul\(.*\[2, 2, 3\] and \[3, 3, 1\]"),
        (ops.log, [((2,), "int32")], r"log\(%0: int32\[2\]\).*floating-point"),
        (ops.where, [((2,), "float32"), ((2,), "float32"), ((2,), "float32")], r"where\(.*condition must be bool"),
        (ops.logical_and, [((2,), "float32"), ((2,), "bool")], r"logical_and\(.*needs bool"),
        (ops.concat, [((2, 3), "float32"), ((3, 3), "float32")], r"concat\(.*\[2, 3\] and \[3, 3\] do not concatenate"),
        (ops.take_along_axis, [((2, 3), "float32"), ((2, 3), "float32")], r"take_along_axis\(.*int32"),
    ],
)
def test_operand_errors_name_node_and_shapes(call, specs, pattern):
    g, xs = _inputs(*specs)
    kwargs = {"axis": 1} if call in (ops.concat, ops.take_along_axis) else {}
    with pytest.raises(popir.IRError, match=pattern):
        call(*xs, **kwargs)


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda x: ops.reshape(x, shape=(5,)), r"reshape\(%0: float32\[2,3\], shape=\(5,\)\).*cannot reshape \[2, 3\]"),
        (lambda x: ops.transpose(x, perm=(0, 0)), r"transpose\(.*not a permutation.*\[2, 3\]"),
        (lambda x: ops.reduce_sum(x, axes=(2,), keepdims=False), r"reduce_sum\(.*axis 2 is out of range for rank 2"),
        (lambda x: ops.broadcast_to(x, shape=(3, 3)), r"broadcast_to\(.*\[2, 3\] and \[3, 3\] do not broadcast"),
        (lambda x: ops.slice(x, starts=(0,), stops=(1,)), r"slice\(.*one start/stop/step per axis of \[2, 3\]"),
        (lambda x: ops.slice(x, starts=(0, 0), stops=(1, 1), steps=(0, 1)), r"slice\(.*steps must be positive"),
        (lambda x: ops.pad(x, pads=((1, -1), (0, 0))), r"pad\(.*non-negative.*\[2, 3\]"),
        (lambda x: ops.cast(x, dtype="complex64"), r"cast\(.*complex64"),
        (lambda x: ops.reduce_max(x, axes=(0, 0), keepdims=False), r"reduce_max\(.*repeated axis"),
    ],
)
def test_attribute_errors_name_node_and_shapes(build, pattern):
    _, (x,) = _inputs(((2, 3), "float32"))
    with pytest.raises(popir.IRError, match=pattern):
        build(x)


def test_conv_and_pool_errors():
    _, (x, w) = _inputs(((1, 4, 5, 5), "float32"), ((6, 3, 3, 3), "float32"))
    with pytest.raises(popir.IRError, match=r"conv2d\(.*float32\[1,4,5,5\].*float32\[6,3,3,3\].*groups=1"):
        ops.conv2d(x, w)
    with pytest.raises(popir.IRError, match=r"conv2d\(.*do not fit groups=2"):
        ops.conv2d(x, w, groups=2)
    _, (x, w) = _inputs(((1, 1, 2, 2), "float32"), ((1, 1, 3, 3), "float32"))
    with pytest.raises(popir.IRError, match=r"conv2d\(.*does not fit an axis of 2"):
        ops.conv2d(x, w)
    with pytest.raises(popir.IRError, match=r"max_pool2d\(.*padding .* at most half the kernel"):
        ops.max_pool2d(x, 2, padding=2)
    with pytest.raises(popir.IRError, match=r"stride must be"):
        ops.conv2d(x, x, stride=0)


def test_error_names_the_source_line():
    g, (a, b) = _inputs(((2,), "float32"), ((3,), "float32"))
    with g.source_line("model.py:7 in forward"), pytest.raises(popir.IRError, match=r"at model.py:7 in forward"):
        ops.sub(a, b)


def test_composite_and_index_errors():
    g, (x, t) = _inputs(((4, 3), "float32"), ((5,), "int32"))
    with pytest.raises(popir.IRError, match=r"target \[5\] does not fit input \[4, 3\]"):
        ops.nll_loss(x, t)
    with pytest.raises(popir.IRError, match=r"3 channels of \[4, 3\] do not split into 2 groups"):
        ops.group_norm(x, 2)
    with pytest.raises(popir.IRError, match="reduction must be"):
        ops.mse_loss(x, x, reduction="avg")
    idx = g.constant(np.array([0, 7], np.int32))
    graph_out = ops.gather(x, idx, axis=0)
    g.output("y", graph_out)
    with pytest.raises(popir.IRError, match=r"gather\(%0: float32\[4,3\], .*int32\[2\].*index out of range"):
        popir.interpreter.run(g, {"x0": np.zeros((4, 3)), "x1": np.zeros(5)})


def test_random_uniform_needs_an_int32_pair_seed():
    _, (seed,) = _inputs(((3,), "int32"))
    with pytest.raises(popir.IRError, match=r"random_uniform\(%0: int32\[3\].*seed must be int32\[2\]"):
        ops.random_uniform(seed, shape=(2,), dtype="float32")
