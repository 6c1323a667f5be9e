"""poptorch.Options: setters, freezing, cloning, environment defaults, files, enums."""

import copy
import json

import pytest
import torch

import poptorch


def test_setters_chain_and_read_back():
    opts = poptorch.Options().deviceIterations(3).replicationFactor(2).randomSeed(7)
    opts.Training.gradientAccumulation(4).accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    assert (opts.device_iterations, opts.replication_factor, opts.random_seed) == (3, 2, 7)
    assert opts.Training.gradient_accumulation == 4
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Sum
    assert "deviceIterations=3" in repr(opts)


def test_random_seed_seeds_torch():
    poptorch.Options().randomSeed(42)
    a = torch.rand(3)
    torch.manual_seed(42)
    assert torch.equal(a, torch.rand(3))


def test_frozen_after_wrapping_and_clone_is_modifiable():
    opts = poptorch.Options().showCompilationProgressBar(False)
    poptorch.inferenceModel(torch.nn.Linear(2, 2), opts)
    with pytest.raises(poptorch.Error, match="clone"):
        opts.deviceIterations(2)
    assert opts.clone().deviceIterations(2).device_iterations == 2
    assert copy.deepcopy(opts).deviceIterations(5).device_iterations == 5
    assert opts.device_iterations == 1


def test_default_output_mode_stays_default_on_user_options():
    opts = poptorch.Options().showCompilationProgressBar(False)
    poptorch.trainingModel(torch.nn.Linear(2, 2), opts)
    assert opts.defaultOutputMode()


def test_environment_defaults(monkeypatch, tmp_path):
    defaults = {"deviceIterations": 2, "Training": {"gradientAccumulation": 3}}
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps(defaults))
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("POPTORCH_IPU_MODEL_VERSION", "ipu21")
    opts = poptorch.Options()
    assert opts.device_iterations == 2
    assert opts.Training.gradient_accumulation == 3
    assert opts.executable_cache_dir == str(tmp_path)
    assert opts.ipu_version == "ipu21"


def test_load_from_file(tmp_path):
    path = tmp_path / "opts.txt"
    path.write_text("deviceIterations(4)\n# a comment\nTraining.gradientAccumulation(2)\nreplicationFactor(2)\n")
    opts = poptorch.Options().loadFromFile(str(path))
    assert (opts.device_iterations, opts.Training.gradient_accumulation, opts.replication_factor) == (4, 2, 2)
    path.write_text("noSuchOption(1)\n")
    with pytest.raises(poptorch.Error, match="noSuchOption"):
        poptorch.Options().loadFromFile(str(path))


def test_load_from_file_takes_poptorch_objects(tmp_path):
    # A setter's argument may construct a poptorch object or name an enum member, as the user guide's file does.
    path = tmp_path / "opts.conf"
    path.write_text(
        "setExecutionStrategy(poptorch.ShardedExecution())\n"
        "outputMode(poptorch.OutputMode.All)\n"
        "enableSyntheticData(True)\n"
    )
    opts = poptorch.Options().loadFromFile(str(path))
    assert isinstance(opts._values["executionStrategy"], poptorch.ShardedExecution)
    assert opts.output_mode == poptorch.OutputMode.All
    assert opts._values["enableSyntheticData"] is True
    # Names resolve in the poptorch package only: a file cannot reach other modules or private names.
    for line in ("setExecutionStrategy(os.system('true'))", "modelName(poptorch._executor.__name__)"):
        path.write_text(line + "\n")
        with pytest.raises(poptorch.Error, match="cannot parse option"):
            poptorch.Options().loadFromFile(str(path))


def test_invalid_values():
    with pytest.raises(poptorch.Error):
        poptorch.Options().deviceIterations(0)
    with pytest.raises(poptorch.Error, match="numIOTiles must be an even number between 32 and 192."):
        poptorch.Options().TensorLocations.numIOTiles(33)
    with pytest.raises(poptorch.Error):
        poptorch.Options().Jit.traceModel(True)
    poptorch.Options().Jit.traceModel(False)
    with pytest.raises(ValueError):
        poptorch.Options().outputMode(poptorch.OutputMode.All, 2)
    with pytest.raises(ValueError):
        poptorch.Options().ipuVersion("ipu9")


def test_precision_and_distributed():
    opts = poptorch.Options()
    opts.Precision.setPartialsType(torch.half)
    assert opts.Precision.partials_type == "float16"
    opts.Distributed.configureProcessId(1, 4)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 4)


def test_enums_and_popdata_protocol():
    assert {m.name for m in poptorch.OutputMode} == {"Final", "EveryN", "All", "Sum", "Default"}
    assert {m.name for m in poptorch.ReductionType} == {"Sum", "Mean", "NoReduction"}
    assert {m.name for m in poptorch.DataLoaderMode} == {"Sync", "Async", "AsyncRebatched"}
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.arange(60.0)), batch_size=2)
    assert loader.combinedBatchSize == 12
    with pytest.raises(poptorch.Error):
        opts.deviceIterations(1)


def test_log_level(monkeypatch):
    from poptorch import _logging

    _logging.set_level("DEBUG")
    assert _logging.logger.level == 10
    _logging.set_level("WARN")
    with pytest.raises(ValueError):
        _logging.set_level("LOUD")
