"""Replica grouping: Options.inputReplicaGrouping (replicas of a group share inputs) and the parameters'
replicaGrouping (only PopTorch's default, every replica sharing the parameter, is modelled)."""

import copy
import io
import json

import pytest
import torch

import poptorch
from poptorch import _replication
from poptorch.options import replica_groups


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


GROUPINGS = [
    (poptorch.CommGroupType.Consecutive, 2, [0, 0, 1, 1]),
    (poptorch.CommGroupType.Orthogonal, 2, [0, 1, 0, 1]),
    (poptorch.CommGroupType.NoGrouping, 0, [0, 1, 2, 3]),
]


class GroupedLinear(torch.nn.Module):
    """A weight with one value per group of replicas (first dimension) and a bias every replica shares."""

    def __init__(self, groups):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(groups, 3))
        self.b = torch.nn.Parameter(torch.randn(()))

    def forward(self, x, y):
        out = x @ self.w + self.b  # the model sees one group's weight, of shape [3]
        return out, torch.nn.functional.mse_loss(out, y)


def _grouped(model, kind, shards, mode=poptorch.VariableRetrievalMode.OnePerGroup):
    model.w.replicaGrouping(kind, shards, mode)
    return model


@pytest.mark.parametrize(("kind", "shards", "group"), GROUPINGS)
def test_each_replica_runs_with_its_groups_parameter_value(kind, shards, group):
    torch.manual_seed(0)
    net = GroupedLinear(max(group) + 1)
    x, y = torch.randn(4, 2, 3), torch.randn(4, 2)
    model = _grouped(poptorch.inferenceModel(net, _opts(4)), kind, shards)
    out, _ = model(x.reshape(8, 3), y.reshape(8))
    expected = torch.stack([x[r] @ net.w[group[r]] + net.b for r in range(4)]).detach()
    torch.testing.assert_close(out.reshape(4, 2), expected)
    with torch.no_grad():
        net.w[-1] += 1.0  # a host edit of one group's value reaches that group's replicas
    out, _ = model(x.reshape(8, 3), y.reshape(8))
    expected = torch.stack([x[r] @ net.w[group[r]] + net.b for r in range(4)]).detach()
    torch.testing.assert_close(out.reshape(4, 2), expected)


OPTIMIZERS = [
    lambda params: torch.optim.SGD(params, lr=0.1),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda params: torch.optim.Adam(params, lr=0.05),
]


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS, ids=["sgd", "momentum", "adam"])
@pytest.mark.parametrize(("kind", "shards", "group"), GROUPINGS)
def test_training_reduces_a_grouped_parameters_gradients_within_its_group(kind, shards, group, make_optimizer):
    torch.manual_seed(0)
    groups = max(group) + 1
    net = GroupedLinear(groups)
    w, b = (p.detach().clone().requires_grad_() for p in (net.w, net.b))
    # The per-group update is elementwise, so eager's optimizer over the whole [groups, 3] weight is the
    # reference once the weight's gradient is reduced per group.
    reference = make_optimizer([w, b])
    optimizer = make_optimizer(net.parameters())
    training = _grouped(poptorch.trainingModel(net, _opts(4), optimizer), kind, shards)
    for _ in range(3):
        x, y = torch.randn(4, 2, 3), torch.randn(4, 2)
        _, losses = training(x.reshape(8, 3), y.reshape(8))
        # Eager: replica r trains its group's weight; the weight's gradient is the mean over its group's
        # replicas, the shared bias's the mean over all of them.
        eager = torch.stack([torch.nn.functional.mse_loss(x[r] @ w[group[r]] + b, y[r]) for r in range(4)])
        (w.grad,) = torch.autograd.grad(eager.sum() * groups / 4, w, retain_graph=True)
        (b.grad,) = torch.autograd.grad(eager.mean(), b)
        reference.step()
        torch.testing.assert_close(losses, eager.detach())
    training.copyWeightsToHost()
    assert net.w.shape == (groups, 3)
    torch.testing.assert_close(net.w, w.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net.b, b.detach(), rtol=1e-4, atol=1e-5)
    for slot, value in reference.state[w].items():  # each group's optimizer state, read back per group
        torch.testing.assert_close(optimizer.state[net.w][slot], value, rtol=1e-4, atol=1e-5)


def test_a_grouped_parameter_needs_one_value_per_group():
    model = _grouped(poptorch.inferenceModel(GroupedLinear(3), _opts(4)), poptorch.CommGroupType.Consecutive, 2)
    with pytest.raises(poptorch.Error, match=r"first dimension must hold one value per group: expected shape \[2"):
        model(torch.ones(4, 3), torch.ones(4))


