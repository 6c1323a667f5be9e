"""Batching as PopTorch: deviceIterations, replication, gradient accumulation and OutputMode."""

import copy

import pytest
import torch
from sgd_step import eager_step

import poptorch


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.net(x)
        return out, self.loss(out, y)


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _eager_steps(model, x, y, steps, lr=0.1):
    """One SGD step per chunk of the batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for xs, ys in zip(x.chunk(steps), y.chunk(steps)):
        eager_step(model, optimizer, xs, ys)


@pytest.mark.parametrize(("ga", "r"), [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_accumulation_and_replication_mean_equal_one_big_batch(ga, r):
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8 * ga * r // 2, 4), torch.randn(8 * ga * r // 2, 2)
    opts = _opts().replicationFactor(r)
    opts.Training.gradientAccumulation(ga)
    poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    _eager_steps(reference, x, y, 1)
    for a, b in zip(_weights(model), _weights(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sum_reduction_equals_summed_gradients():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    opts = _opts()
    opts.Training.gradientAccumulation(2).accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    # Summing the two micro-batch gradients equals twice the mean gradient: one eager step at lr 0.2.
    _eager_steps(reference, x, y, 1, lr=0.2)
    for a, b in zip(_weights(model), _weights(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_device_iterations_are_successive_steps():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    training = poptorch.trainingModel(model, _opts().deviceIterations(3), torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = training(x, y)
    assert out.shape == (4, 2) and loss.shape == ()
    _eager_steps(reference, x, y, 3)
    for a, b in zip(_weights(model), _weights(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_outputs_come_from_the_forward_before_the_update():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    opts = _opts().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, losses = training(x, y)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        optimizer.zero_grad()
        loss = reference(xs, ys)[1]
        expected.append(loss.detach())
        loss.backward()
        optimizer.step()
    torch.testing.assert_close(losses, torch.stack(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("mode", "period", "out_shape", "loss_shape"),
    [
        (poptorch.OutputMode.All, None, (24, 2), (12,)),
        (poptorch.OutputMode.EveryN, 2, (12, 2), (6,)),
        (poptorch.OutputMode.Final, None, (4, 2), (2,)),
        (poptorch.OutputMode.Sum, None, (4, 2), (2,)),
    ],
)
def test_output_mode_shapes(mode, period, out_shape, loss_shape):
    """mb=2, DI=3, R=2, GA=2: P = 12 micro-batches per call."""
    opts = _opts().deviceIterations(3).replicationFactor(2).outputMode(mode, period)
    opts.Training.gradientAccumulation(2)
    model = Regressor()
    out, loss = poptorch.trainingModel(model, opts)(torch.randn(24, 4), torch.randn(24, 2))
    assert tuple(out.shape) == out_shape
    assert tuple(loss.shape) == loss_shape


def test_inference_default_returns_all_and_sum_sums():
    torch.manual_seed(0)
    model = Regressor()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    out, loss = poptorch.inferenceModel(model, _opts().deviceIterations(4))(x, y)
    torch.testing.assert_close(out, model.net(x), rtol=1e-5, atol=1e-6)
    assert loss.shape == (4,)
    model2 = copy.deepcopy(model)
    summed, _ = poptorch.inferenceModel(model2, _opts().deviceIterations(4).outputMode(poptorch.OutputMode.Sum))(x, y)
    torch.testing.assert_close(summed, model.net(x).reshape(4, 2, 2).sum(0), rtol=1e-5, atol=1e-5)


def test_invalid_batch_dimension_text():
    opts = _opts().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    with pytest.raises(poptorch.Error) as info:
        poptorch.trainingModel(Regressor(), opts)(torch.randn(10, 4), torch.randn(10, 2))
    assert str(info.value) == (
        "Invalid batch dimension: In the input x, the batch dimension (10) must be a multiple of "
        "Options.deviceIterations(2) * Options.replicationFactor(2) * "
        "Options.Training.gradientAccumulation(3) = 12"
    )


def test_scalar_inputs_pass_through():
    class Scale(torch.nn.Module):
        def forward(self, x, s):
            return x * s

    out = poptorch.inferenceModel(Scale(), _opts().deviceIterations(2))(torch.ones(4, 3), torch.tensor(2.0))
    assert torch.equal(out, torch.full((4, 3), 2.0))


def test_replicas_run_in_parallel_then_all_reduce():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    cycles, profiles = {}, {}
    for r in (1, 4):
        model = Regressor()
        opts = _opts().replicationFactor(r).logCycleCount(True)
        opts.Training.gradientAccumulation(4 // r)
        training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        training(x, y)
        cycles[r], profiles[r] = training.cycleCount(), training.profile
    replication = profiles[4].replication
    assert profiles[1].replication is None
    assert replication["replicas"] == 4 and replication["all_reduce"]["cycles"] > 0
    # 4 micro-batches on one IPU run one after another; on 4 replicas they run at once, then all-reduce.
    accumulate = profiles[4].programs["accumulate"]["total_cycles"]
    assert (
        cycles[4]
        == replication["step_cycles"]
        == accumulate + replication["all_reduce"]["cycles"] + profiles[4].programs["apply"]["total_cycles"]
    )
    assert cycles[4] < cycles[1]
    assert "4 replicas in parallel" in profiles[4].summary()


def test_inference_replicas_are_profiled_running_in_parallel_without_a_collective():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.randn(8, 4)
    inference = poptorch.inferenceModel(model, _opts().replicationFactor(2).deviceIterations(2).logCycleCount(True))
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-6)
    replication = inference.profile.replication
    run = inference.profile.programs["inference"]["total_cycles"]
    assert replication["replicas"] == 2 and replication["all_reduce"] is None
    # Each replica runs its 2 micro-batches one after another, beside the other replica.
    assert replication["step_cycles"] == replication["replica_step_cycles"] == 2 * run == inference.cycleCount()
    timeline = replication["timeline"]
    assert [(e["replica"], e["micro_batch"], e["start"]) for e in timeline] == [
        (r, a, a * run) for r in range(2) for a in range(2)
    ]
    assert "2 replicas in parallel (inference, no collective)" in inference.profile.summary()


def test_pipelined_replicas_each_run_their_own_pipeline():
    class TwoStages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)

        def forward(self, x, y):
            out = self.second(torch.tanh(self.first(x)))
            return out, torch.nn.functional.mse_loss(out, y)

    cycles, profiles = {}, {}
    for r in (1, 2):
        torch.manual_seed(0)
        model = TwoStages()
        poptorch.BeginBlock(model.first, "a", ipu_id=0)
        poptorch.BeginBlock(model.second, "b", ipu_id=1)
        opts = _opts().replicationFactor(r).logCycleCount(True)
        opts.Training.gradientAccumulation(4)
        training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        training(torch.randn(8 * r, 4), torch.randn(8 * r, 2))
        cycles[r], profiles[r] = training.cycleCount(), training.profile
    # The second replica's pipeline runs beside the first: only the all-reduce (over both IPUs) is added.
    reduce = profiles[2].replication["all_reduce"]
    assert reduce["cycles"] > 0
    assert cycles[2] == cycles[1] + reduce["cycles"]
