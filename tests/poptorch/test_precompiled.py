"""compileAndExport / poptorch.load / loadExecutable: an exported model runs in a fresh process without
compiling and gives the results of the model it was exported from."""

import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
from poptorch import _device


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_exported_inference_model_runs_in_a_fresh_process(tmp_path):
    net, x = _net(), torch.randn(3, 4)
    path = tmp_path / "net.poptorch"
    poptorch.inferenceModel(net, _opts()).compileAndExport(str(path), x)
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(
        f"""
        import torch, poptorch
        from poptorch import _device
        def refuse(*args, **kwargs):
            raise AssertionError("compiled instead of loading")
        _device.compile_programs = refuse
        model = poptorch.load({str(path)!r})
        torch.save(model(torch.load({str(tmp_path / "x.pt")!r})).clone(), {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), net(x), rtol=1e-5, atol=1e-5)


def test_exported_training_model_trains_like_the_original(tmp_path, monkeypatch):
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.mse_loss(out, y)

    reference = WithLoss()
    trained = poptorch.trainingModel(reference, _opts(), torch.optim.SGD(reference.parameters(), lr=0.1))
    path = tmp_path / "train.poptorch"
    exported = WithLoss()
    wrapper = poptorch.trainingModel(exported, _opts(), torch.optim.SGD(exported.parameters(), lr=0.1))
    wrapper.compileAndExport(str(path), x, y, export_model=False)
    wrapper.destroy()

    monkeypatch.setattr(_device, "compile_programs", lambda *a, **k: pytest.fail("compiled instead of loading"))
    fresh = WithLoss()
    loaded = poptorch.trainingModel(fresh, _opts(), torch.optim.SGD(fresh.parameters(), lr=0.1))
    loaded.loadExecutable(str(path))
    monkeypatch.undo()
    for _ in range(2):
        torch.testing.assert_close(loaded(x, y)[1], trained(x, y)[1])
    torch.testing.assert_close(fresh.net[0].weight, reference.net[0].weight)


def test_loading_refuses_another_model_and_damaged_files(tmp_path):
    x = torch.randn(3, 4)
    path = tmp_path / "net.poptorch"
    poptorch.inferenceModel(_net(), _opts()).compileAndExport(str(path), x, export_model=False)
    other = poptorch.inferenceModel(torch.nn.Sequential(torch.nn.Linear(4, 2)), _opts())
    with pytest.raises(poptorch.Error, match="compiled for another model"):
        other.loadExecutable(str(path))
    with pytest.raises(poptorch.Error, match="holds no model"):
        poptorch.load(str(path))
    with pytest.raises(poptorch.Error, match="holds a inferenceModel|holds an inferenceModel|holds a"):
        poptorch.trainingModel(_net(), _opts()).loadExecutable(str(path))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(poptorch.Error, match="damaged"):
        poptorch.inferenceModel(_net(), _opts()).loadExecutable(str(path))
    (tmp_path / "junk").write_bytes(b"not a model")
    with pytest.raises(poptorch.Error, match="not a file written by compileAndExport"):
        poptorch.load(str(tmp_path / "junk"))


def test_save_exports_a_compiled_model_that_loads_without_compiling(tmp_path, monkeypatch):
    net, x = _net(), torch.randn(3, 4)
    model = poptorch.inferenceModel(net, _opts())
    with pytest.raises(poptorch.Error, match="save\\(\\) needs a compiled model"):
        model.save(str(tmp_path / "early.poptorch"))
    expected = model(x)
    path = tmp_path / "net.poptorch"
    model.save(str(path))
    model.destroy()

    def refuse(*args, **kwargs):
        raise AssertionError("compiled instead of loading")

    monkeypatch.setattr(_device, "compile_programs", refuse)
    torch.testing.assert_close(poptorch.load(str(path))(x), expected)


def test_a_model_exported_for_an_offline_target_runs_once_loaded(tmp_path, monkeypatch):
    # As PopTorch's precompilation guide: compile without a device, then load and run on one.
    net, x = _net(), torch.randn(3, 4)
    path = tmp_path / "offline.poptorch"
    offline = poptorch.inferenceModel(net, _opts().useOfflineIpuTarget(2))
    offline.compileAndExport(str(path), x)
    with pytest.raises(poptorch.Error, match="ConnectionType.Never"):
        offline(x)
    monkeypatch.setattr(_device, "compile_programs", lambda *a, **k: pytest.fail("compiled instead of loading"))
    loaded = poptorch.load(str(path))
    assert loaded.options.connection_type == poptorch.ConnectionType.Always
    torch.testing.assert_close(loaded(x), net(x), rtol=1e-5, atol=1e-5)
