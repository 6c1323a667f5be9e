"""A forward pass that writes a parameter in place (weight clipping inside ``forward``): eager trains from the
written value, which the IPU model's update cannot combine with the write, so training such a parameter is
refused by name and line; a frozen parameter written in forward still trains the rest as eager does."""

import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch

LR = 0.05


class ClippedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clipped = torch.nn.Linear(6, 8)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x, labels):
        with torch.no_grad():
            self.clipped.weight.clamp_(-0.2, 0.2)  # line: the write
        logits = self.fc(torch.tanh(self.clipped(x)))
        return logits, F.cross_entropy(logits, labels)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=g), torch.tensor([0, 2, 1, 0])


def test_training_a_parameter_written_in_forward_is_refused():
    torch.manual_seed(0)
    model = ClippedNet()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    try:
        with pytest.raises(poptorch.Error, match="writes the trained parameter clipped.weight in place") as info:
            training(*_data())
    finally:
        training.destroy()
    assert "# line: the write" in str(info.value)


def test_a_frozen_parameter_written_in_forward_trains_the_rest_as_eager():
    torch.manual_seed(0)
    model = ClippedNet()
    model.clipped.weight.requires_grad_(False)
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=LR)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    try:
        for _ in range(2):
            _, loss = training(*_data())
            eager_optimizer.zero_grad()
            _, expected = eager(*_data())
            expected.backward()
            eager_optimizer.step()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        training.copyWeightsToHost()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        training.destroy()
