"""A new op end to end without torch: defined in popir, lowered onto tiles with popsim.register_lowering,
trained on the simulated IPU and checked against popir's interpreter (NumPy).

The op is ``rms(x, axis)``, the root mean square along one axis: its popir definition gives the shape rule,
the NumPy reference and the gradient (as popir ops, so the backward pass also runs on the IPU); its popsim
lowering builds the tile program from the planner helpers (elementwise vertices, a reduction, constants).

    python examples/custom_op.py
"""

import numpy as np

import popir
import popsim
from popir import ops


def _infer(x, axis):
    if not x.dtype.is_float:
        raise popir.IRError(f"rms needs a float tensor, got {x.dtype}")
    shape = tuple(d for i, d in enumerate(x.shape) if i != axis % len(x.shape))
    return popir.TensorType(shape, x.dtype)


def _reference(x, axis):
    return np.sqrt(np.mean(np.square(x), axis=axis)).astype(x.dtype)


def _vjp(inputs, outputs, cotangents, axis):
    """d rms / dx = x / (n * rms): the cotangent broadcast back over ``axis``."""
    (x,), (r,), (g,) = inputs, outputs, cotangents
    axis %= len(x.shape)
    n = x.graph.constant(np.array(x.shape[axis], x.dtype.numpy))
    scale = ops.unsqueeze(g / (r * n), axis)
    return [x * scale]


rms = popir.defop("rms", infer=_infer, ref=_reference, vjp=_vjp, doc="Root mean square of ``x`` along ``axis``.")


@popsim.register_lowering("rms")
def _lower_rms(lw, node, x, axis):
    out = node.outputs[0]
    axis %= len(x.shape)
    squares = lw.elementwise("mul", [x, x], x.shape, x.dtype)
    total = lw.reduce_axes("sum", squares, (axis,), keepdims=False)
    inverse_n = lw.constant(np.array(1.0 / x.shape[axis]), x.dtype)
    mean = lw.elementwise("mul", [total, inverse_n], out.shape, out.dtype)
    return lw.elementwise("sqrt", [mean], out.shape, out.dtype)


def training_graph(batch, features):
    """loss = sum((rms(x * w, axis=1) - target)^2); outputs the loss and the step w -= lr * dloss/dw."""
    g = popir.Graph("train")
    x = g.add_input("x", (batch, features), "float32")
    target = g.add_input("target", (batch,), "float32")
    w = g.add_input("w", (features,), "float32", kind="parameter")
    err = rms(x * w, axis=1) - target
    loss = ops.reduce_sum(err * err, axes=None, keepdims=False)
    (dw,) = popir.autodiff.grad(g, loss, [w])
    g.output("loss", loss)
    g.update(w, w - g.constant(np.array(0.05, np.float32)) * dw)
    return g


def main(steps=5, seed=0):
    """Train on popsim and in the interpreter side by side; returns the largest difference of the losses."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    target = np.full(8, 0.5, np.float32)
    w_host = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    graph = training_graph(8, 16)
    exe = popsim.compile(graph, popsim.Target.small(num_tiles=16))
    exe.write_variable("w", w_host)
    worst = 0.0
    for step in range(steps):
        device = float(exe.run({"x": x, "target": target})["loss"])
        expected, updates = popir.interpreter.step(graph, {"x": x, "target": target, "w": w_host})
        w_host = updates["w"]
        worst = max(worst, abs(device - float(expected["loss"])))
        print(f"step {step}: loss on popsim {device:.6f}, interpreter {float(expected['loss']):.6f}")
    np.testing.assert_allclose(exe.read_variable("w"), w_host, rtol=1e-5, atol=1e-6)
    return worst


if __name__ == "__main__":
    print(f"largest loss difference: {main():.2e}")
