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


# -- losses ------------------------------------------------------------------------------------------------
def _signs(*shape):
    return torch.randint(0, 2, shape) * 2 - 1


LOSSES = {
    "poisson_nll": (torch.nn.PoissonNLLLoss(), lambda out: (torch.rand(out.shape) * 3,)),
    "poisson_nll_full": (
        torch.nn.PoissonNLLLoss(log_input=False, full=True),
        lambda out: (torch.rand(out.shape) * 3,),
    ),
    "hinge_embedding": (torch.nn.HingeEmbeddingLoss(margin=0.5), lambda out: (_signs(*out.shape).float(),)),
    "soft_margin": (torch.nn.SoftMarginLoss(reduction="sum"), lambda out: (_signs(*out.shape).float(),)),
    "cosine_embedding": (
        torch.nn.CosineEmbeddingLoss(margin=0.1),
        lambda out: (torch.randn(out.shape), _signs(out.shape[0])),
    ),
    "margin_ranking": (
        torch.nn.MarginRankingLoss(margin=0.2),
        lambda out: (torch.randn(out.shape), _signs(*out.shape).float()),
    ),
    "triplet_margin": (
        torch.nn.TripletMarginLoss(margin=2.0, swap=True),
        lambda out: (torch.randn(out.shape), torch.randn(out.shape)),
    ),
}


class _LossModel(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.loss = loss

    def forward(self, x, *targets):
        out = self.fc(x)
        if isinstance(self.loss, torch.nn.PoissonNLLLoss) and not self.loss.log_input:
            out = out.exp()
        return self.loss(out, *targets)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_torch_losses_are_recognised_and_train_as_eager(name):
    torch.manual_seed(0)
    loss, make_targets = LOSSES[name]
    model = _LossModel(loss)
    eager = copy.deepcopy(model)
    x = torch.randn(5, 3)
    targets = make_targets(torch.empty(5, 4))
    training = poptorch.trainingModel(model, _options(), torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        device_loss = training(x, *targets)
        optimizer.zero_grad()
        eager_loss = eager(x, *targets)
        eager_loss.backward()
        optimizer.step()
        torch.testing.assert_close(device_loss, eager_loss.detach(), rtol=1e-5, atol=1e-5)
    training.copyWeightsToHost()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    training.destroy()


def test_a_non_scalar_loss_is_refused_as_eager_refuses_its_backward():
    model = _LossModel(torch.nn.MSELoss(reduction="none"))
    x, y = torch.randn(2, 3), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        model(x, y).backward()
    with pytest.raises(poptorch.Error, match=r"The final loss must be a scalar, got shape \[2, 4\].*reduction="):
        poptorch.trainingModel(model, _options())(x, y)


class _CustomLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, target):
        out = self.fc(x)
        inner = poptorch.identity_loss(out - target, reduction="none")
        return out, poptorch.identity_loss(inner**2 * 5, reduction="mean")


def test_identity_loss_none_inside_a_custom_loss_trains_to_the_target_as_eager():
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    target = x @ torch.randn(3, 2) + 0.5  # reachable exactly by the linear layer
    model = _CustomLoss()
    eager = copy.deepcopy(model)
    steps_per_call, calls, lr = 25, 8, 0.02
    options = _options().deviceIterations(steps_per_call)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=lr))
    optimizer = torch.optim.SGD(eager.parameters(), lr=lr)
    for _ in range(calls):
        # Each call runs steps_per_call SGD steps and returns the last step's loss (OutputMode.Final).
        _, last_loss = training(x.repeat(steps_per_call, 1), target.repeat(steps_per_call, 1))
        for _ in range(steps_per_call):
            optimizer.zero_grad()
            _, eager_loss = eager(x, target)
            eager_loss.backward()
            optimizer.step()
        torch.testing.assert_close(last_loss, eager_loss.detach(), rtol=1e-4, atol=1e-6)
    # Both converge: the loss fell by orders of magnitude and the prediction reaches the target.
    assert eager_loss.item() < 1e-3
    out, _ = training(x.repeat(steps_per_call, 1), target.repeat(steps_per_call, 1))
    torch.testing.assert_close(out, target, atol=2e-2, rtol=0)


# -- shapes --------------------------------------------------------------------------------------------------
class _Reductions(torch.nn.Module):
    def forward(self, x, y):
        return x.sum(), torch.linalg.norm(x), F.mse_loss(x, y), x.mean(0)


def test_zero_dim_results_keep_shape_of_eager_through_inference_model():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    eager = _Reductions()(x, y)
    device = poptorch.inferenceModel(_Reductions(), _options())(x, y)
    for d, e in zip(device, eager):
        assert d.shape == e.shape
        torch.testing.assert_close(d, e, rtol=1e-5, atol=1e-6)


def test_zero_dim_results_of_several_iterations_stack():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    total, *_ = poptorch.inferenceModel(_Reductions(), _options().deviceIterations(2))(x, y)
    torch.testing.assert_close(total, torch.stack([x[:3].sum(), x[3:].sum()]))


# -- integers ------------------------------------------------------------------------------------------------
class _AddOne(torch.nn.Module):
    def forward(self, k):
        return k + 1


def test_int64_values_beyond_int32_are_an_error_naming_the_input():
    big = torch.tensor([2**40, 3])
    assert _AddOne()(big)[0] == 2**40 + 1
    model = poptorch.inferenceModel(_AddOne(), _options())
    with pytest.raises(poptorch.Error, match=r"Input k holds the value 1099511627776, which does not fit .*32-bit"):
        model(big)
    assert model(torch.tensor([2**31 - 2, -(2**31)])).tolist() == [2**31 - 1, -(2**31) + 1]


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 2)

    def forward(self, ids):
        return self.emb(ids)


