"""PopTorch's host-transfer and host-code ops: set_overlap_for_input / _output (OverlapMode), CPU host
callbacks and MultiConv. Each runs as PopTorch's does on the CPU; on the simulated
IPU what is modelled works and the rest is refused as not modelled."""

import copy

import pytest
import torch

import popsim
import poptorch


def _options():
    return poptorch.Options().showCompilationProgressBar(False)


class _Overlapped(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, extra):
        x, extra = poptorch.set_overlap_for_input((x, {"e": extra}), self.mode)
        out = self.fc(x) + extra["e"]
        return poptorch.set_overlap_for_output(out, self.mode)


def test_no_overlap_marks_tensors_and_runs_as_eager():
    model = _Overlapped(poptorch.OverlapMode.NoOverlap)
    x, extra = torch.randn(4, 3), torch.randn(4, 2)
    torch.testing.assert_close(poptorch.inferenceModel(model, _options())(x, extra), model(x, extra))


@pytest.mark.parametrize(
    "mode", [poptorch.OverlapMode.OverlapAccumulationLoop, poptorch.OverlapMode.OverlapDeviceIterationLoop]
)
def test_overlapping_modes_run_on_the_cpu_and_are_refused_on_the_ipu(mode):
    model = _Overlapped(mode)
    x, extra = torch.randn(4, 3), torch.randn(4, 2)
    assert model(x, extra).shape == (4, 2)
    refused = r"set_overlap_for_input\(\.\.\., OverlapMode\.Overlap\w+\) is not modelled by the simulated IPU"
    with pytest.raises(poptorch.Error, match=refused):
        poptorch.inferenceModel(model, _options())(x, extra)


def test_overlap_needs_tensors_and_a_mode():
    with pytest.raises(poptorch.Error, match="only set overlap for torch.tensor"):
        poptorch.set_overlap_for_input([torch.ones(1), 3], poptorch.OverlapMode.NoOverlap)
    with pytest.raises(poptorch.Error, match="must be a poptorch.OverlapMode"):
        poptorch.set_overlap_for_output(torch.ones(1), "no_overlap")


class _WithHostOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cpu = poptorch.CPU(self.double, "Double")

    def double(self, x):
        return x * 2.0

    def forward(self, x):
        return self.cpu(x + 1.0)


def test_a_host_callback_runs_on_the_cpu_and_is_refused_on_the_ipu():
    model = _WithHostOp()
    torch.testing.assert_close(model(torch.ones(2)), torch.full((2,), 4.0))
    with pytest.raises(poptorch.Error, match=r"poptorch.CPU\('Double'\) is not modelled"):
        poptorch.inferenceModel(model, _options())(torch.ones(2))


class _Convs(torch.nn.Module):
    def __init__(self, multi_conv):
        super().__init__()
        self.multi_conv = multi_conv
        self.a, self.b = torch.nn.Conv2d(1, 2, 3), torch.nn.Conv2d(1, 2, 3, padding=1, stride=2)

    def forward(self, x, u):
        with self.multi_conv:
            y, v = self.a(x), self.b(u)
        return poptorch.identity_loss(y.sum() + (v * v).sum(), reduction="none")


def _serial():
    return poptorch.MultiConv().planType(poptorch.MultiConvPlanType.Serial).partialsTypes(torch.float)


def test_multiconv_runs_its_convolutions_on_the_ipu_as_eager():
    model = _Convs(_serial().enableConvDithering([False, False]))
    x, u = torch.randn(2, 1, 5, 5), torch.randn(2, 1, 6, 6)
    torch.testing.assert_close(poptorch.inferenceModel(model, _options())(x, u), model(x, u), rtol=1e-5, atol=1e-5)


