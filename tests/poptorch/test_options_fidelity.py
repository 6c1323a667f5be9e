"""poptorch.Options as PopTorch 3.x documents them: each option works on the simulated IPU or is refused."""

import json
import logging
import os
import pathlib

import numpy as np
import pytest
import torch
from regressor import Regressor
from regressor import quiet_options as _opts
from regressor import regression_data as _data

import poptorch
from poptorch import _logging


# -- output mode -------------------------------------------------------------------------------------
def test_default_output_mode_resolves_on_the_models_options():
    opts = _opts()
    training = poptorch.trainingModel(Regressor(), opts)
    inference = poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All
    assert opts.defaultOutputMode() and opts.defaultAnchorMode()


def test_output_return_period_only_changes_with_every_n():
    opts = _opts().outputMode(poptorch.OutputMode.EveryN, 2)
    opts.outputMode(poptorch.OutputMode.All)
    assert opts.output_return_period == 2
    assert poptorch.AnchorMode is poptorch.OutputMode
    assert opts.anchorMode(poptorch.AnchorMode.Sum).output_mode == poptorch.OutputMode.Sum
    with pytest.raises(poptorch.Error, match="OutputMode"):
        opts.outputMode("All")


# -- bad input ---------------------------------------------------------------------------------------
def test_assigning_to_a_setter_raises():
    opts = poptorch.Options()
    with pytest.raises(poptorch.Error, match=r"deviceIterations is a setter: call it, e.g. opts.deviceIterations\(4\)"):
        opts.deviceIterations = 4
    with pytest.raises(poptorch.Error, match="gradientAccumulation is a setter"):
        opts.Training.gradientAccumulation = 2
    with pytest.raises(poptorch.Error, match="Cannot assign 'device_iterations'"):
        opts.device_iterations = 4
    with pytest.raises(poptorch.Error, match="Cannot assign 'deviceIteration'"):
        opts.deviceIteration = 4
    assert opts.device_iterations == 1 and opts.Training.gradient_accumulation == 1


def test_to_dict_names_every_enum():
    values = _opts().connectionType(poptorch.ConnectionType.OnDemand).toDict()
    assert values["connectionType"] == "OnDemand" and values["syncPattern"] == "Full"
    assert values["Precision.halfFloatCasting"] == "HalfUpcastToFloat" and values["outputMode"] == "Default"


def test_paths_must_be_paths(tmp_path):
    with pytest.raises(poptorch.Error, match="enableExecutableCaching takes a directory path.*123"):
        poptorch.Options().enableExecutableCaching(123)
    with pytest.raises(poptorch.Error, match="logDir takes a directory path.*None"):
        poptorch.Options().logDir(None)
    assert poptorch.Options().enableExecutableCaching(None).executable_cache_dir is None
    assert poptorch.Options().logDir(tmp_path).log_dir == str(tmp_path)


def test_enums_and_bools_are_checked():
    with pytest.raises(poptorch.Error, match=r"got the string 'Mean': pass poptorch.ReductionType.Mean"):
        poptorch.Options().Training.accumulationAndReplicationReductionType("Mean")
    with pytest.raises(poptorch.Error, match="takes True or False, got 'False'"):
        poptorch.Options().enableSyntheticData("False")
    with pytest.raises(poptorch.Error, match="MeanReductionStrategy"):
        poptorch.Options().Training.setMeanAccumulationAndReplicationReductionStrategy("Running")


def test_random_seed_range():
    with pytest.raises(poptorch.Error, match=r"randomSeed takes an integer in \[0, 2\*\*64\)"):
        poptorch.Options().randomSeed(2**70)
    with pytest.raises(poptorch.Error):
        poptorch.Options().randomSeed(-1)
    assert poptorch.Options().randomSeed(2**64 - 1).random_seed == 2**64 - 1


@pytest.mark.parametrize(
    "value, match",
    [("{deviceIterations: 2}", "Expecting property name"), ('{"noSuchOption": 1}', "noSuchOption"), ("[1]", "object")],
)
def test_malformed_default_options_name_the_variable(monkeypatch, value, match):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", value)
    with pytest.raises(poptorch.Error, match=f"POPTORCH_DEFAULT_OPTIONS.*{match}"):
        poptorch.Options()


