"""Every alias of one host tensor is one device variable: tied weights, a submodule used twice, one module
in two wrapped models, a training and an inference wrapper of one model, host-side edits between calls.
Each case is compared with eager PyTorch step by step: losses, every parameter and every buffer."""

import copy

import pytest
import torch

import poptorch

OPTIMIZERS = {
    "sgd_momentum": (
        lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=0.02), lambda p: torch.optim.AdamW(p, lr=0.02)),
}
STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-4}


class TiedLM(torch.nn.Module):
    """An embedding whose weight is also the output head's weight (GPT-2's lm_head = wte)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.head(self.norm(self.emb(x)))
        return out, self.loss(out, y)

    @staticmethod
    def data():
        return torch.randint(0, 10, (6,)), torch.randint(0, 10, (6,))


class SharedBlock(torch.nn.Module):
    """One BatchNorm + Linear block registered under two names and applied twice per forward: its
    parameters and buffers are listed under both names and its statistics are updated twice per step."""

    def __init__(self):
        super().__init__()
        self.encode = torch.nn.Sequential(torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 5))
        self.decode = self.encode
        self.out = torch.nn.Linear(5, 3)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.out(torch.tanh(self.decode(torch.tanh(self.encode(x)))))
        return out, self.loss(out, y)

    @staticmethod
    def data():
        return torch.randn(4, 5), torch.randn(4, 3)


class Head(torch.nn.Module):
    """A user model built around a trunk module it may share with another model."""

    def __init__(self, trunk, classes):
        super().__init__()
        self.trunk = trunk
        self.fc = torch.nn.Linear(5, classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc(torch.relu(self.trunk(x)))
        return out, self.loss(out, y)


def _trunk():
    return torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5))


def _eager_step(model, optimizer, *data):
    optimizer.zero_grad()
    out, loss = model(*data)
    loss.backward()
    optimizer.step()
    return out.detach(), loss.detach()


def _assert_same_state(model, eager):
    """Every parameter and buffer (each alias listed under every name) equals eager's."""
    got, want = model.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _wrap_pair(model, optimizer):
    ipu_opt, eager_opt = OPTIMIZERS[optimizer]
    eager = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=ipu_opt(model.parameters()))
    return training, eager, eager_opt(eager.parameters())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cls", [TiedLM, SharedBlock])
def test_aliased_parameters_train_like_eager(cls, optimizer):
    torch.manual_seed(0)
    model = cls()
    training, eager, eager_opt = _wrap_pair(model, optimizer)
    for _ in range(STEPS):
        data = cls.data()
        _, loss = training(*data)
        _, want = _eager_step(eager, eager_opt, *data)
        torch.testing.assert_close(loss, want, **TOL)
        _assert_same_state(model, eager)
    if cls is TiedLM:
        assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_module_shared_by_two_wrapped_models_stays_coherent(optimizer):
    torch.manual_seed(1)
    trunk = _trunk()
    first, second = Head(trunk, 3), Head(trunk, 2)
    wrapped_first, eager_first, opt_first = _wrap_pair(first, optimizer)
    eager_second = Head(eager_first.trunk, 2)
    eager_second.fc.load_state_dict(second.fc.state_dict())
    wrapped_second = poptorch.trainingModel(second, optimizer=OPTIMIZERS[optimizer][0](second.parameters()))
    opt_second = OPTIMIZERS[optimizer][1](eager_second.parameters())
    for step in range(2 * STEPS):
        x = torch.randn(4, 4)
        if step % 2 == 0:
            y = torch.randint(0, 3, (4,))
            _, loss = wrapped_first(x, y)
            _, want = _eager_step(eager_first, opt_first, x, y)
        else:
            y = torch.randint(0, 2, (4,))
            _, loss = wrapped_second(x, y)
            _, want = _eager_step(eager_second, opt_second, x, y)
        torch.testing.assert_close(loss, want, **TOL)
        _assert_same_state(first, eager_first)
        _assert_same_state(second, eager_second)


class Classifier(torch.nn.Module):
    """The network alone, as PopTorch users wrap it for inference."""

    def __init__(self):
        super().__init__()
        self.trunk = _trunk()
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.trunk(x)))


