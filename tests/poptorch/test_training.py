"""Training through trainingModel matches eager PyTorch step for step (hypothesis: random small models)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poptorch

# Adaptive optimizers divide by sqrt(v) + eps, so their first step is about lr * sign(g): an element whose
# gradient nearly cancels (g ~ eps, e.g. weight decay against the loss gradient) turns float rounding noise
# into a step difference of order lr. A larger eps keeps that division well conditioned for the comparison.
_EPS = 1e-4
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01, eps=_EPS),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, eps=_EPS),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, eps=_EPS),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(
        p, lr=0.01, momentum=0.5, centered=True, weight_decay=0.01, eps=_EPS
    ),
}


class MLP(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        layers = [torch.nn.Linear(6, width), torch.nn.Tanh()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 3))
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)

    @staticmethod
    def data(batch):
        return torch.randn(batch, 6), torch.randint(0, 3, (batch,))


class CNN(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, width, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(width * 4 * 4, 3)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))
        return out, self.loss(out, y)

    @staticmethod
    def data(batch):
        return torch.randn(batch, 2, 8, 8), torch.randn(batch, 3)


class Transformer(torch.nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        # No biases: the key bias has a zero true gradient, whose rounding noise adaptive optimizers amplify.
        self.layer = torch.nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=width, dropout=0.0, batch_first=True, bias=False
        )

    def forward(self, x, y):
        out = self.layer(x)
        return out, poptorch.identity_loss(((out - y) ** 2).mean(), "none")

    @staticmethod
    def data(batch):
        return torch.randn(batch, 4, 8), torch.randn(batch, 4, 8)


MODELS = {"mlp": MLP, "cnn": CNN, "transformer": Transformer}


def _compare(model_cls, optimizer, width, depth, steps, batch, seed):
    torch.manual_seed(seed)
    model = model_cls(width, depth)
    reference = copy.deepcopy(model)
    x, y = model_cls.data(batch)
    make = OPTIMIZERS[optimizer]
    opts = poptorch.Options().showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, make(model.parameters()))
    cpu_optimizer = make(reference.parameters())
    for _ in range(steps):
        _, loss = training(x, y)
        cpu_optimizer.zero_grad()
        _, cpu_loss = reference(x, y)
        cpu_loss.backward()
        cpu_optimizer.step()
        torch.testing.assert_close(loss, cpu_loss.detach(), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    training.destroy()


@pytest.mark.parametrize(
    ("model", "optimizer"),
    [("mlp", "sgd_momentum"), ("mlp", "adam"), ("mlp", "rmsprop_centered"), ("transformer", "adamw")],
)
def test_ten_steps_match_eager(model, optimizer):
    _compare(MODELS[model], optimizer, width=8, depth=2, steps=10, batch=4, seed=0)


@settings(max_examples=4)
@given(
    model=st.sampled_from(sorted(MODELS)),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    width=st.integers(2, 12),
    depth=st.integers(1, 3),
    batch=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_one_step_matches_eager_for_random_models(model, optimizer, width, depth, batch, seed):
    _compare(MODELS[model], optimizer, width, depth, steps=1, batch=batch, seed=seed)


def test_missing_and_multiple_losses():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class TwoLosses(NoLoss):
        def forward(self, x):
            out = self.fc(x)
            return poptorch.identity_loss(out.sum(), "none"), poptorch.identity_loss(out.mean(), "none")

    opts = poptorch.Options().showCompilationProgressBar(False)
    with pytest.raises(poptorch.Error, match="^Couldn't find a loss in graph!$"):
        poptorch.trainingModel(NoLoss(), opts)(torch.ones(2, 2))
    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph. Graph must have one final"):
        poptorch.trainingModel(TwoLosses(), opts)(torch.ones(2, 2))


def test_frozen_parameters_do_not_change():
    torch.manual_seed(0)
    model = MLP(4, 1)
    model.net[0].weight.requires_grad_(False)
    before = model.net[0].weight.clone()
    training = poptorch.trainingModel(model, poptorch.Options().showCompilationProgressBar(False))
    training(*MLP.data(4))
    assert torch.equal(model.net[0].weight, before)
    assert not torch.equal(model.net[2].weight, model.net[2].weight.detach() * 0)


def test_dropout_draws_new_masks_each_step():
    class Drop(torch.nn.Module):
        def forward(self, x):
            out = torch.nn.functional.dropout(x, 0.5, training=self.training)
            return out, poptorch.identity_loss(out.sum(), "none")

    model = Drop()
    model.dummy = torch.nn.Parameter(torch.zeros(()))
    training = poptorch.trainingModel(model, poptorch.Options().randomSeed(3).showCompilationProgressBar(False))
    x = torch.ones(64)
    first, _ = training(x)
    second, _ = training(x)
    assert set(first.unique().tolist()) <= {0.0, 2.0}
    assert not torch.equal(first, second)


def test_half_precision_step_within_half_tolerance():
    torch.manual_seed(0)

    class HalfMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).half()

        def forward(self, x):
            return poptorch.identity_loss(self.net(x).float().pow(2).mean(), "none")

    model = HalfMLP()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 4).half()
    opts = poptorch.Options().showCompilationProgressBar(False)
    loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x)
    cpu_loss = reference(x)
    cpu_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, cpu_loss.detach(), rtol=1e-3, atol=1e-3)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


class DetachedTarget(torch.nn.Module):
    """Regresses onto a target built from its own detached output: eager torch sends no gradient through it."""

    def __init__(self, width, depth):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))

    def forward(self, x, y):
        out = self.net(x)
        target = y + 0.5 * (out.detach() - out.detach().mean())
        return out, torch.nn.functional.mse_loss(out, target)

    @staticmethod
    def data(batch):
        return torch.randn(batch, 6), torch.randn(batch, 3)


def test_detach_cuts_gradients_like_eager():
    _compare(DetachedTarget, "sgd", width=8, depth=1, steps=2, batch=4, seed=0)


class NoGradFeatures(torch.nn.Module):
    """A frozen-by-no_grad feature layer whose result is both returned and trained on: eager torch gives the
    feature layer no gradient, so it must not move."""

    def __init__(self, width, depth):
        super().__init__()
        self.features = torch.nn.Linear(6, width)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x, y):
        with torch.no_grad():
            h = torch.tanh(self.features(x))
        return h, torch.nn.functional.mse_loss(self.head(h), y)

    @staticmethod
    def data(batch):
        return torch.randn(batch, 6), torch.randn(batch, 3)


def test_no_grad_block_in_forward_stops_gradients_like_eager():
    # With weight decay and momentum: torch's optimizer skips a parameter whose .grad is None entirely.
    _compare(NoGradFeatures, "sgd_momentum", width=5, depth=1, steps=2, batch=4, seed=0)


class LargeEmbedding(torch.nn.Module):
    """An embedding table of 640 KB, more than one tile's memory: its lookup and gradient are sliced."""

    def __init__(self, width, depth):
        super().__init__()
        self.emb = torch.nn.Embedding(5000, 32)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, ids, y):
        out = self.head(self.emb(ids).mean(1))
        return out, torch.nn.functional.cross_entropy(out, y)

    @staticmethod
    def data(batch):
        return torch.randint(0, 5000, (batch, 6)), torch.randint(0, 3, (batch,))


def test_embedding_larger_than_a_tile_trains_like_eager():
    _compare(LargeEmbedding, "sgd_momentum", width=0, depth=0, steps=3, batch=8, seed=0)