def test_from_json():
    opts = poptorch.Options().from_json('{"deviceIterations": 3, "Training": {"gradientAccumulation": 2}}')
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 2)
    with pytest.raises(poptorch.Error, match="from_json.*replicationFactor must be a positive integer"):
        poptorch.Options().from_json('{"replicationFactor": 0}')


def test_ipu_model_environment(monkeypatch):
    assert not poptorch.Options().use_ipu_model
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert poptorch.Options().use_ipu_model
    assert not poptorch.Options().useIpuModel(False).use_ipu_model
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "maybe")
    with pytest.raises(poptorch.Error, match="POPTORCH_IPU_MODEL must be 1 or 0"):
        poptorch.Options()


# -- refused: not modelled ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda o: o.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.FloatDowncastToHalf),
        lambda o: o.syncPattern(poptorch.SyncPattern.SinglePipeline),
        lambda o: o._Popart.setPatterns({"PadSum": True}, 0),
        lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(
            poptorch.MeanReductionStrategy.PostAndLoss
        ),
    ],
)
def test_unmodelled_options_are_refused(call):
    with pytest.raises(poptorch.Error, match="not modelled by the simulated IPU"):
        call(poptorch.Options())


def test_modelled_values_of_refused_options_are_accepted():
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(False).setConvolutionDithering(False)
    opts.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)
    opts.Precision.enableStochasticRounding(False)
    opts.syncPattern(poptorch.SyncPattern.Full)
    opts._Popart.set("instrumentWithHardwareCycleCounter", True)
    assert opts.log_cycle_count
    opts.enableStableNorm(True).disableModuleNamescope().relaxOptimizerAttributesChecks()


# -- options with an effect --------------------------------------------------------------------------
def test_connection_type():
    x, y = _data()
    never = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts().connectionType(poptorch.ConnectionType.Never))
    never.compile(x)
    assert never.isCompiled() and not never.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="ConnectionType.Never"):
        never(x)
    on_demand = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts().connectionType(poptorch.ConnectionType.OnDemand))
    on_demand.compile(x)
    assert not on_demand.isAttachedToDevice()
    on_demand(x)
    assert on_demand.isAttachedToDevice()
    always = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts())
    always.compile(x)
    assert always.isAttachedToDevice()


def test_offline_ipu_target_compiles_without_running():
    opts = _opts().useOfflineIpuTarget(21)
    assert opts.ipu_version == "ipu21" and opts.connection_type == poptorch.ConnectionType.Never
    model = poptorch.inferenceModel(torch.nn.Linear(4, 3), opts)
    model.compile(torch.randn(2, 4))
    assert model.isCompiled() and model.profile.target.name == "ipu21"
    with pytest.raises(poptorch.Error, match="ConnectionType.Never"):
        model(torch.randn(2, 4))
    # Compiling is enough to list the tensors (no run needed).
    assert {"input", "MatMul:0", "Add:0", "model.bias", "model.weight"} <= set(model.getTensorNames())


def test_enable_profiling_writes_the_profile_under_the_model_name(tmp_path):
    model = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts().enableProfiling(str(tmp_path)).modelName("net"))
    model(torch.randn(2, 4))
    profile = json.loads((tmp_path / "net" / "profile.json").read_text())
    assert "inference" in profile["programs"]


def test_num_io_tiles_leaves_those_tiles_without_work():
    x = torch.randn(2, 4)
    opts = _opts()
    opts.TensorLocations.numIOTiles(32)
    reserved = poptorch.inferenceModel(torch.nn.Linear(4, 3), opts)
    reserved(x)
    assert reserved.profile.target.num_tiles == 1472 - 32
    full = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts())
    full(x)
    assert full.profile.target.num_tiles == 1472


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=1)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def records():
    handler = _Records()
    _logging.logger.addHandler(handler)
    level = _logging.logger.level
    yield handler.messages
    _logging.logger.removeHandler(handler)
    _logging.logger.setLevel(level)
    _logging.set_max_repeats(_logging.DEFAULT_MAX_REPEATS)


def test_log_cycle_count_logs_each_call_at_debug(records):
    poptorch.setLogLevel("INFO")
    model = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts().logCycleCount(True))
    model(torch.randn(2, 4))
    assert not [m for _, m in records if m.startswith("Simulated cycle count")]
    poptorch.setLogLevel("DEBUG")
    model(torch.randn(2, 4))
    assert (logging.DEBUG, f"Simulated cycle count of the last call: {model.cycleCount()}") in records
    assert model.cycleCount() > 0


