"""PopTorch public names that real scripts call: each one works as PopTorch documents or is refused."""

import importlib
import logging

import pytest
import torch

import poptorch
import poptorch.options


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def test_set_engine_options_sets_what_the_simulator_models():
    opts = _opts()
    assert opts.allow_out_of_memory is False
    assert opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"}) is opts._Popart
    assert opts.allow_out_of_memory is True
    with pytest.raises(poptorch.Error, match="'target.syncReplicasIndependently' is not modelled"):
        opts._Popart.setEngineOptions({"target.syncReplicasIndependently": "true"})
    with pytest.raises(poptorch.Error, match="takes a dict"):
        opts._Popart.setEngineOptions("debug.allowOutOfMemory")


def test_append_to_location_excludes_extends_the_list(tmp_path, monkeypatch):
    library = "import torch\n\n\nclass Divide(torch.nn.Module):\n    def forward(self, x, y):\n        return x / y\n"
    (tmp_path / "appended_library.py").write_text(library)
    monkeypatch.syspath_prepend(str(tmp_path))
    import appended_library

    class _UsesLibrary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.divide = appended_library.Divide()

        def forward(self, x, y):
            return self.divide(x, y) + 1

    opts = _opts().sourceLocationExcludes(["unrelated"]).appendToLocationExcludes("appended_library")
    assert opts.source_location_excludes == ("unrelated", "appended_library")
    opts.Precision.enableFloatingPointExceptions(True)
    with pytest.raises(poptorch.Error, match="div produced") as info:
        poptorch.inferenceModel(_UsesLibrary(), opts)(torch.ones(1, 2), torch.zeros(1, 2))
    # The appended fragment skips the library's frame: the error names the caller's code instead.
    assert "test_api_gaps.py" in info.value.location and "appended_library" not in info.value.location
    with pytest.raises(poptorch.Error, match="list of path fragments"):
        _opts().appendToLocationExcludes(3)


def test_bad_options_file_line_raises_config_file_error(tmp_path):
    path = tmp_path / "opts.txt"
    path.write_text("deviceIterations(2)\nthis is not a call\n")
    with pytest.raises(poptorch.options.ConfigFileError, match="opts.txt:2: cannot parse option") as info:
        poptorch.Options().loadFromFile(str(path))
    assert isinstance(info.value, poptorch.Error)


def test_logger_is_the_one_set_log_level_controls():
    assert poptorch.logger is logging.getLogger("poptorch")
    level = poptorch.logger.level
    try:
        poptorch.setLogLevel("DEBUG")
        assert poptorch.logger.isEnabledFor(logging.DEBUG)
        poptorch.setLogLevel("ERR")
        assert not poptorch.logger.isEnabledFor(logging.WARNING)
    finally:
        poptorch.logger.setLevel(level)


def test_attribute_block_is_refused_naming_the_attributes():
    with pytest.raises(poptorch.Error, match=r"poptorch.Attribute\(__outline\) is not modelled"):
        with poptorch.Attribute(__outline={"layer": "Dense"}):
            pass


class _Timed:
    def step(self):
        return 3


def test_profiling_channel_without_libpvti_records_nothing():
    # PopTorch documents a channel as a no-op when libpvti is missing, as it is on the simulator.
    channel = poptorch.profiling.Channel("MyApp")
    timed = _Timed()
    assert channel.instrument(timed, "step") is timed and timed.step() == 3
    with channel.tracepoint("TimeThis"):
        value = timed.step()
    assert value == 3
    with pytest.raises(AttributeError, match="no method 'missing'"):
        channel.instrument(timed, "missing")


def test_testing_allclose_compares_structure_and_values():
    a, b = torch.ones(2), torch.zeros(2)
    assert poptorch.testing.allclose((a, [b]), (a.clone(), [b.clone()]))
    assert not poptorch.testing.allclose((a, [b]), (a, [a]))
    assert not poptorch.testing.allclose((a, [b]), (a, (b,)))
    assert not poptorch.testing.allclose([a, b], [a])


