"""Every lowered ATen op, captured and run by the popir interpreter, against eager PyTorch (forward and backward).

``op_cases(seed, size)`` is the reusable part: it yields ``(name, module, inputs)`` per op so that the same
cases can run through ``poptorch.inferenceModel`` / ``trainingModel`` once the simulator compiles graphs.
To keep capture (torch.export) cheap, each test bundles one family of cases into a single module.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import popir
import poptorch._losses as losses
from poptorch._capture import RNG_SEED, capture

RTOL, ATOL = 2e-4, 2e-5


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _positive(gen, *shape):
    return torch.rand(*shape, generator=gen) + 0.5


def _ints(gen, high, *shape):
    return torch.randint(0, high, shape, generator=gen)


def _unary_cases(gen, n):
    x = _randn(gen, n, n + 1)
    p = _positive(gen, n, n + 1)
    return {
        "exp": (torch.exp, x),
        "log": (torch.log, p),
        "sqrt": (torch.sqrt, p),
        "rsqrt": (torch.rsqrt, p),
        "tanh": (torch.tanh, x),
        "sigmoid": (torch.sigmoid, x),
        "erf": (torch.erf, x),
        "abs": (torch.abs, x),
        "sin": (torch.sin, x),
        "cos": (torch.cos, x),
        "relu": (F.relu, x),
        "neg": (torch.neg, x),
        "reciprocal": (torch.reciprocal, p),
        "log1p": (torch.log1p, p),
        "expm1": (torch.expm1, x),
        "log2": (torch.log2, p),
        "square": (torch.square, x),
        "pow3": (lambda t: t**3, x),
        "pow_half": (lambda t: t**0.5, p),
        "pow_tensor": (torch.pow, p, x),
        "silu": (F.silu, x),
        "gelu": (F.gelu, x),
        "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), x),
        "leaky_relu": (lambda t: F.leaky_relu(t, 0.2), x),
        "elu": (F.elu, x),
        "softplus": (F.softplus, x),
        "hardtanh": (F.hardtanh, x),
        "clamp": (lambda t: t.clamp(-0.5, 0.7), x),
        "softmax": (lambda t: t.softmax(-1), x),
        "log_softmax": (lambda t: F.log_softmax(t, 0), x),
        "logsumexp": (lambda t: torch.logsumexp(t, 1), x),
        "normalize": (F.normalize, p),
    }


def _binary_cases(gen, n):
    a, b = _randn(gen, n, 1, 3), _randn(gen, 2, 3)
    i, j = _ints(gen, 5, n, 3), _ints(gen, 5, 3) + 1
    return {
        "add": (torch.add, a, b),
        "add_alpha": (lambda u, v: torch.add(u, v, alpha=2.5), a, b),
        "sub": (torch.sub, a, b),
        "rsub": (lambda u: 2.0 - u, a),
        "mul": (torch.mul, a, b),
        "div": (torch.div, a, _positive(gen, 2, 3)),
        "maximum": (torch.maximum, a, b),
        "minimum": (torch.minimum, a, b),
        "scalar_arith": (lambda u: (u * 3 + 1) / 2 - 0.25, a),
        "int_times_float": (lambda u, k: u * k, a, j),
        "int_true_div": (lambda k: k / 2, i),
        "int_floor_div": (lambda k, m: k // m, i, j),
        "int_arith": (lambda k, m: k * m + 3 - m, i, j),
        "where": (lambda u, v: torch.where(u > v, u, v * 2), a, b),
        "masked_fill": (lambda u: u.masked_fill(u < 0, 0.5), a),
        "comparisons": (
            lambda u, v: ((u == v) | (u < v)) & ~(u >= v + 1) ^ (u != 0) | (u <= 0) & (u > -1),
            a,
            b,
        ),
        "compare_int_float": (lambda k, u: k > u, i, a[:, 0, :]),
        "cast_int": (lambda u: (u * 4).to(torch.int32), a),
        "cast_float64": (lambda u: u.double() * 2, a),
        "cast_bool": (lambda u: (u > 0).float(), a),
    }


def _reduction_cases(gen, n):
    x = _randn(gen, n, 3, 4)
    return {
        "sum": (lambda t: t.sum((0, 2)), x),
        "sum_all": (torch.sum, x),
        "sum_int": (lambda k: k.sum(1), _ints(gen, 7, n, 3)),
        "mean": (lambda t: t.mean(-1, keepdim=True), x),
        "mean_all": (torch.mean, x),
        "amax": (lambda t: t.amax(1), x),
        "amin": (lambda t: t.amin((0, 1), keepdim=True), x),
        "max_dim": (lambda t: t.max(2), x),
        "min_dim": (lambda t: t.min(0, keepdim=True), x),
        "max_all": (torch.max, x),
        "argmax": (lambda t: t.argmax(1), x),
        "argmin_all": (torch.argmin, x),
        "var": (lambda t: t.var(1), x),
        "var_biased": (lambda t: t.var((0, 2), unbiased=False, keepdim=True), x),
        "std": (lambda t: t.std(-1), x),
        "norm": (lambda t: t.norm(dim=-1), x),
        "norm_orders": (
            lambda t: (t.norm(p=3, dim=1), torch.linalg.vector_norm(t, ord=0.5), t.norm(p=float("inf"))),
            x,
        ),
        "any_all": (lambda t: ((t > 1).any(1), (t > -2).all()), x),
    }


def _movement_cases(gen, n):
    x = _randn(gen, n, 4, 3)
    idx = _ints(gen, 4, 5)
    return {
        "view": (lambda t: t.view(n * 2, 6), x),
        "flatten": (lambda t: t.flatten(1), x),
        "permute": (lambda t: t.permute(2, 0, 1), x),
        "transpose": (lambda t: t.transpose(0, 2), x),
        "t": (lambda m: m.t(), x[0]),
        "expand": (lambda t: t[:, :1].expand(n, 5, 3), x),
        "slice": (lambda t: t[:, 1:4:2, -2:], x),
        "select": (lambda t: t[:, -1], x),
        "unsqueeze_squeeze": (lambda t: t.unsqueeze(1).squeeze(1).unsqueeze(-1), x),
        "cat": (lambda t, u: torch.cat([t, u * 2], 1), x, x[:, :2]),
        "stack": (lambda t: torch.stack([t, -t], 2), x),
        "split": (lambda t: t.split([1, 3], 1), x),
        "chunk": (lambda t: t.chunk(2, 2), x),
        "unbind": (lambda t: t.unbind(1), x),
        "narrow": (lambda t: torch.narrow(t, 1, 1, 2), x),
        "flip": (lambda t: t.flip(0, 2), x),
        "repeat": (lambda t: t.repeat(2, 1, 1, 2), x),
        "pad": (lambda t: F.pad(t, (1, 2, 0, 1)), x),
        "pad_value_crop": (lambda t: F.pad(t, (-1, 1), value=3.0), x),
        "pad_circular": (lambda t: F.pad(t, (2, 1), mode="circular"), x),
        "slice_scatter": (lambda t, u: torch.slice_scatter(t, u * 2, dim=1, start=1), x, x[:, :3]),
        "slice_scatter_strided": (lambda t, u: torch.slice_scatter(t, u, dim=1, start=0, end=4, step=2), x, x[:, 1:3]),
        "select_scatter": (lambda t, u: torch.select_scatter(t, u.exp(), 2, -1), x, x[:, :, 0]),
        "index_select": (lambda t, i: t.index_select(1, i), x, idx),
        "index": (lambda t, i: t[:, i], x, idx),
        "gather": (lambda t, i: t.gather(1, i), x, _ints(gen, 4, n, 2, 3)),
        "embedding": (lambda w, i: F.embedding(i, w), x[0], _ints(gen, 4, n, 2)),
        "constants": (lambda t: t + torch.arange(3.0) + torch.ones(3) * torch.full((4, 1), 2.0), x),
        "zeros_like": (lambda t: torch.zeros_like(t) + torch.ones_like(t[0]), x),
    }


def _nn_cases(gen, n):
    img = _randn(gen, n, 4, 6, 6)
    x = _randn(gen, n, 8)
    return {
        "linear": (F.linear, x, _randn(gen, 3, 8), _randn(gen, 3)),
        "matmul": (torch.matmul, _randn(gen, 2, n, 3), _randn(gen, 3, 4)),
        "bmm": (torch.bmm, _randn(gen, 2, n, 3), _randn(gen, 2, 3, 4)),
        "vecmat": (torch.matmul, _randn(gen, 8), _randn(gen, 8, 2)),
        "conv2d": (
            lambda t, w, b: F.conv2d(t, w, b, stride=2, padding=1),
            img,
            _randn(gen, 5, 4, 3, 3),
            _randn(gen, 5),
        ),
        "conv2d_groups": (lambda t, w: F.conv2d(t, w, groups=2, dilation=2), img, _randn(gen, 4, 2, 2, 2)),
        "conv1d": (lambda t, w: F.conv1d(t, w, padding=1), img[:, :, 0], _randn(gen, 3, 4, 3)),
        "max_pool2d": (lambda t: F.max_pool2d(t, 3, 2, padding=1), img),
        "avg_pool2d": (lambda t: F.avg_pool2d(t, 2), img),
        "avg_pool2d_pad": (lambda t: F.avg_pool2d(t, 3, 2, padding=1, count_include_pad=False), img),
        "adaptive_avg_pool2d": (lambda t: F.adaptive_avg_pool2d(t, (1, 3)), img),
        "layer_norm": (lambda t, w, b: F.layer_norm(t, (6,), w, b), img, _positive(gen, 6), _randn(gen, 6)),
        "group_norm": (lambda t, w, b: F.group_norm(t, 2, w, b), img, _positive(gen, 4), _randn(gen, 4)),
        "batch_norm_eval": (
            lambda t, w, b: F.batch_norm(t, torch.zeros(4) + 0.1, torch.ones(4) * 2, w, b),
            img,
            _positive(gen, 4),
            _randn(gen, 4),
        ),
        "batch_norm_batch_stats": (
            lambda t: F.batch_norm(t, None, None, training=True),
            img,
        ),
        "dropout_eval": (lambda t: F.dropout(t, 0.5, training=False), x),
        "upsample_nearest": (lambda t: F.interpolate(t, scale_factor=2), img),
        "embedding_padding_idx": (
            lambda w, i: F.embedding(i, w * (torch.arange(6.0) != 1).float().unsqueeze(1), padding_idx=1),
            _randn(gen, 6, 3),
            _ints(gen, 6, n, 4),
        ),
        "einsum": (lambda a, b: torch.einsum("ij,kj->ik", a, b), x, _randn(gen, 3, 8)),
    }


def _loss_cases(gen, n):
    pred, target = _randn(gen, n, 5), _randn(gen, n, 5)
    labels = _ints(gen, 5, n)
    prob = torch.rand(n, 5, generator=gen) * 0.9 + 0.05
    class_weight = _positive(gen, 5)  # a constant of the model: torch has no gradient for loss weights
    return {
        "mse": (F.mse_loss, pred, target),
        "mse_sum": (lambda a, b: F.mse_loss(a, b, reduction="sum"), pred, target),
        "l1_none": (lambda a, b: F.l1_loss(a, b, reduction="none"), pred, target),
        "smooth_l1": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), pred, target),
        "huber": (lambda a, b: F.huber_loss(a, b, delta=0.7), pred, target),
        "nll": (lambda a, y: F.nll_loss(F.log_softmax(a, 1), y), pred, labels),
        "nll_weighted_ignore": (
            lambda a, y: F.nll_loss(F.log_softmax(a, 1), y, weight=class_weight, ignore_index=2),
            pred,
            labels,
        ),
        "nll_2d": (lambda a, y: F.nll_loss(a.view(n, 5, 1, 1), y.view(n, 1, 1), reduction="sum"), pred, labels),
        "cross_entropy": (F.cross_entropy, pred, labels),
        "cross_entropy_smoothing": (
            lambda a, y: F.cross_entropy(a, y, label_smoothing=0.1, reduction="none"),
            pred,
            labels,
        ),
        "cross_entropy_probs": (lambda a, p: F.cross_entropy(a, p.softmax(1)), pred, prob),
        "bce": (F.binary_cross_entropy, prob, (target > 0).float()),
        "bce_logits": (lambda a, b: F.binary_cross_entropy_with_logits(a, b, pos_weight=class_weight), pred, prob),
        "kl_div": (lambda a, b: F.kl_div(F.log_softmax(a, 1), b, reduction="batchmean"), pred, prob),
        "kl_div_log_target": (lambda a, b: F.kl_div(a, b.log(), reduction="sum", log_target=True), pred, prob),
        "identity_loss_mean": (lambda a: losses.identity_loss(a * a, "mean"), pred),
        "identity_loss_sum": (lambda a: losses.identity_loss(a, "sum"), pred),
        "identity_loss_none": (lambda a: losses.identity_loss(a, "none"), pred),
        "ipu_print_tensor": (lambda a: losses.ipu_print_tensor(a, "x") * 2, pred),
    }


FAMILIES = {
    "unary": _unary_cases,
    "binary": _binary_cases,
    "reduction": _reduction_cases,
    "movement": _movement_cases,
    "nn": _nn_cases,
    "loss": _loss_cases,
}


class OpModule(torch.nn.Module):
    """One op as a module: ``forward(*inputs) = fn(*inputs)``."""

    def __init__(self, name, fn):
        super().__init__()
        self.name, self.fn = name, fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class Bundle(torch.nn.Module):
    """Several op cases in one module: forward takes every case's inputs in order, returns every output."""

    def __init__(self, cases):
        super().__init__()
        self.cases = cases
        self.no_grad_inputs, offset = set(), 0
        for _, module, inputs in cases:
            self.no_grad_inputs |= {offset + k for k in getattr(module, "no_grad_inputs", ())}
            offset += len(inputs)

    def forward(self, *flat):
        outs, i = [], 0
        for _, module, inputs in self.cases:
            outs.append(module(*flat[i : i + len(inputs)]))
            i += len(inputs)
        return tuple(outs)


