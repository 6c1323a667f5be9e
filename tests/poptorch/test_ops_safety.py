"""Numerical safety against eager: gradients of activations whose masked-out branch overflows, NaN through
ReLU, 0-d results, loss detection and integer ranges. Each case is one small model through the simulator."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import popir
import poptorch
from popir import ops


def _options():
    return poptorch.Options().showCompilationProgressBar(False)


class _Activation(torch.nn.Module):
    def __init__(self, fn, values, dtype=torch.float32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values, dtype=dtype))
        self.fn = fn

    def forward(self):
        return poptorch.identity_loss(self.fn(self.w).float(), "sum")


def _device_grad(model):
    """The gradient the device applied: one SGD step with lr=1 moves each weight by minus its gradient."""
    before = model.w.detach().clone()
    training = poptorch.trainingModel(model, _options(), torch.optim.SGD(model.parameters(), lr=1.0))
    training()
    training.copyWeightsToHost()
    training.destroy()
    return (before - model.w.detach()).float()


ACTIVATIONS = {
    "elu": F.elu,
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.5),
    "softplus": F.softplus,
    "softplus_beta": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "mish": F.mish,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_gradients_stay_finite_where_a_branch_overflows(name):
    values = [100.0, 30.0, 1.0, -3.0, -100.0]
    model = _Activation(ACTIVATIONS[name], values)
    eager = copy.deepcopy(model)
    eager().backward()
    grad = _device_grad(model)
    assert torch.isfinite(grad).all(), grad
    torch.testing.assert_close(grad, eager.w.grad, rtol=1e-5, atol=1e-6)


def test_elu_gradient_in_float16_at_12():
    values = [12.0, 1.0, -2.0]
    eager = _Activation(F.elu, values, torch.float16)
    eager().backward()
    grad = _device_grad(_Activation(F.elu, values, torch.float16))
    torch.testing.assert_close(grad, eager.w.grad.float(), rtol=1e-3, atol=1e-3)


def test_relu_passes_the_gradient_at_nan_as_eager():
    g = popir.Graph("relu_nan")
    x = g.add_input("x", (3,), "float32")
    (grad,) = popir.autodiff.grad(g, ops.reduce_sum(ops.relu(x), axes=None, keepdims=False), [x])
    g.output("grad", grad)
    feeds = {"x": np.array([np.nan, 2.0, -1.0], np.float32)}
    eager = torch.tensor(feeds["x"], requires_grad=True)
    F.relu(eager).sum().backward()
    np.testing.assert_array_equal(popir.interpreter.run(g, feeds)["grad"], eager.grad.numpy())