def test_bad_or_late_groupings_are_refused():
    training = poptorch.trainingModel(GroupedLinear(2), _opts(4))
    with pytest.raises(poptorch.Error, match="shards \\(the group size\\) must be a positive int, got 0"):
        _grouped(training, poptorch.CommGroupType.Orthogonal, 0)
    inference = poptorch.inferenceModel(Scale(), _opts(1))
    inference(torch.ones(2))
    with pytest.raises(poptorch.Error, match="before the model is compiled"):
        _grouped(inference, poptorch.CommGroupType.All, 0)


def test_per_replica_params_groups_a_nested_parameter_by_its_name():
    torch.manual_seed(0)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = GroupedLinear(2)

        def forward(self, x, y):
            return self.inner(x, y)

    net = Outer()
    model = poptorch.inferenceModel(net, _opts(4))
    settings = (poptorch.CommGroupType.Orthogonal, 2, poptorch.VariableRetrievalMode.OnePerGroup)
    model.per_replica_params["inner.w"] = settings
    x = torch.randn(4, 2, 3)
    out, _ = model(x.reshape(8, 3), torch.zeros(8))
    expected = torch.stack([x[r] @ net.inner.w[r % 2] + net.inner.b for r in range(4)]).detach()
    torch.testing.assert_close(out.reshape(4, 2), expected)
    model.per_replica_params["inner.w"] = (poptorch.CommGroupType.Consecutive, 2, settings[2])
    with pytest.raises(poptorch.Error, match="per_replica_params changed after the model was compiled"):
        model(x.reshape(8, 3), torch.zeros(8))


@pytest.mark.parametrize("strategy", [poptorch.MeanReductionStrategy.Post, poptorch.MeanReductionStrategy.Running])
def test_grouped_gradients_are_the_mean_over_the_groups_accumulated_micro_batches(strategy):
    torch.manual_seed(0)
    net = GroupedLinear(2)
    w, b = (p.detach().clone().requires_grad_() for p in (net.w, net.b))
    opts = _opts(4)
    opts.Training.gradientAccumulation(2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
    training = _grouped(
        poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1)),
        poptorch.CommGroupType.Orthogonal,
        2,
    )
    x, y = torch.randn(2, 4, 2, 3), torch.randn(2, 4, 2)  # [accumulation step, replica, sample]
    training(x.reshape(16, 3), y.reshape(16))
    eager = torch.stack(
        [torch.nn.functional.mse_loss(x[a, r] @ w[r % 2] + b, y[a, r]) for a in range(2) for r in range(4)]
    )
    (grad_w,) = torch.autograd.grad(eager.sum() * 2 / 8, w, retain_graph=True)
    (grad_b,) = torch.autograd.grad(eager.mean(), b)
    torch.testing.assert_close(net.w, (w - 0.1 * grad_w).detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net.b, (b - 0.1 * grad_b).detach(), rtol=1e-4, atol=1e-5)