@pytest.mark.parametrize("bad", [-1, 5, 2**32 + 1])
def test_embedding_index_out_of_range_is_an_error_as_in_eager(bad):
    ids = torch.tensor([0, bad, 2])
    with pytest.raises(IndexError):
        _Embed()(ids)
    model = poptorch.inferenceModel(_Embed(), _options())
    with pytest.raises(poptorch.Error, match=rf"Input ids holds the (index|value) {bad}"):
        model(ids)
    assert model(torch.tensor([4, 0, 1])).shape == (3, 2)


class _Classifier(torch.nn.Module):
    def __init__(self, ignore_index=-100):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.loss = torch.nn.CrossEntropyLoss(ignore_index=ignore_index)

    def forward(self, x, labels):
        return self.loss(self.fc(x), labels)


def test_class_label_out_of_range_is_an_error_as_in_eager():
    x, labels = torch.randn(3, 3), torch.tensor([1, -1, 0])
    with pytest.raises(IndexError):
        _Classifier()(x, labels)
    model = poptorch.trainingModel(_Classifier(), _options())
    with pytest.raises(poptorch.Error, match=r"Input labels holds the index -1, out of range for class labels of 4"):
        model(x, labels)
    # ignore_index is a valid label.
    eager = _Classifier(ignore_index=-1)
    device = poptorch.inferenceModel(copy.deepcopy(eager), _options())
    torch.testing.assert_close(device(x, labels), eager(x, labels).detach())


class _Select(torch.nn.Module):
    def forward(self, x, index):
        return x.index_select(0, index), x[index]


def test_index_select_refuses_negative_indices_where_plain_indexing_wraps_them():
    x = torch.randn(4, 2)
    model = poptorch.inferenceModel(_Select(), _options())
    with pytest.raises(poptorch.Error, match="index -1, out of range for index_select"):
        model(x, torch.tensor([-1, 2]))
    model.destroy()
    plain = poptorch.inferenceModel(_module(lambda x, i: x[i]), _options())
    torch.testing.assert_close(plain(x, torch.tensor([-1, 2])), x[torch.tensor([-1, 2])])
    with pytest.raises(poptorch.Error, match="index -5, out of range for indexing"):
        plain(x, torch.tensor([-5, 2]))


def _module(fn):
    class Module(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    return Module()


def test_rank_zero_inputs_stay_rank_zero():
    model = _module(lambda s, v: (s * v + 1.0, torch.exp(s)))
    s, v = torch.tensor(0.5), torch.randn(3)
    scaled, e = poptorch.inferenceModel(model, _options())(s, v)
    assert scaled.shape == (3,) and e.shape == ()
    torch.testing.assert_close(e, torch.exp(s))


# Indices computed on the device (so no host check sees them) and out of range: the device counts them and
# the error names the op, its source line and the input the indices derive from.
DEVICE_INDEX_CASES = {
    "index_select": lambda x, i: x.index_select(0, i * 3 + 2),
    "bincount": lambda x, i: torch.bincount(i + 4, minlength=6).float(),
    "index_fill": lambda x, i: x.index_fill(0, i + 3, 1.0),
    "scatter_reduce": lambda x, i: x.scatter_reduce(0, (i + 3).unsqueeze(1).expand(3, 3), x[:3], "amax"),
    "index_reduce": lambda x, i: x.index_reduce(0, i + 3, x[:3], "prod"),
}


class _IndexedBy(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, i):
        return self.fn(x, i)


@pytest.mark.parametrize("name", sorted(DEVICE_INDEX_CASES))
def test_an_index_computed_on_the_device_out_of_range_is_an_error_naming_the_op(name):
    model = poptorch.inferenceModel(_IndexedBy(DEVICE_INDEX_CASES[name]), _options())
    x, i = torch.randn(5, 3), torch.tensor([0, 1, 2])
    with pytest.raises(poptorch.Error, match=r"index\(es\) out of range") as caught:
        model(x, i)
    message = str(caught.value)
    assert "test_ops_safety.py" in message and "the indices derive from input i" in message, message
    # In range, the same model matches eager.
    torch.testing.assert_close(model(x, torch.tensor([0, 0, 1]) * 0), DEVICE_INDEX_CASES[name](x, i * 0))


class _Assign(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 2))

    def forward(self, i, v):
        y = self.w * 1.0
        y[i] = v * self.w[: len(v)]
        return y, poptorch.identity_loss((y * y).sum(), "sum")


def test_duplicate_indices_writing_different_values_are_refused_not_averaged():
    eager = _Assign()
    model = poptorch.inferenceModel(copy.deepcopy(eager), _options())
    unique, same = torch.tensor([0, 2]), torch.tensor([1, 1])
    v = torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    for i, values in ((unique, v), (same, torch.full((2, 2), 3.0))):
        torch.testing.assert_close(model(i, values), tuple(t.detach() for t in eager(i, values)))
    with pytest.raises(poptorch.Error, match="wrote different values to one position through duplicate") as caught:
        model(same, v)
    assert caught.value.location.startswith(__file__) and caught.value.type == "device_check"
    # The check runs in training programs too, and does not disturb a step with unique indices.
    trained = copy.deepcopy(eager)
    training = poptorch.trainingModel(trained, _options(), torch.optim.SGD(trained.parameters(), lr=0.1))
    _, loss = training(unique, v)
    torch.testing.assert_close(loss, eager(unique, v)[1].detach())
    with pytest.raises(poptorch.Error, match="duplicate indices"):
        training(same, v)
