"""Host time of single conv2d layers as direct-convolution (CONV) vertices against im2col matmul vertices.

Each shape is compiled twice in one process on the default simulated IPU: once with every convolution forced
onto CONV vertices, once onto the im2col matmul path. Their runs then alternate, round by round, and the script
prints each shape's median run time of both and the median of the per-round ratios direct / im2col.
"""

import argparse
import statistics
from unittest import mock

import numpy as np
from _timing import mean_seconds  # bench/ is the script's directory

import popir
import popsim
from popir import ops
from popsim import conv_plan

ROUNDS = 7
RUNS_PER_ROUND = 5
# (input shape, output channels, kernel, stride, padding)
SHAPES = [
    ((8, 3, 32, 32), 16, 3, 1, 1),
    ((8, 16, 32, 32), 16, 3, 1, 1),
    ((8, 16, 32, 32), 32, 3, 2, 1),
    ((8, 16, 16, 16), 32, 3, 1, 1),
    ((8, 32, 16, 16), 32, 3, 1, 1),
]


def _compiled(shape, out_channels, kernel, stride, padding, direct):
    g = popir.Graph("conv")
    x = g.add_input("x", shape, "float32")
    w = g.add_input("w", (out_channels, shape[1], kernel, kernel), "float32", kind="parameter")
    g.output("y", ops.conv2d(x, w, stride=stride, padding=padding))
    with mock.patch.object(conv_plan, "direct_is_faster", return_value=direct):
        exe = popsim.compile(g, popsim.Target.ipu2())
    rng = np.random.default_rng(0)
    exe.write_variable("w", rng.normal(size=w.shape).astype(np.float32))
    feeds = {"x": rng.normal(size=shape).astype(np.float32)}
    exe.run(feeds)  # warm up
    return lambda: exe.run(feeds)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    for shape, out_channels, kernel, stride, padding in SHAPES:
        runs = {direct: _compiled(shape, out_channels, kernel, stride, padding, direct) for direct in (True, False)}
        times = {direct: [] for direct in runs}
        for _ in range(args.rounds):
            for direct, run in runs.items():
                times[direct].append(mean_seconds(run, RUNS_PER_ROUND))
        ratio = statistics.median(d / m for d, m in zip(times[True], times[False]))
        direct, im2col = (statistics.median(times[d]) * 1e3 for d in (True, False))
        layer = f"{str(shape):<18} -> {out_channels:>3} k{kernel} s{stride}"
        print(f"{layer}:  direct {direct:7.2f} ms  im2col {im2col:7.2f} ms  direct/im2col {ratio:.2f}")


if __name__ == "__main__":
    main()
