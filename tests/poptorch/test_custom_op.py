"""poptorch.custom_op with PopTorch's signature runs a popir op the user registered (popir.defop) and
lowered (popsim.register_lowering): its NumPy reference on the CPU, its lowering on the simulated IPU, its
VJP in training; an op nobody registered is a clear error."""

import copy

import numpy as np
import pytest
import torch

import popir
import popsim
import poptorch

OP = "test_custom_scaled_square"  # scale * x * x, with attribute "scale"


def _vjp(inputs, outputs, cotangents, scale):
    (x,), (g,) = inputs, cotangents
    return [g * x * (2.0 * scale)]


def _lower(lw, node, x, scale):
    squares = lw.elementwise("mul", [x, x], x.shape, x.dtype)
    return lw.elementwise("mul", [squares, lw.constant(np.array(scale), x.dtype)], x.shape, x.dtype)


@pytest.fixture(scope="module", autouse=True)
def _registered_op():
    """The user's op, registered for this module's tests only, so suites that walk popir's registry and
    popsim's lowerings in the same session do not see it."""
    popir.defop(OP, infer=lambda x, scale: x, ref=lambda x, scale: (scale * x * x).astype(x.dtype), vjp=_vjp)
    popsim.register_lowering(OP)(_lower)
    yield
    popir.registry._REGISTRY.pop(OP)
    popsim.lowerings.LOWERINGS.pop(OP)


class _Model(torch.nn.Module):
    def __init__(self, name=OP):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.name = name

    def forward(self, x):
        h = self.fc(x)
        (out,) = poptorch.custom_op([h], self.name, "custom.ops", 1, example_outputs=[h], attributes={"scale": 1.5})
        return out, poptorch.identity_loss(out.sum(), "sum")


def _options():
    return poptorch.Options().showCompilationProgressBar(False)


def test_a_registered_custom_op_runs_on_the_cpu_and_on_the_ipu():
    model, x = _Model(), torch.randn(4, 3)
    out, _ = model(x)
    h = model.fc(x).detach()
    torch.testing.assert_close(out, 1.5 * h * h)
    device_out, _ = poptorch.inferenceModel(copy.deepcopy(model), _options())(x)
    torch.testing.assert_close(device_out, out, rtol=1e-5, atol=1e-6)


def test_a_custom_op_trains_through_its_vjp():
    model, x = _Model(), torch.randn(4, 3)
    eager = copy.deepcopy(model.fc)
    training = poptorch.trainingModel(model, _options(), torch.optim.SGD(model.parameters(), lr=0.05))
    training(x)
    training.copyWeightsToHost()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.05)
    (1.5 * eager(x) ** 2).sum().backward()
    optimizer.step()
    torch.testing.assert_close(model.fc.weight, eager.weight, rtol=1e-5, atol=1e-6)


def test_an_unregistered_custom_op_names_the_fix():
    with pytest.raises(poptorch.Error, match=r"no popir op of that name is registered.*popir.defop\('Missing'"):
        _Model("Missing")(torch.randn(4, 3))


def test_attributes_are_checked_as_poptorch_checks_them():
    x = torch.ones(2)
    with pytest.raises(poptorch.Error, match="must all be the same"):
        poptorch.custom_op([x], OP, "custom.ops", 1, [x], attributes={"scale": [1, "a"]})
    with pytest.raises(poptorch.Error, match="keys must be strings"):
        poptorch.custom_op([x], OP, "custom.ops", 1, [x], attributes={1: 2.0})
