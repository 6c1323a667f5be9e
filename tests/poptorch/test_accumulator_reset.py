"""A step with gradient accumulation over several IPUs zeroes each gradient accumulator on its own IPU after
the update has read it, as PopART does: the zeros cross no IPU-Link and hold no buffer through the step, and
the numbers equal eager torch step by step."""

import pytest
import torch
from sgd_step import eager_step

import popsim
import poptorch

WIDTH, BATCH, ACCUMULATION, STEPS = 96, 2, 4, 3
ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)
# One accumulator's size on each tile of its IPU: the float32 zeros of a WIDTH x WIDTH weight over 4 tiles.
WEIGHT_BYTES_PER_TILE = WIDTH * WIDTH * 4 // ROOMY.num_tiles


class Net(torch.nn.Module):
    """Two layers of one shape on each IPU: their accumulators share one zeros value in the optimised graph."""

    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        if blocks:
            self.layers[2] = poptorch.BeginBlock(self.layers[2], ipu_id=1)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _data():
    g = torch.Generator().manual_seed(1)
    n = BATCH * ACCUMULATION
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _momenta(model, optimizer):
    return [optimizer.state[p]["momentum_buffer"].detach().clone() for p in model.parameters()]


def _split_and_eager(strategy):
    """The eager reference and its optimizer, and the same network split over two IPUs with ``strategy``,
    gradient accumulation and every micro-batch's loss returned (their mean is eager's batch loss)."""
    torch.manual_seed(0)
    reference = Net(blocks=False)
    eager_optimizer = _sgd(reference)
    torch.manual_seed(0)
    model = Net(blocks=True)
    opts = poptorch.Options().showCompilationProgressBar(False).setExecutionStrategy(strategy)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(ACCUMULATION)
    return reference, eager_optimizer, model, opts


def _steps_equal_eager(trained, reference, eager_optimizer, x, y):
    """``STEPS`` calls of ``trained``: each step's mean micro-batch loss and every parameter equal eager's."""
    for _ in range(STEPS):
        loss = trained(x, y)[1].mean()
        torch.testing.assert_close(loss, eager_step(reference, eager_optimizer, x, y), rtol=1e-5, atol=1e-6)
        for got, want in zip(trained.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution, poptorch.PipelinedExecution])
def test_accumulators_reset_on_their_own_ipu_with_no_link_traffic_and_no_step_long_buffer(monkeypatch, strategy):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    x, y = _data()
    reference, eager_optimizer, model, opts = _split_and_eager(strategy())
    optimizer = _sgd(model)
    trained = poptorch.trainingModel(model, opts, optimizer)
    _steps_equal_eager(trained, reference, eager_optimizer, x, y)
    trained.copyWeightsToHost()
    for got, want in zip(_momenta(model, optimizer), _momenta(reference, eager_optimizer), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    apply = trained.profile.programs["apply"]
    # Without replicas the step moves nothing between the IPUs: each reads and updates its own weights and
    # accumulators (the reset's zeros used to be made on IPU 0 and copied to IPU 1).
    assert {ipu for s in apply["steps"] for ipu in s.get("ipus", ())} == {0, 1}
    assert all(s.get("busiest_link_bytes", 0) == 0 for s in apply["steps"])
    # The zeros are written straight into each accumulator: the step holds no temporary of a weight's size.
    assert max(apply["memory_by_category"]["temporaries"]) < WEIGHT_BYTES_PER_TILE
    trained.destroy()


def test_running_mean_counts_its_micro_batches_on_each_ipu_with_no_link_traffic(monkeypatch):
    # PopART keeps one Running-mean counter per IPU and pipeline stage, beside the accumulators that read it:
    # the count is made, read and reset on its own IPU (a single count used to be broadcast over the IPU-Link
    # every micro-batch).
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    x, y = _data()
    reference, eager_optimizer, model, opts = _split_and_eager(poptorch.PipelinedExecution())
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(poptorch.MeanReductionStrategy.Running)
    trained = poptorch.trainingModel(model, opts, _sgd(model))
    _steps_equal_eager(trained, reference, eager_optimizer, x, y)
    programs = trained.profile.programs
    crossing = [s for s in programs["accumulate"]["steps"] if s.get("busiest_link_bytes", 0)]
    # Only the activation into IPU 1 and its gradient back to IPU 0 cross: no optimizer work does.
    assert sorted(s["origin"]["role"] for s in crossing) == ["backward", "forward"]
    assert all(s.get("busiest_link_bytes", 0) == 0 for s in programs["apply"]["steps"])
    trained.destroy()