def op_cases(seed, size, family=None):
    """Yield ``(name, module, inputs)`` for every op case (of one ``family``), with values from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for fam, make in FAMILIES.items():
        if family in (None, fam):
            for name, (fn, *inputs) in make(gen, size).items():
                yield f"{fam}.{name}", OpModule(name, fn), inputs


def run_captured(module, inputs):
    """Capture ``module`` on ``inputs`` and run it in the popir interpreter: (Captured, flat outputs, feeds)."""
    cap = capture(module, inputs)
    feeds = {name: t.detach().numpy() for name, t in zip(cap.input_names, inputs)}
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    for v in cap.graph.inputs:
        if v.name in state:
            feeds[v.name] = state[v.name].detach().numpy()
        elif v.name == RNG_SEED:
            feeds[v.name] = np.array([7, 11], dtype=np.int32)
    outs = popir.interpreter.run(cap.graph, feeds)
    return cap, [outs[name] for name in cap.outputs], feeds


def _assert_close(actual, expected, what):
    expected = expected.detach()
    if expected.dtype == torch.int64:
        expected = expected.to(torch.int32)
    if expected.dtype == torch.float64:
        expected = expected.float()
    np.testing.assert_allclose(actual, expected.numpy(), rtol=RTOL, atol=ATOL, err_msg=what)


def check_against_torch(module, inputs, label, backward=True):
    """Captured outputs vs eager torch; with ``backward``, popir.autodiff of sum(output * cotangent) over
    the float outputs vs torch autograd, for every float input. One capture serves both."""
    frozen = getattr(module, "no_grad_inputs", set())
    leaves = [
        t.detach().clone().requires_grad_(backward and t.is_floating_point() and i not in frozen)
        for i, t in enumerate(inputs)
    ]
    cap, outs, feeds = run_captured(module, leaves)
    flat = torch.utils._pytree.tree_leaves(module(*leaves))
    assert len(outs) == len(flat)
    for i, (got, want) in enumerate(zip(outs, flat)):
        _assert_close(got, want, f"{label} output {i}")
    if backward:
        _check_gradients(cap, feeds, leaves, flat, label)
    return cap


def _check_gradients(cap, feeds, leaves, flat, label):
    graph = cap.graph
    gen = torch.Generator().manual_seed(0)
    total, objective = None, 0
    for name, out in zip(cap.outputs, flat):
        if not (out.is_floating_point() and out.requires_grad):
            continue
        ct = torch.randn(out.shape, generator=gen).to(out.dtype)  # a half output gets a half cotangent
        objective = objective + (out * ct).sum().float()
        term = popir.ops.reduce_sum(graph.outputs[name] * graph.constant(ct.numpy()), axes=None, keepdims=False)
        term = popir.ops.cast(term, dtype="float32")  # half and float outputs add up in float
        total = term if total is None else total + term
    wrt = [(graph.input(n), t) for n, t in zip(cap.input_names, leaves) if t.requires_grad]
    if total is None or not wrt:
        return
    expected = torch.autograd.grad(objective, [t for _, t in wrt], allow_unused=True)
    grads = popir.autodiff.grad(graph, total, [v for v, _ in wrt])
    for i, g in enumerate(grads):
        graph.output(f"grad_{i}", g)
    result = popir.interpreter.run(graph, feeds)
    for i, want in enumerate(expected):
        want = torch.zeros_like(wrt[i][1]) if want is None else want
        _assert_close(result[f"grad_{i}"], want, f"{label} gradient of input {i}")


@pytest.mark.parametrize("family", list(FAMILIES))
# Each example is one torch.export of a whole family (seconds): 1 example per family in CI (4 locally), no shrinking.
@settings(
    max_examples=max(1, settings.default.max_examples // 25), phases=(Phase.explicit, Phase.reuse, Phase.generate)
)
@given(seed=st.integers(0, 2**16), size=st.integers(2, 4))
def test_family_forward_and_backward_match_torch(family, seed, size):
    cases = list(op_cases(seed, size, family))
    flat_inputs = [t for _, _, inputs in cases for t in inputs]
    check_against_torch(Bundle(cases), flat_inputs, family)


def test_op_cases_are_named_modules_with_inputs():
    cases = list(op_cases(0, 2))
    assert len({name for name, _, _ in cases}) == len(cases) > 100
    name, module, inputs = cases[0]
    assert isinstance(module, torch.nn.Module) and all(isinstance(t, torch.Tensor) for t in inputs)
    assert math.isfinite(float(torch.as_tensor(module(*inputs)).float().sum()))


@pytest.mark.parametrize("name", ["unary.gelu", "nn.conv2d", "loss.cross_entropy", "movement.index"])
def test_single_op_case_captures_alone(name):
    module, inputs = next((m, i) for n, m, i in op_cases(3, 3) if n == name)
    check_against_torch(module, inputs, name)


# -- the popir op database: every entry that names a torch equivalent -------------------------------------

# torch's ctc_loss backward returns the gradient through a log_softmax of its input (exp(log_probs) minus the
# posteriors), not d loss / d log_probs; popir's is the latter (finite differences check it), and both agree
# once a log_softmax precedes the loss, as test_added_ops checks through the simulator.
TORCH_GRADIENT_IS_NOT_THE_DERIVATIVE = {"ctc_loss"}

# Gradient primitives (torch.nn.grad.*) are never captured: popir autodiff builds backward passes itself.
_OPDB_SKIPPED_TORCH = ("torch.nn.grad.",)


def _torch_function(dotted):
    obj = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _to_torch(value):
    if isinstance(value, np.ndarray):
        # np.array, not np.ascontiguousarray: the latter turns a rank-0 sample into shape (1,).
        tensor = torch.from_numpy(np.array(value, order="C"))
        return tensor.long() if tensor.dtype == torch.int32 else tensor
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return value


def opdb_cases(draw):
    """``(name, module, inputs)`` for every OPDB entry with a torch equivalent, one drawn sample each."""
    from opdb import OPDB

    for name, entry in OPDB.items():
        if entry.torch is None or entry.torch.startswith(_OPDB_SKIPPED_TORCH):
            continue
        sample = draw(entry.samples())
        differentiable = {id(sample.inputs[name]) for name in entry.grad if name in sample.inputs}
        if name in TORCH_GRADIENT_IS_NOT_THE_DERIVATIVE:
            differentiable = set()
        target = sample.inputs.get("target")
        if "weight" in sample.inputs and target is not None and not np.issubdtype(target.dtype, np.floating):
            # torch's class-index losses (nll_loss2d) refuse gradients for class weights; popir has them.
            differentiable.discard(id(sample.inputs["weight"]))
        raw, spec = torch.utils._pytree.tree_flatten(entry.torch_call(sample))
        leaves = [_to_torch(leaf) for leaf in raw]
        slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        module = OpModule(name, _OpdbCall(_torch_function(entry.torch), leaves, spec, slots))
        # Inputs torch cannot differentiate (running stats, loss weights) are not checked for gradients.
        module.no_grad_inputs = {k for k, i in enumerate(slots) if id(raw[i]) not in differentiable}
        yield f"opdb.{name}", module, [leaves[i] for i in slots]


class _OpdbCall:
    """Calls ``fn(*args, **kwargs)`` with the tensors of a sample replaced by the module's inputs."""

    def __init__(self, fn, leaves, spec, slots):
        self.fn, self.leaves, self.spec, self.slots = fn, leaves, spec, slots

    def __call__(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = torch.utils._pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


# Each example captures one bundle of every entry (~35 s, nearly all torch.export and its decompositions):
# three examples in every profile, so CI sees several samples per entry through the capture path too.
_OPDB_BUNDLE_EXAMPLES = 3


@settings(max_examples=_OPDB_BUNDLE_EXAMPLES, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_opdb_entries_match_torch(data):
    cases = list(opdb_cases(data.draw))
    flat_inputs = [t for _, _, inputs in cases for t in inputs]
    try:
        check_against_torch(Bundle(cases), flat_inputs, "opdb")
    except Exception as bundle_exc:
        failing = []
        for name, module, inputs in cases:
            try:
                check_against_torch(module, inputs, name)
            except Exception as exc:
                failing.append(f"{name}: {str(exc).strip()[:2000]}")
        if not failing:
            raise AssertionError(f"the bundle of all opdb entries differs from torch: {bundle_exc}") from bundle_exc
        raise AssertionError("opdb entries that differ from torch:\n" + "\n".join(failing)) from None