def test_trace_level_logs_the_compiled_programs(records):
    poptorch.setLogLevel("TRACE")
    poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts())(torch.randn(2, 4))
    listings = [m for level, m in records if level == _logging.TRACE]
    assert len(listings) == 1 and listings[0].startswith("Program inference:") and "matmul" in listings[0]


def test_max_repeat_logs_silences_repeats(records):
    poptorch.Options().maxRepeatLogs(2)
    for _ in range(5):
        _logging.logger.warning("same")
    _logging.logger.warning("other")
    assert [m for _, m in records] == ["same", "same", "other"]


def test_synthetic_data_has_no_host_io():
    torch.manual_seed(0)
    model = Regressor()
    before = model.fc.weight.detach().clone()
    opts = _opts().enableSyntheticData(True).randomSeed(3)
    out, loss = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(*_data())
    assert not out.any() and not loss.any()
    assert not torch.equal(model.fc.weight, before)  # trained on the device's own data


def test_mean_reduction_strategies_match_eager():
    x, y = _data(8)
    results = {}
    for strategy in (poptorch.MeanReductionStrategy.Post, poptorch.MeanReductionStrategy.Running):
        torch.manual_seed(0)
        model = Regressor()
        opts = _opts()
        opts.Training.gradientAccumulation(4).setMeanAccumulationAndReplicationReductionStrategy(strategy)
        poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
        results[strategy] = model.fc.weight.detach().clone()
    torch.manual_seed(0)
    eager = Regressor()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    grads = []
    for i in range(4):
        optimizer.zero_grad()
        eager(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])[1].backward()
        grads.append(eager.fc.weight.grad.clone())
    expected = eager.fc.weight.detach() - 0.1 * torch.stack(grads).mean(0)
    for weight in results.values():
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6)


class _HalfSum(torch.nn.Module):
    """A float16 model whose weight gradient is 30,000 per micro-batch: a sum of 4 overflows float16."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.half))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum(), "none")


def test_running_mean_keeps_a_half_accumulator_finite():
    x = torch.full((4, 1), 30000.0, dtype=torch.half)
    weights = {}
    for strategy in (poptorch.MeanReductionStrategy.Post, poptorch.MeanReductionStrategy.Running):
        model = _HalfSum()
        opts = _opts()
        opts.Training.gradientAccumulation(4).setMeanAccumulationAndReplicationReductionStrategy(strategy)
        poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1e-4))(x)
        weights[strategy] = float(model.w.detach())
    assert not np.isfinite(weights[poptorch.MeanReductionStrategy.Post])
    assert weights[poptorch.MeanReductionStrategy.Running] == pytest.approx(-3.0, rel=1e-3)


class _FloatSum(torch.nn.Module):
    """_HalfSum in float32: only a float16 accumulator overflows."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum(), "none")


def test_accum_type_sets_the_gradient_accumulators_dtype():
    x = torch.full((4, 1), 30000.0)
    weights = {}
    for accum_type in (None, torch.half):
        model = _FloatSum()
        opts = _opts()
        opts.Training.gradientAccumulation(4)
        opts.anchorTensor("accum", "Accum___model.w")
        optimizer = poptorch.optim.SGD(model.parameters(), lr=1e-4, accum_type=accum_type)
        training = poptorch.trainingModel(model, opts, optimizer)
        training(x)
        assert training.getAnchoredTensor("accum").dtype == (accum_type or torch.float32)
        weights[accum_type] = float(model.w.detach())
    assert weights[None] == pytest.approx(-3.0, rel=1e-6)  # as eager: lr x the mean gradient, 30,000
    assert not np.isfinite(weights[torch.half])  # the float16 sum of 4 x 30,000 overflows


class _Divide(torch.nn.Module):
    def forward(self, x, y):
        return (x / y).exp()


