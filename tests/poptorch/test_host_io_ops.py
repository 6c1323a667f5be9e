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
def test_overlapping_modes_run_on_the_cpu_and_on_io_tiles_of_the_ipu(mode):
    model = _Overlapped(mode)
    x, extra = torch.randn(4, 3), torch.randn(4, 2)
    opts = _options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x, extra), model(x, extra))


def test_overlap_needs_tensors_and_a_mode():
    with pytest.raises(poptorch.Error, match="only set overlap for torch.tensor"):
        poptorch.set_overlap_for_input([torch.ones(1), 3], poptorch.OverlapMode.NoOverlap)
    with pytest.raises(poptorch.Error, match="must be a poptorch.OverlapMode"):
        poptorch.set_overlap_for_output(torch.ones(1), "no_overlap")


class _WithHostOp(torch.nn.Module):
    """The guide's CPU op example between two device layers: the host op runs three times in a row."""

    def __init__(self, on_host=True):
        super().__init__()
        self.first, self.last = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
        self.cpu = poptorch.CPU(self.my_cpu_op, "MyCPUOp") if on_host else self.my_cpu_op
        self.calls = 0

    def my_cpu_op(self, x):
        self.calls += 1
        return x * 2.0 + torch.sin(x)

    def forward(self, x):
        out = self.cpu(torch.relu(self.first(x)))
        out = self.cpu(out)
        return self.last(self.cpu(out))


def _inference_profile(model, x, opts):
    executor = poptorch.inferenceModel(model, opts)
    executor(x)
    program = executor.profile.programs["inference"]
    executor.destroy()
    return program


def test_a_host_callback_between_device_layers_runs_on_the_host_and_matches_eager():
    torch.manual_seed(0)
    model, x = _WithHostOp(), torch.randn(2 * 3, 3)
    executor = poptorch.inferenceModel(model, _options().deviceIterations(2))
    executor.compile(x)
    model.calls = 0
    out = executor(x)
    # Three host calls in each of the call's two device iterations, none on the CPU.
    assert model.calls == 3 * 2
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_the_profile_shows_each_host_callback_s_transfers():
    torch.manual_seed(0)
    model, x = _WithHostOp(), torch.randn(3, 3)
    plain = _WithHostOp(on_host=False)
    plain.load_state_dict(model.state_dict())
    program, plain = _inference_profile(model, x, _options()), _inference_profile(plain, x, _options())
    steps = [step["name"].split(" ")[0] for step in program["steps"] if step["kind"] == "host"]
    assert steps == ["stream-out", "host-call", "stream-in"] * 3
    assert not any(step["kind"] == "host" for step in plain["steps"])
    assert program["host_cycles"] > plain["host_cycles"]
    # The operations table credits the transfers to the CPU op's calls, with their source lines.
    rows = [r for r in popsim.profile.operations(program) if r.get("aten") == "poptorch.host_call.default"]
    assert rows and sum(r["host_cycles"] for r in rows) == program["host_cycles"] - plain["host_cycles"]
    assert all("self.cpu(" in r["source"] for r in rows)