class WithLoss(torch.nn.Module):
    """The network plus its loss, as PopTorch users wrap it for training."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)


@pytest.mark.parametrize("trained", ["same_model", "loss_wrapper"])
def test_training_and_inference_wrappers_share_weights(trained):
    """trainingModel(WithLoss(net)) and inferenceModel(net), or both wrappers of one model: the inference
    wrapper runs on the weights (and BatchNorm statistics) training has just produced, without the host
    having read them in between."""
    torch.manual_seed(2)
    net = Classifier()
    model = WithLoss(net)
    training, eager, eager_opt = _wrap_pair(model, "sgd_momentum")
    inference = poptorch.inferenceModel(model if trained == "same_model" else net)
    for _ in range(STEPS):
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        _, loss = training(x, y)
        _, want = _eager_step(eager, eager_opt, x, y)
        torch.testing.assert_close(loss, want, **TOL)
        out = inference(x, y)[0] if trained == "same_model" else inference(x)
        eager.eval()
        with torch.no_grad():
            expected = eager.net(x)
        eager.train()
        torch.testing.assert_close(out, expected, **TOL)
    _assert_same_state(model, eager)


def _edit_weight(model):
    with torch.no_grad():
        model.fc.weight.add_(0.5)


def _copy_bias(model):
    with torch.no_grad():
        model.fc.bias.copy_(torch.linspace(-1.0, 1.0, model.fc.bias.numel()))


def _reset_statistics(model):
    with torch.no_grad():
        model.trunk[0].running_var.fill_(2.0)


def _held_reference_edit(model):
    # A reference taken after the host was synced, edited later: the edit reaches the device.
    weight = model.trunk[1].weight
    with torch.no_grad():
        weight.mul_(0.5)


@pytest.mark.parametrize("edit", [_edit_weight, _copy_bias, _reset_statistics, _held_reference_edit])
def test_host_edit_between_calls_is_uploaded(edit):
    torch.manual_seed(3)
    model = Head(_trunk(), 3)
    training, eager, eager_opt = _wrap_pair(model, "adamw")
    for step in range(STEPS):
        if step:
            edit(model)
            edit(eager)
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        _, loss = training(x, y)
        _, want = _eager_step(eager, eager_opt, x, y)
        torch.testing.assert_close(loss, want, **TOL)
    _assert_same_state(model, eager)


def test_host_edit_of_a_stale_reference_warns_and_wins():
    torch.manual_seed(4)
    model = Head(_trunk(), 3)
    training, eager, eager_opt = _wrap_pair(model, "sgd_momentum")
    weight = model.fc.weight
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    training(x, y)
    _eager_step(eager, eager_opt, x, y)
    # Nothing read the host copy since the step, so it is stale; overwriting it is still the user's latest
    # word: it is uploaded (with a warning that the unsynced step of that tensor is discarded).
    for tensor in (weight, eager.fc.weight):
        with torch.no_grad():
            tensor.copy_(torch.full_like(tensor, 0.25))
    with pytest.warns(UserWarning, match="'fc.weight' was modified on the host while the IPU held newer values"):
        _, loss = training(x, y)
    _, want = _eager_step(eager, eager_opt, x, y)
    torch.testing.assert_close(loss, want, **TOL)
    _assert_same_state(model, eager)


def test_optimizer_over_foreign_tensors_is_an_error():
    model = Head(_trunk(), 3)
    stray = torch.nn.Parameter(torch.zeros(3))
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    with pytest.raises(poptorch.Error, match=r"Parameter 6 of the optimizer's parameter group 0 \(shape \[3\]\)"):
        training(torch.randn(4, 4), torch.randint(0, 3, (4,)))


def test_param_group_added_after_wrapping_is_an_error():
    model = Head(_trunk(), 3)
    optimizer = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=optimizer)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    training(x, y)
    optimizer.add_param_group({"params": model.fc.parameters()})
    with pytest.raises(poptorch.Error, match="parameter groups changed after it was given to poptorch"):
        training(x, y)


def test_param_group_added_before_the_first_call_is_picked_up_by_set_optimizer():
    torch.manual_seed(5)
    model = Head(_trunk(), 3)
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, optimizer=optimizer)
    optimizer.add_param_group({"params": model.fc.parameters(), "lr": 0.05})
    training.setOptimizer(optimizer)
    eager_opt = torch.optim.SGD(eager.trunk.parameters(), lr=0.1)
    eager_opt.add_param_group({"params": eager.fc.parameters(), "lr": 0.05})
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    training(x, y)
    _eager_step(eager, eager_opt, x, y)
    _assert_same_state(model, eager)
