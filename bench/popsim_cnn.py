"""The PopTorch tutorial CNN training step as a popir graph on a simulated Mk2 IPU.

Prints compile time, wall time per step, peak RSS, simulated cycles per step and their split, and (when
torch is installed) the same step in eager PyTorch for the ratio. Run: python bench/popsim_cnn.py
"""

import argparse
import resource
import time

import numpy as np
from _timing import popsim_threads  # bench/ is the script's directory

import popir
import popsim
from popir import ops

BATCH = 16
LR = 0.05


def params():
    rng = np.random.default_rng(0)

    def init(*shape, fan_in):
        bound = 1 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    return {
        "conv1.weight": init(5, 1, 3, 3, fan_in=9),
        "conv1.bias": init(5, fan_in=9),
        "conv2.weight": init(12, 5, 5, 5, fan_in=125),
        "conv2.bias": init(12, fan_in=125),
        "norm.weight": np.ones(12, np.float32),
        "norm.bias": np.zeros(12, np.float32),
        "fc1.weight": init(100, 972, fan_in=972),
        "fc1.bias": init(100, fan_in=972),
        "fc2.weight": init(10, 100, fan_in=100),
        "fc2.bias": init(10, fan_in=100),
    }


def build_graph(initial):
    """Forward, NLL loss, autodiff backward and the SGD update of every parameter."""
    g = popir.Graph("cnn_train")
    x = g.add_input("x", (BATCH, 1, 28, 28), "float32")
    labels = g.add_input("labels", (BATCH,), "int32")
    p = {name: g.add_input(name, a.shape, "float32", kind="parameter") for name, a in initial.items()}

    def conv(h, name):
        bias = ops.reshape(p[f"{name}.bias"], shape=(1, p[f"{name}.bias"].shape[0], 1, 1))
        return ops.conv2d(h, p[f"{name}.weight"]) + bias

    h = ops.max_pool2d(ops.relu(conv(x, "conv1")), 2)
    h = ops.group_norm(ops.relu(conv(h, "conv2")), 3, p["norm.weight"], p["norm.bias"])
    h = ops.flatten(h, 1)
    h = ops.relu(ops.linear(h, p["fc1.weight"], p["fc1.bias"]))
    log_probs = ops.log_softmax(ops.linear(h, p["fc2.weight"], p["fc2.bias"]), axis=1)
    loss = ops.nll_loss(log_probs, labels)
    g.output("loss", loss)
    grads = popir.autodiff.grad(g, loss, list(p.values()))
    for value, grad in zip(p.values(), grads):
        g.update(value, value - grad * LR)
    return g


def torch_step_seconds(initial, x, labels, steps):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(popsim_threads())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 5, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(5, 12, 5),
        torch.nn.ReLU(),
        torch.nn.GroupNorm(3, 12),
        torch.nn.Flatten(),
        torch.nn.Linear(972, 100),
        torch.nn.ReLU(),
        torch.nn.Linear(100, 10),
        torch.nn.LogSoftmax(dim=1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tx, ty = torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.nll_loss(model(tx), ty).backward()
        opt.step()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.nll_loss(model(tx), ty).backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target", default="ipu2")
    args = parser.parse_args()
    initial = params()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 1, 28, 28)).astype(np.float32)
    labels = rng.integers(0, 10, BATCH).astype(np.int32)
    g = build_graph(initial)

    start = time.perf_counter()
    exe = popsim.compile(g, args.target)
    compile_s = time.perf_counter() - start
    for name, value in initial.items():
        exe.write_variable(name, value)
    feeds = {"x": x, "labels": labels}
    expected, _ = popir.interpreter.step(g, {**feeds, **initial})
    first = exe.run(feeds)["loss"]
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = exe.run(feeds)["loss"]
    step_s = (time.perf_counter() - start) / args.steps
    prof = exe.profile.programs[g.name]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"tutorial CNN training step, batch {BATCH}, target {args.target}")
    print(
        f"  first loss {float(first):.6f} (interpreter {float(expected['loss']):.6f});"
        f" after {args.steps} steps {float(loss):.6f}"
    )
    print(f"  compile time        {compile_s:8.2f} s")
    print(f"  wall time per step  {step_s * 1e3:8.2f} ms")
    print(f"  peak RSS            {rss_mb:8.0f} MB")
    print(
        f"  simulated cycles    {prof['total_cycles']:8d} per step ({prof['seconds'] * 1e6:.1f} us at the clock):"
        f" compute {prof['compute_cycles']}, exchange {prof['exchange_cycles']}, sync {prof['sync_cycles']},"
        f" host {prof['host_cycles']}"
    )
    eager = torch_step_seconds(initial, x, labels, args.steps)
    if eager is not None:
        print(f"  eager PyTorch step  {eager * 1e3:8.2f} ms  -> popsim / eager = {step_s / eager:.1f}x")


if __name__ == "__main__":
    main()