def test_the_call_timeline_shows_each_host_callback_s_transfers_and_host_time():
    torch.manual_seed(0)
    model, x = _WithHostOp(), torch.randn(3, 3)
    plain = _WithHostOp(on_host=False)
    plain.load_state_dict(model.state_dict())
    runs = {}
    for name, m in (("host", model), ("plain", plain)):
        executor = poptorch.inferenceModel(m, _options().logCycleCount(True))
        torch.testing.assert_close(executor(x), plain(x), rtol=1e-5, atol=1e-5)
        runs[name] = executor.cycleCount(), executor.profile.programs["inference"]
        executor.destroy()
    (cycles, program), (plain_cycles, _) = runs["host"], runs["plain"]
    # The host's time in a callback is modelled per element, so the callback model costs more cycles.
    assert cycles > plain_cycles
    timeline = program["run_timeline"]
    assert timeline["makespan"] == cycles == program["total_cycles"]
    # The model's own input streams in first, its output out last; the callbacks' streams come between.
    modelled = [e for e in timeline["intervals"] if "stream" in e]
    assert [e["stream"] for e in modelled] == ["in", "out"] and modelled == [timeline["intervals"][i] for i in (0, -1)]
    kinds = [e["transfer"] for e in timeline["intervals"] if "transfer" in e and "stream" not in e]
    # The results of one call and the arguments of the next stream back to back: one stretch on the link.
    assert kinds == ["host transfer", "host callback"] * 3 + ["host transfer"]
    sync = popsim.Target.ipu2().bsp_sync_cycles
    calls = [e for e in timeline["intervals"] if e.get("transfer") == "host callback"]
    # Each call: 3 x 4 elements in and out; the tiles wait on the host (its own lane) for the modelled time.
    assert all(e["lanes"] == ["replica 0 IPU 0 compute", "replica 0 host"] for e in calls)
    callback = popsim.cost.host_callback_cycles(popsim.Target.ipu2(), 2 * 3 * 4)
    assert all(e["end"] - e["start"] == callback + sync for e in calls)
    streams = [e for e in timeline["intervals"] if e.get("transfer") == "host transfer" and "stream" not in e]
    assert all("replica 0 host link" in e["lanes"] for e in streams)
    host_steps = [s for s in program["steps"] if s["kind"] == "host"]
    assert sum(e["end"] - e["start"] for e in calls + streams) == sum(s["cycles"] + sync for s in host_steps)


class _HostLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.host_layer = torch.nn.Linear(3, 3)
        self.cpu = poptorch.CPU(self.host_layer, "HostLayer")

    def forward(self, x):
        return self.cpu(x * 2.0) + 1.0


def test_a_copied_model_s_host_callback_runs_its_own_function():
    model = _HostLayer()
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.host_layer.weight.mul_(-3.0)
    x = torch.randn(2, 3)
    executors = [poptorch.inferenceModel(m, _options()) for m in (model, copied)]
    for executor in executors:
        executor.compile(x)
    outputs = [executor(x) for executor in executors]
    torch.testing.assert_close(outputs[0], model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[1], copied(x), rtol=1e-5, atol=1e-5)


def test_an_exported_model_with_a_host_callback_loads_and_runs_its_own_function(tmp_path):
    model, x, path = _HostLayer(), torch.randn(2, 3), str(tmp_path / "model.popef")
    poptorch.inferenceModel(model, _options()).compileAndExport(path, x)
    expected = model(x)
    loaded = poptorch.load(path)
    with torch.no_grad():
        model.host_layer.weight.zero_()  # the original changes; the loaded copy keeps its own weights
    torch.testing.assert_close(loaded(x), expected, rtol=1e-5, atol=1e-5)


class _Tuple(torch.nn.Module):
    def __init__(self, host_function):
        super().__init__()
        self.cpu = poptorch.CPU(host_function, "Pair")

    def forward(self, x, n):
        a, b = self.cpu(x * 3.0, n)
        return a + 1.0, b


def test_a_host_callback_takes_and_returns_several_tensors_of_their_captured_dtypes():
    def pair(x, n):
        assert n.dtype == torch.int64
        return x.sum(dim=1), n * 2

    model, x, n = _Tuple(pair), torch.randn(2, 3), torch.tensor([1, 2])
    ours, eager = poptorch.inferenceModel(model, _options())(x, n), model(x, n)
    torch.testing.assert_close(ours[0], eager[0])
    assert torch.equal(ours[1], eager[1].int())


def test_a_host_callback_that_raises_stops_the_run_with_a_poptorch_error():
    def broken(x, n):
        if x.any():  # capture probes the shapes on zeros; the run's values make it raise
            raise ValueError("no such file")
        return x, n

    model = _Tuple(broken)
    with pytest.raises(poptorch.Error, match=r"host callback 'Pair#[0-9a-f]+' raised ValueError: no such file"):
        poptorch.inferenceModel(model, _options())(torch.ones(2, 3), torch.ones(2, dtype=torch.int64))


def test_host_callbacks_are_refused_in_training_as_in_poptorch():
    model = _WithHostOp()
    loss = poptorch.trainingModel(torch.nn.Sequential(model, torch.nn.Flatten(0)), _options())
    with pytest.raises(poptorch.Error, match=r"poptorch.CPU\('MyCPUOp'\): CPU ops are only supported in inference"):
        loss(torch.ones(1, 3))


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