class _Double(torch.nn.Module):
    @poptorch.autocast(enabled=False)
    def forward(self, x):
        return x @ x


def test_autocast_regions_without_casting_work_and_casting_ones_are_refused():
    x = torch.randn(2, 2)
    out = poptorch.inferenceModel(_Double(), _opts())(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ x)
    with pytest.raises(poptorch.Error, match=r"poptorch.autocast\(\) is not modelled.*module.half\(\)"):
        poptorch.autocast()
    with pytest.raises(ValueError, match="enabled must be set to either True or False"):
        poptorch.autocast(enabled=1)


def test_autocast_enabled_option_is_stored_and_checked():
    opts = poptorch.Options()
    assert opts.Precision.autocast_enabled is True
    assert opts.Precision.autocastEnabled(False).autocast_enabled is False
    with pytest.raises(ValueError, match="autocastEnabled must be set to either True or False"):
        opts.Precision.autocastEnabled("no")


def test_config_file_error_is_exported_at_top_level():
    assert poptorch.ConfigFileError is poptorch.options.ConfigFileError


def test_use_on_chip_storage_none_clears_the_setting():
    settings = poptorch.TensorLocationSettings().useOnChipStorage(False)
    assert settings.off_chip()
    assert not settings.useOnChipStorage(None).off_chip()
    with pytest.raises(poptorch.Error, match="takes True or False"):
        settings.useOnChipStorage(0)


def test_ipu_print_tensor_refuses_formatting_it_does_not_model(capsys):
    x = torch.ones(2)
    with pytest.raises(poptorch.Error, match=r"ipu_print_tensor's formatting \(digits, open_bracket\) is not"):
        poptorch.ipu_print_tensor(x, "x", digits=2, open_bracket="(")
    with pytest.raises(TypeError, match="unexpected keyword arguments: colour"):
        poptorch.ipu_print_tensor(x, "x", colour=True)
    torch.testing.assert_close(poptorch.ipu_print_tensor(x, "x"), x)
    assert "x: [1., 1.]" in capsys.readouterr().out


def test_sharing_strategy_is_exported_with_poptorchs_members():
    import popdata

    assert poptorch.SharingStrategy is popdata.SharingStrategy
    assert [m.name for m in poptorch.SharingStrategy] == ["SharedMemory", "FileSystem", "Fork", "ForkServer"]


def test_enum_values_are_poptorchs():
    # Scripts may pass these as integers (per_replica_params tuples hold PopTorch's raw values).
    assert poptorch.VariableRetrievalMode(2) is poptorch.VariableRetrievalMode.AllReplicas
    assert poptorch.VariableRetrievalMode(0) is poptorch.VariableRetrievalMode.OnePerGroup
    behaviours = poptorch.HalfFloatCastingBehavior
    assert [behaviours(i).name for i in range(3)] == ["FloatDowncastToHalf", "HalfUpcastToFloat", "Default"]


def test_eager_mode_import_is_refused():
    with pytest.raises(poptorch.Error, match=r"eager mode \(import poptorch.eager\) is not modelled"):
        importlib.import_module("poptorch.eager")


def test_engine_options_auto_report_enables_profiling(tmp_path):
    opts = _opts()
    opts._Popart.setEngineOptions({"autoReport.all": "true", "autoReport.directory": str(tmp_path)})
    assert opts.profile_dir == str(tmp_path)
    poptorch.inferenceModel(torch.nn.Linear(2, 2), opts.modelName("engine"))(torch.ones(1, 2))
    assert (tmp_path / "engine" / "profile.json").is_file()
    unchanged = _opts()
    unchanged._Popart.setEngineOptions({"autoReport.all": "false"})
    assert unchanged.profile_dir is None
    with pytest.raises(poptorch.Error, match="writes nothing without autoReport.all"):
        _opts()._Popart.setEngineOptions({"autoReport.directory": str(tmp_path)})
