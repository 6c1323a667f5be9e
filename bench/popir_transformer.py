"""popir compile path on a BERT-sized encoder: build, autodiff and optimise a 12-layer transformer.

12 layers, d_model 256, 4 heads, FFN 1024, sequence 128, batch 8 (pre-norm layers with layer_norm,
softmax attention, GELU, dropout and residuals), an MSE loss and an SGD update of every parameter.
Prints the wall and CPU time of each phase and their total (target: under 1 s), node counts before and after
``popir.passes.optimize``, and the peak RSS. Only graphs are built: no tensor data is computed.
"""

import math
import resource
import time

import numpy as np

import popir
from popir import ops

LAYERS, D_MODEL, HEADS, FFN, SEQ, BATCH = 12, 256, 4, 1024, 128, 8
DROPOUT, LR = 0.1, 0.01


class _Encoder:
    """Adds the encoder's parameters to a graph and applies its layers."""

    def __init__(self, graph):
        self.graph = graph
        self.params = []
        self.seed = graph.add_input("seed", (2,), "int32")
        self.dropouts = 0

    def param(self, name, shape):
        value = self.graph.add_input(name, shape, "float32", kind="parameter")
        self.params.append(value)
        return value

    def dropout(self, x):
        # Every dropout site draws from its own stream: the run's seed offset by the site number.
        self.dropouts += 1
        offset = self.graph.constant(np.array([self.dropouts, 0], np.int32))
        return ops.dropout(x, DROPOUT, self.seed + offset)

    def linear(self, prefix, x, n_in, n_out):
        return ops.linear(x, self.param(f"{prefix}.weight", (n_out, n_in)), self.param(f"{prefix}.bias", (n_out,)))

    def layer_norm(self, prefix, x):
        weight, bias = self.param(f"{prefix}.weight", (D_MODEL,)), self.param(f"{prefix}.bias", (D_MODEL,))
        return ops.layer_norm(x, (D_MODEL,), weight, bias)

    def attention(self, prefix, x):
        head = D_MODEL // HEADS

        def split(t):  # (B, S, D) -> (B, H, S, d)
            return ops.transpose(ops.reshape(t, shape=(BATCH, SEQ, HEADS, head)), perm=(0, 2, 1, 3))

        q = split(self.linear(f"{prefix}.q", x, D_MODEL, D_MODEL))
        k = split(self.linear(f"{prefix}.k", x, D_MODEL, D_MODEL))
        v = split(self.linear(f"{prefix}.v", x, D_MODEL, D_MODEL))
        scores = ops.matmul(q, ops.transpose(k, perm=(0, 1, 3, 2))) * (1.0 / math.sqrt(head))
        context = ops.matmul(self.dropout(ops.softmax(scores, axis=-1)), v)
        merged = ops.reshape(ops.transpose(context, perm=(0, 2, 1, 3)), shape=(BATCH, SEQ, D_MODEL))
        return self.linear(f"{prefix}.out", merged, D_MODEL, D_MODEL)

    def layer(self, i, x):
        p = f"layer{i}"
        with self.graph.source_line(f"popir_transformer.py: layer {i} attention"):
            x = x + self.dropout(self.attention(f"{p}.attn", self.layer_norm(f"{p}.ln1", x)))
        with self.graph.source_line(f"popir_transformer.py: layer {i} feed-forward"):
            h = ops.gelu(self.linear(f"{p}.ffn1", self.layer_norm(f"{p}.ln2", x), D_MODEL, FFN))
            x = x + self.dropout(self.linear(f"{p}.ffn2", h, FFN, D_MODEL))
        return x


def build_forward():
    g = popir.Graph("transformer")
    x = g.add_input("x", (BATCH, SEQ, D_MODEL), "float32")
    target = g.add_input("target", (BATCH, SEQ, D_MODEL), "float32")
    encoder = _Encoder(g)
    for i in range(LAYERS):
        x = encoder.layer(i, x)
    loss = ops.mse_loss(encoder.layer_norm("final_ln", x), target)
    g.output("loss", loss)
    return g, loss, encoder.params


def add_backward(g, loss, params):
    grads = popir.autodiff.grad(g, loss, params)
    for w, gw in zip(params, grads):
        g.update(w, w - gw * LR)


def main():
    phases = {}

    def timed(name, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args)
        phases[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        return result

    g, loss, params = timed("build forward", build_forward)
    forward_nodes = len(g.nodes)
    timed("autodiff", add_backward, g, loss, params)
    before = len(g.nodes)
    optimized = timed("passes.optimize", popir.passes.optimize, g)

    n_params = sum(int(np.prod(p.shape)) for p in params)
    print(f"{LAYERS}-layer encoder, d_model {D_MODEL}, {HEADS} heads, ffn {FFN}, seq {SEQ}, batch {BATCH}")
    print(f"parameters: {len(params)} tensors, {n_params:,} values")
    # CPU time beside wall time: on a shared machine the wall clock also counts other processes' turns.
    print(f"  {'phase':<16} {'wall ms':>8} {'cpu ms':>8}")
    for name, (wall, cpu) in phases.items():
        print(f"  {name:<16} {wall * 1e3:8.1f} {cpu * 1e3:8.1f}")
    wall, cpu = (sum(t[i] for t in phases.values()) for i in (0, 1))
    print(f"  {'total':<16} {wall * 1e3:8.1f} {cpu * 1e3:8.1f}  (target < 1000 ms)")
    print(f"nodes: forward {forward_nodes}, with backward {before}, optimized {len(optimized.nodes)}")
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak RSS: {kib / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
