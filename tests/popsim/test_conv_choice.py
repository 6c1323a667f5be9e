"""The choice between CONV vertices and an im2col matmul for a convolution's weight gradient agrees with the
simulated cycles of both on the small ResNet's shapes (batch 8 of 32x32): the estimate charges the im2col
matmul's reduction at its small result's busiest tile, where its linear mapping puts it."""

from unittest import mock

import pytest

import popir
import popsim
from popir import ops
from popsim import conv_plan

IPU = popsim.Target.ipu2()

# (input shape, output channels, kernel, stride, padding): a 3x3 32 -> 32 layer on 16x16 (CONV vertices
# faster) and the strided 1x1 projection 16 -> 32 on 32x32 (im2col faster).
SHAPES = [((8, 32, 16, 16), 32, 3, 1, 1), ((8, 16, 32, 32), 32, 1, 2, 0)]


def _weight_gradient(x_shape, out_channels, kernel, stride, padding):
    g = popir.Graph("gw")
    x = g.add_input("x", x_shape, "float32")
    out = (x_shape[2] + 2 * padding - kernel) // stride + 1
    gy = g.add_input("gy", (x_shape[0], out_channels, out, out), "float32")
    window = {"stride": (stride, stride), "padding": ((padding, padding),) * 2, "dilation": (1, 1), "groups": 1}
    g.output("gw", ops.conv2d_grad_weight(x, gy, weight_shape=(out_channels, x_shape[1], kernel, kernel), **window))
    return g


def _device_cycles(g, direct):
    """Simulated cycles on the device (the host transfers of the feeds are the same either way)."""
    with mock.patch.object(conv_plan, "direct_is_faster", return_value=direct):
        profile = popsim.compile(g, IPU).profile.programs[g.name]
    return profile["compute_cycles"] + profile["exchange_cycles"] + profile["sync_cycles"]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_weight_gradient_choice_agrees_with_the_simulated_cycles(shape):
    g = _weight_gradient(*shape)
    chosen = []
    estimate = conv_plan.direct_is_faster

    def record(*args):
        chosen.append(estimate(*args))
        return chosen[-1]

    with mock.patch.object(conv_plan, "direct_is_faster", record):
        popsim.compile(g, IPU)
    assert len(chosen) == 1
    direct, im2col = _device_cycles(g, True), _device_cycles(g, False)
    assert direct != im2col
    assert chosen[0] == (direct < im2col), (direct, im2col)