def test_a_saved_wrapper_keeps_its_parameter_grouping():
    torch.manual_seed(0)
    net = GroupedLinear(2)
    model = _grouped(poptorch.inferenceModel(net, _opts(4)), poptorch.CommGroupType.Consecutive, 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 2, 3)
    out, _ = loaded(x.reshape(8, 3), torch.zeros(8))
    expected = torch.stack([x[r] @ net.w[r // 2] + net.b for r in range(4)]).detach()
    torch.testing.assert_close(out.reshape(4, 2), expected)


def test_a_sum_reduction_sums_a_grouped_parameters_gradients_over_its_group():
    torch.manual_seed(0)
    net = GroupedLinear(2)
    w, b = (p.detach().clone().requires_grad_() for p in (net.w, net.b))
    opts = _opts(4)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    training = _grouped(
        poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1)),
        poptorch.CommGroupType.Consecutive,
        2,
    )
    x, y = torch.randn(4, 2, 3), torch.randn(4, 2)
    training(x.reshape(8, 3), y.reshape(8))
    eager = torch.stack([torch.nn.functional.mse_loss(x[r] @ w[r // 2] + b, y[r]) for r in range(4)]).sum()
    grad_w, grad_b = torch.autograd.grad(eager, [w, b])
    torch.testing.assert_close(net.w, (w - 0.1 * grad_w).detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net.b, (b - 0.1 * grad_b).detach(), rtol=1e-4, atol=1e-5)


class Weight(torch.nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(*shape))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(x @ self.w, y)


@pytest.mark.parametrize("kind", [poptorch.CommGroupType.Consecutive, poptorch.CommGroupType.Orthogonal])
def test_a_grouped_gradient_is_costed_over_its_groups_links_only(kind):
    reduces = []
    for net in (Weight(3), Weight(2, 3)):  # shared by the 4 replicas, then one value per group of 2
        training = poptorch.trainingModel(net, _opts(4), torch.optim.SGD(net.parameters(), lr=0.1))
        if net.w.dim() == 2:
            _grouped(training, kind, 2)
        training(torch.ones(8, 3), torch.ones(8))
        reduces.append(training.profile.replication["all_reduce"])
    shared, grouped = reduces
    assert shared["bytes"] == grouped["bytes"]
    assert 0 < grouped["cycles"] < shared["cycles"]
    assert [level["name"] for level in grouped["levels"]] == ["groups of 2: IPU-Links in an IPU-M2000"]


@pytest.mark.parametrize(("kind", "shards", "group"), GROUPINGS[:2])
def test_all_replicas_retrieval_reads_every_replicas_value(kind, shards, group):
    torch.manual_seed(0)
    net = GroupedLinear(2)
    w, b = (p.detach().clone().requires_grad_() for p in (net.w, net.b))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    training = _grouped(
        poptorch.trainingModel(net, _opts(4), optimizer), kind, shards, poptorch.VariableRetrievalMode.AllReplicas
    )
    x, y = torch.randn(4, 2, 3), torch.randn(4, 2)
    training(x.reshape(8, 3), y.reshape(8))
    eager = torch.stack([torch.nn.functional.mse_loss(x[r] @ w[group[r]] + b, y[r]) for r in range(4)])
    (grad_w,) = torch.autograd.grad(eager.sum() * 2 / 4, w)
    # Replica r's row is its group's value; the optimizer state is read the same way.
    torch.testing.assert_close(net.w, (w - 0.1 * grad_w)[group].detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(optimizer.state[net.w]["momentum_buffer"], grad_w[group], rtol=1e-4, atol=1e-5)
    # The per-replica host value goes back to the device as it is, and trains on from there.
    training(x.reshape(8, 3), y.reshape(8))
    assert net.w.shape == (4, 3)
    with torch.no_grad():
        net.w[group.index(1)] += 1.0  # one replica of group 1 only: the replicas of a group share a value
    with pytest.raises(poptorch.Error, match="the replicas of a group hold different values"):
        training(x.reshape(8, 3), y.reshape(8))


def test_the_profile_records_which_replica_ran_what():
    net = GroupedLinear(2)
    opts = _opts(4)
    opts.Training.gradientAccumulation(2)
    training = _grouped(
        poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1)),
        poptorch.CommGroupType.Consecutive,
        2,
    )
    training(torch.ones(16, 3), torch.ones(16))
    replication = json.loads(training.profile.to_json())["replication"]
    timeline = replication["timeline"]
    runs = [(e["replica"], e["program"], e.get("micro_batch")) for e in timeline if e["lane"] != "all-reduce"]
    expected = [
        (r, program, a) for r in range(4) for program, a in [("accumulate", 0), ("accumulate", 1), ("apply", None)]
    ]
    assert runs == expected
    collective = [e for e in timeline if e["lane"] == "all-reduce"]
    assert [e["collective"] for e in collective] == [level["name"] for level in replication["all_reduce"]["levels"]]
    assert collective[0]["start"] == replication["replica_step_cycles"]


def test_running_means_of_a_group_spread_unevenly_over_processes_are_refused():
    opts = _opts(3)
    opts.Distributed.configureProcessId(0, 2)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(poptorch.MeanReductionStrategy.Running)
    # 6 replicas in groups of 2: group 1 (replicas 2, 3) has one replica on each process, group 0 both on
    # process 0: their running means are averaged over 2 and 1 processes.
    groups = replica_groups("test", poptorch.CommGroupType.Consecutive, 2, 6)
    assert _replication._gradient_scale("w", groups, opts).tolist() == [2.0, 1.0, 2.0]
    # Groups of 4: group 0 has 3 replicas on process 0 and 1 on process 1.
    groups = replica_groups("test", poptorch.CommGroupType.Consecutive, 4, 12)
    opts = _opts(3)
    opts.Distributed.configureProcessId(0, 4)
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(poptorch.MeanReductionStrategy.Running)
    with pytest.raises(
        poptorch.Error, match=r"group 0 spreads unevenly over the processes \(replicas per process: \{0: 3, 1: 1\}"
    ):
        _replication._gradient_scale("w", groups, opts)
