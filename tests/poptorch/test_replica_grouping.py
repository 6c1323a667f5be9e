"""Replica grouping: Options.inputReplicaGrouping (replicas of a group share inputs) and the parameters'
replicaGrouping (only PopTorch's default, every replica sharing the parameter, is modelled)."""

import copy

import pytest
import torch

import poptorch


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.w


def _opts(replicas):
    return poptorch.Options().replicationFactor(replicas).showCompilationProgressBar(False)


@pytest.mark.parametrize(
    ("kind", "order"),
    [(poptorch.CommGroupType.Consecutive, [0, 0, 1, 1]), (poptorch.CommGroupType.Orthogonal, [0, 1, 0, 1])],
)
def test_replicas_of_an_input_group_receive_the_same_micro_batch(kind, order):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    model = poptorch.inferenceModel(Scale(), _opts(4).inputReplicaGrouping(2, kind))
    torch.testing.assert_close(model(x), 2 * x[order])


def test_all_gives_every_replica_the_same_inputs():
    x = torch.tensor([[1.0, 2.0]])
    model = poptorch.inferenceModel(Scale(), _opts(3).inputReplicaGrouping(0, poptorch.CommGroupType.All))
    torch.testing.assert_close(model(x), 2 * x[[0, 0, 0]])


def test_training_with_grouped_inputs_matches_eager_on_the_distinct_micro_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    class WithLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, y)

    opts = _opts(4).inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    wrapped = WithLoss(model)
    training = poptorch.trainingModel(wrapped, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, losses = training(x, y)
    # Replicas 0, 1 take samples 0-1 and replicas 2, 3 samples 2-3: the mean gradient is eager's on all 4.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    eager = [torch.nn.functional.mse_loss(reference(x[i : i + 2]), y[i : i + 2]) for i in (0, 2)]
    torch.stack(eager).mean().backward()
    optimizer.step()
    torch.testing.assert_close(losses, torch.stack([eager[0], eager[0], eager[1], eager[1]]).detach())
    for a, b in zip(wrapped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_dataloader_loads_one_micro_batch_per_input_group():
    opts = _opts(4).inputReplicaGrouping(2, poptorch.CommGroupType.Orthogonal)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=3)
    assert loader.combinedBatchSize == 6
    assert [len(batch[0]) for batch in loader] == [6, 6]


def test_input_groups_must_divide_the_replicas():
    x = torch.ones(3, 2)
    with pytest.raises(poptorch.Error, match=r"inputReplicaGrouping\(2, CommGroupType.Consecutive\) needs a group"):
        poptorch.inferenceModel(Scale(), _opts(3).inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive))
    with pytest.raises(poptorch.Error, match="must be a multiple of .* inputReplicaGrouping size"):
        poptorch.inferenceModel(Scale(), _opts(4).inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive))(x)


def test_parameter_replica_grouping_accepts_the_default_and_refuses_the_rest():
    training = poptorch.trainingModel(Scale(), _opts(2))
    training.w.replicaGrouping(poptorch.CommGroupType.All, 0, poptorch.VariableRetrievalMode.OnePerGroup)
    for args in (
        (poptorch.CommGroupType.NoGrouping, 0, poptorch.VariableRetrievalMode.OnePerGroup),
        (poptorch.CommGroupType.Consecutive, 2, poptorch.VariableRetrievalMode.OnePerGroup),
        (poptorch.CommGroupType.All, 0, poptorch.VariableRetrievalMode.AllReplicas),
    ):
        with pytest.raises(poptorch.Error, match="replicaGrouping.*of parameter 'w' is not modelled"):
            training.w.perReplica(*args)