def test_training_through_a_multiconv_matches_eager():
    model, x, u = _Convs(poptorch.MultiConv()), torch.randn(2, 1, 5, 5), torch.randn(2, 1, 6, 6)
    eager = copy.deepcopy(model)
    training = poptorch.trainingModel(model, _options(), torch.optim.SGD(model.parameters(), lr=0.01))
    training(x, u)
    training.copyWeightsToHost()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.01)
    eager(x, u).backward()
    optimizer.step()
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("setting", "refused"),
    [
        (lambda m: m.planType(poptorch.MultiConvPlanType.Parallel), r"planType\(MultiConvPlanType.Parallel\)"),
        (lambda m: m.partialsTypes(torch.half), r"partialsTypes\(torch.float16\)"),
        (lambda m: m.enableConvDithering(True), r"enableConvDithering\(True\)"),
        (lambda m: m.perConvReservedTiles(4), r"perConvReservedTiles\(4\)"),
        (lambda m: m.cycleBackOff(0.3), r"cycleBackOff\(0.3\)"),
    ],
)
def test_multiconv_settings_the_simulator_cannot_honour_run_on_the_cpu_and_are_refused_on_the_ipu(setting, refused):
    model, x, u = _Convs(setting(poptorch.MultiConv())), torch.randn(1, 1, 5, 5), torch.randn(1, 1, 6, 6)
    assert model(x, u).shape == ()
    with pytest.raises(poptorch.Error, match=rf"poptorch.MultiConv\(\).{refused} is not modelled"):
        poptorch.inferenceModel(model, _options())(x, u)


WIDTH = 64
BUDGET_TARGET = popsim.Target.small(num_tiles=16, tile_bytes=65_536)


class _WideConvs(torch.nn.Module):
    def __init__(self, proportions):
        super().__init__()
        self.proportions = proportions
        self.a, self.b = torch.nn.Conv2d(WIDTH, WIDTH, 1), torch.nn.Conv2d(WIDTH, WIDTH, 1)

    def forward(self, x, u):
        multi_conv = poptorch.MultiConv()
        if self.proportions is not None:
            multi_conv.availableMemoryProportions(self.proportions)
        with multi_conv:
            return self.a(x), self.b(u)


def _budgeted_cycles(monkeypatch, model, x, u):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: BUDGET_TARGET)
    executor = poptorch.inferenceModel(model, _options())
    for ours, eager in zip(executor(x, u), model(x, u)):
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-4)
    cycles = executor.profile.programs["inference"]["total_cycles"]
    executor.destroy()
    return cycles


def test_multiconv_available_memory_proportions_bound_each_convolution_s_plan(monkeypatch):
    torch.manual_seed(0)
    x, u = torch.randn(1, WIDTH, 8, 8), torch.randn(1, WIDTH, 8, 8)
    models = {str(p): _WideConvs(p) for p in (0.9, [0.05, 0.9], [0.05, 0.05], 0.05)}
    for model in models.values():
        model.load_state_dict(models["0.9"].state_dict())
    cycles = {p: _budgeted_cycles(monkeypatch, model, x, u) for p, model in models.items()}
    # A tighter budget on one convolution gives it a slower plan; on both, both are slower; one value
    # applies to every convolution of the scope.
    assert cycles["0.9"] < cycles["[0.05, 0.9]"] < cycles["[0.05, 0.05]"] == cycles["0.05"]


def test_per_convolution_settings_must_match_the_scope_s_convolutions():
    model, x, u = _Convs(_serial().enableConvDithering([False] * 3)), torch.randn(1, 1, 5, 5), torch.randn(1, 1, 6, 6)
    with pytest.raises(poptorch.Error, match="enableConvDithering has 3 values but the scope holds 2 convolutions"):
        model(x, u)
    with pytest.raises(poptorch.Error, match="enableConvDithering has 3 values but the scope holds 2 convolutions"):
        poptorch.inferenceModel(model, _options())(x, u)


def test_multiconv_settings_are_validated_as_poptorch_does():
    for bad in (
        lambda: poptorch.MultiConv().planType("parallel"),
        lambda: poptorch.MultiConv().availableMemoryProportions(1.5),
        lambda: poptorch.MultiConv().availableMemoryProportions([]),
        lambda: poptorch.MultiConv().partialsTypes(torch.int32),
        lambda: poptorch.MultiConv().enableConvDithering([True, 1]),
        lambda: poptorch.MultiConv().perConvReservedTiles(2.0),
        lambda: poptorch.MultiConv().cycleBackOff(1),
    ):
        with pytest.raises(poptorch.Error, match="MultiConv"):
            bad()