def test_floating_point_exceptions_name_the_op_and_line():
    x, y = torch.ones(2, 3), torch.tensor([[1.0, 0.0, 2.0], [1.0, 1.0, 1.0]])
    plain = poptorch.inferenceModel(_Divide(), _opts())(x, y)
    assert torch.isinf(plain).any()
    opts = _opts()
    opts.Precision.enableFloatingPointExceptions(True)
    trapping = poptorch.inferenceModel(_Divide(), opts)
    with pytest.raises(
        poptorch.Error, match=r"div produced inf at .*test_options_fidelity.py:\d+: return \(x / y\)"
    ) as info:
        trapping(x, y)
    assert info.value.type == "floating_point_exception"
    assert "test_options_fidelity.py" in info.value.location
    finite = trapping(x, torch.ones(2, 3))
    torch.testing.assert_close(finite, torch.full((2, 3), np.e))


def test_options_are_pathlike_friendly(tmp_path):
    opts = poptorch.Options().enableExecutableCaching(pathlib.Path(tmp_path))
    assert opts.executable_cache_dir == os.fspath(tmp_path)


def test_source_location_excludes_skip_library_modules(tmp_path, monkeypatch):
    library = "import torch\n\n\nclass Divide(torch.nn.Module):\n    def forward(self, x, y):\n        return x / y\n"
    (tmp_path / "numerics_library.py").write_text(library)
    monkeypatch.syspath_prepend(str(tmp_path))
    import numerics_library

    class _UsesLibrary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.divide = numerics_library.Divide()

        def forward(self, x, y):
            return self.divide(x, y) + 1

    x, y = torch.ones(1, 2), torch.zeros(1, 2)
    locations = []
    for excludes in ([], ["numerics_library"]):
        opts = _opts().sourceLocationExcludes(excludes)
        opts.Precision.enableFloatingPointExceptions(True)
        with pytest.raises(poptorch.Error, match="div produced") as info:
            poptorch.inferenceModel(_UsesLibrary(), opts)(x, y)
        locations.append(info.value.location)
    assert "numerics_library.py:6: return x / y" in locations[0]
    assert "test_options_fidelity.py" in locations[1] and "self.divide(x, y)" in locations[1]


class _Accumulate(torch.nn.Module):
    """Adds an increment below half a float16 step (at 1.0) 64 times: rounding to nearest loses every one."""

    def forward(self, x, increment):
        return poptorch.for_loop(64, lambda a: a + increment, [x])[0]


def test_stochastic_rounding_keeps_small_increments_on_average():
    x = torch.ones(512, dtype=torch.half)
    increment = torch.tensor(2.0**-12, dtype=torch.half)
    nearest = poptorch.inferenceModel(_Accumulate(), _opts())(x, increment)
    assert torch.equal(nearest, x)  # as eager float16: 1 + 2**-12 rounds back to 1
    assert torch.equal(_Accumulate()(x, increment), x)
    opts = _opts().randomSeed(1)
    opts.Precision.enableStochasticRounding(True)
    model = poptorch.inferenceModel(_Accumulate(), opts)
    first, second = model(x, increment), model(x, increment)
    assert first.dtype == torch.half
    # Exact arithmetic gives 1 + 64 * 2**-12 = 1.015625; each element is a multiple of the float16 step.
    assert float(first.float().mean()) == pytest.approx(1.015625, abs=0.002)
    steps = (first.float() - 1) * 2**10
    assert torch.equal(steps, steps.round())
    assert not torch.equal(first, second)  # fresh random numbers on every run


@pytest.mark.parametrize("relax", [False, True])
def test_unexpected_optimizer_attributes_are_reported_once_unless_relaxed(records, relax):
    _logging.logger.setLevel(logging.DEBUG)
    x, y = _data()
    model = Regressor()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.param_groups[0]["before_compiling"] = 1  # known when compiled: never reported
    training = poptorch.trainingModel(model, _opts().relaxOptimizerAttributesChecks(relax), optimizer)
    training(x, y)
    optimizer.param_groups[0]["initial_lr"] = 0.1
    optimizer.schedule_note = "warm-up"
    for _ in range(2):
        training.setOptimizer(optimizer)
        training(x, y)
    reported = [(level, m) for level, m in records if "unexpected" in m]
    expected = logging.DEBUG if relax else logging.WARNING
    assert sorted(reported) == [
        (expected, "Ignoring unexpected group 0 attribute in SGD: initial_lr"),
        (expected, "Ignoring unexpected optimizer attribute in SGD: schedule_note"),
    ]
