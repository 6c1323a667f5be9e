"""Buffers under replication follow PopTorch: broadcastBuffers(True) refuses a model that updates buffers on
replicas; broadcastBuffers(False) gives each replica its own, and the host reads the first replica's."""

import copy

import pytest
import torch

import poptorch


def _opts(replicas):
    return poptorch.Options().replicationFactor(replicas).showCompilationProgressBar(False)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1, 2))

    def forward(self, x):
        self.total.copy_(self.total + x)
        return self.total * 1.0


def test_each_replica_updates_its_own_buffer():
    model = Counter()
    inference = poptorch.inferenceModel(model, _opts(2).broadcastBuffers(False))
    x = torch.tensor([[9.0], [2.0]])
    for _ in range(5):
        out = inference(x)
    # Replica 0 saw 9 five times, replica 1 saw 2 five times (one shared buffer would hold 55).
    torch.testing.assert_close(out, torch.tensor([[45.0, 45.0], [10.0, 10.0]]))
    inference.copyWeightsToHost()
    torch.testing.assert_close(model.total, torch.tensor([[45.0, 45.0]]))


def test_a_host_upload_reaches_every_replica():
    model = Counter()
    inference = poptorch.inferenceModel(model, _opts(2).broadcastBuffers(False))
    x = torch.tensor([[9.0], [2.0]])
    inference(x)
    with torch.no_grad():
        model.total.fill_(100.0)
    torch.testing.assert_close(inference(x), torch.tensor([[109.0, 109.0], [102.0, 102.0]]))


def test_broadcast_buffers_refuses_buffers_updated_on_replicas():
    inference = poptorch.inferenceModel(Counter(), _opts(2))
    with pytest.raises(poptorch.Error, match=r"PopTorch does not support broadcasting buffers.*total"):
        inference(torch.tensor([[9.0], [2.0]]))
    # One replica has nothing to broadcast.
    torch.testing.assert_close(poptorch.inferenceModel(Counter(), _opts(1))(torch.ones(1, 1)), torch.ones(1, 2))


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)


def test_batchnorm_replicas_normalise_their_micro_batch_and_keep_their_statistics():
    torch.manual_seed(0)
    model = Normed()
    reference = copy.deepcopy(model)
    norm = reference.net[1]
    x, y = torch.randn(3, 8, 4), torch.randn(3, 8, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    training = poptorch.trainingModel(
        model, _opts(2).broadcastBuffers(False), torch.optim.SGD(model.parameters(), lr=0.1)
    )
    first_replica = {name: value.clone() for name, value in reference.net[1].named_buffers()}
    for step in range(3):
        _, losses = training(x[step], y[step])
        # Eager: each replica's BatchNorm sees only its micro-batch; the step averages the two losses.
        for name, value in first_replica.items():
            getattr(norm, name).copy_(value)
        optimizer.zero_grad()
        loss0 = reference(x[step, :4], y[step, :4])[1]
        first_replica = {name: value.clone() for name, value in norm.named_buffers()}
        loss1 = reference(x[step, 4:], y[step, 4:])[1]
        ((loss0 + loss1) / 2).backward()
        optimizer.step()
        torch.testing.assert_close(losses, torch.stack([loss0, loss1]).detach(), rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        expected = first_replica[name.split(".")[-1]] if name.startswith("net.1.running") or "batches" in name else None
        if expected is None:
            expected = reference.state_dict()[name]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


def test_copy_weights_to_device_gives_every_replica_the_hosts_buffer():
    model = Counter()
    inference = poptorch.inferenceModel(model, _opts(2).broadcastBuffers(False))
    x = torch.tensor([[9.0], [2.0]])
    inference(x)
    inference.copyWeightsToHost()  # the host holds replica 0's 9
    inference.copyWeightsToDevice()  # as PopTorch, every replica gets it, replica 1's 2 included
    torch.testing.assert_close(inference(x), torch.tensor([[18.0, 18.0], [11.0, 11.0]]))
