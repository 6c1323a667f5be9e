"""Each opdb entry's popir op itself (primitive or composite, run by the popir interpreter) against the torch
function it names: forward, and the gradient of every differentiable input, over several drawn samples each.
This checks popir's own recipes, which the capture path may not reach (test_ops_vs_torch captures the torch
call). The activations are also checked where a select masks an overflowing branch (|x| up to 100)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opdb import OPDB, Sample
from test_ops_vs_torch import _OPDB_SKIPPED_TORCH, TORCH_GRADIENT_IS_NOT_THE_DERIVATIVE, _to_torch, _torch_function

import popir
from popir import ops

WITH_TORCH = sorted(n for n, e in OPDB.items() if e.torch and not e.torch.startswith(_OPDB_SKIPPED_TORCH))
_GRADIENT_WEIGHTS_SEED = 3


def _torch_outputs(entry, sample, requires):
    raw, spec = torch.utils._pytree.tree_flatten(entry.torch_call(sample))
    leaves = [_to_torch(leaf) for leaf in raw]
    for i, leaf in enumerate(raw):
        if isinstance(leaf, np.ndarray) and any(leaf is sample.inputs[k] for k in requires):
            leaves[i] = leaves[i].clone().requires_grad_(True)
    args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
    out = _torch_function(entry.torch)(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    tensors = {k: leaves[i] for i, leaf in enumerate(raw) for k in requires if leaf is sample.inputs[k]}
    return outs, tensors


def _check(entry, sample):
    requires = [k for k in entry.grad if k in sample.inputs and sample.inputs[k].dtype.kind == "f"]
    if entry.name in TORCH_GRADIENT_IS_NOT_THE_DERIVATIVE:
        requires = []
    target = sample.inputs.get("target")
    if target is not None and target.dtype.kind != "f" and "weight" in requires:
        requires.remove("weight")  # torch's class-index losses refuse gradients for class weights
    graph, feeds = entry.make_graph(sample)
    outs, tensors = _torch_outputs(entry, sample, requires)
    expected = outs[0]
    weights = None
    if requires and expected.dtype.is_floating_point:
        rng = np.random.default_rng(_GRADIENT_WEIGHTS_SEED)
        weights = rng.uniform(-1, 1, tuple(expected.shape)).astype(np.float32)
        out0 = graph.outputs["out0"]
        loss = ops.reduce_sum(out0 * graph.constant(weights.astype(out0.dtype.numpy)), axes=None, keepdims=False)
        for name, grad in zip(requires, popir.autodiff.grad(graph, loss, [graph.input(k) for k in requires])):
            if grad is not None:
                graph.output(f"grad_{name}", grad)
    with np.errstate(all="ignore"):
        got = popir.interpreter.run(graph, feeds)
    tol = {"rtol": max(entry.rtol, 1e-5), "atol": max(entry.atol, 1e-5)}
    for i, o in enumerate(outs[: len([k for k in got if k.startswith("out")])]):
        want = o.detach().numpy()
        np.testing.assert_allclose(got[f"out{i}"].astype(want.dtype), want, equal_nan=True, **tol, err_msg=entry.name)
    if weights is not None:
        (expected * torch.from_numpy(weights).to(expected.dtype)).sum().backward()
        for name in requires:
            if f"grad_{name}" in got and tensors[name].grad is not None:
                np.testing.assert_allclose(
                    got[f"grad_{name}"],
                    tensors[name].grad.numpy(),
                    equal_nan=True,
                    **tol,
                    err_msg=f"{entry.name} {name}",
                )


@pytest.mark.parametrize("name", WITH_TORCH)
@settings(max_examples=3)
@given(data=st.data())
def test_popir_op_matches_its_torch_function(name, data):
    entry = OPDB[name]
    _check(entry, data.draw(entry.samples()))


OVERFLOWING = ["elu", "selu", "celu", "softplus", "mish", "logsigmoid", "silu", "gelu", "softsign", "hardswish"]


@pytest.mark.parametrize("name", [n for n in OVERFLOWING if n in OPDB])
def test_activations_match_torch_where_a_branch_overflows(name):
    x = np.array([-100.0, -30.0, -1.0, 0.5, 12.0, 30.0, 100.0], np.float32)
    entry = OPDB[name]
    attrs = {"beta": 1.0, "threshold": 20.0} if name == "softplus" else {}
    _check(entry, Sample({"x": x}, attrs))
