"""PoplarExecutor through inferenceModel/trainingModel: running, weight sync, device state, introspection."""

import copy

import pytest
import torch
from regressor import Regressor
from regressor import quiet_options as _opts
from regressor import regression_data as _data

import poptorch


def test_inference_matches_eager_and_structures_outputs():
    torch.manual_seed(0)

    class Multi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            y = self.fc(x)
            return {"a": y, "b": (y.sum(dim=1), [y.argmax(dim=1)])}

    model = Multi()
    x = torch.randn(3, 4)
    out = poptorch.inferenceModel(model, _opts())(x)
    ref = model(x)
    assert list(out) == ["a", "b"]
    torch.testing.assert_close(out["a"], ref["a"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["b"][0], ref["b"][0], rtol=1e-5, atol=1e-5)
    assert out["b"][1][0].dtype == torch.int32
    assert torch.equal(out["b"][1][0].long(), ref["b"][1][0])


def test_training_updates_host_weights_on_read():
    model = Regressor()
    before = model.fc.weight.detach().clone()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    training(*_data())
    assert not torch.equal(model.fc.weight, before)
    assert not torch.equal(dict(model.named_parameters())["fc.weight"], before)
    assert not torch.equal(model.state_dict()["fc.weight"], before)


def test_copy_weights_to_device_overwrites_device_training():
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    training(x, y)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    training.copyWeightsToDevice()
    inference = poptorch.inferenceModel(model, _opts())
    out, _ = inference(x, y)
    assert torch.equal(out, torch.zeros_like(out))


def test_inference_sees_trained_weights():
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    inference = poptorch.inferenceModel(model, _opts())
    x, y = _data()
    first, _ = inference(x, y)
    training(x, y)
    second, _ = inference(x, y)
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, model.fc(x), rtol=1e-5, atol=1e-6)


def test_attach_detach_destroy_and_recompile():
    model = Regressor()
    training = poptorch.trainingModel(model, _opts())
    assert not training.isCompiled()
    training.compile(*_data())
    assert training.isCompiled() and training.isAttachedToDevice()
    training.detachFromDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        training.detachFromDevice()
    training.attachToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        training.attachToDevice()
    training(*_data())
    training.destroy()
    assert not training.isCompiled()
    assert type(model) is Regressor
    training = poptorch.trainingModel(model, _opts())
    out, loss = training(*_data(8))
    assert out.shape == (8, 3)


def test_cycle_count_perf_counters_and_forwarding():
    model = Regressor()
    inference = poptorch.inferenceModel(model, _opts())
    inference(*_data())
    with pytest.raises(poptorch.Error, match="logCycleCount"):
        inference.cycleCount()
    model2 = Regressor()
    counted = poptorch.inferenceModel(model2, _opts().logCycleCount(True).deviceIterations(2))
    counted(*_data())
    assert counted.cycleCount() > 0
    perf = counted.getPerfCounters()
    assert set(perf) == {"input", "input_complete", "output", "output_complete"}
    assert len(perf["input"]) == 2 and len(perf["input"][0]) == 2
    assert counted.fc is model2.fc
    assert counted.profile is not None


def test_wrapping_twice_and_backward_raise():
    model = Regressor()
    training = poptorch.trainingModel(model, _opts())
    with pytest.raises(RuntimeError, match="Model has already been wrapped in 'poptorch.trainingModel'"):
        poptorch.trainingModel(model, _opts())
    _, loss = training(*_data())
    with pytest.raises(RuntimeError, match=r"backward\(\) cannot be called explicitly on outputs of a PopTorch model"):
        loss.backward()
    assert type(loss * 2) is torch.Tensor


def test_non_tensor_argument_is_compiled_in():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * scale

    model = poptorch.inferenceModel(Scaled(), _opts())
    x = torch.ones(2, 2)
    assert torch.equal(model(x, 3.0), x * 3)
    with pytest.raises(poptorch.Error, match="compiled into the model"):
        model(x, 4.0)


def test_in_place_input_update_copied_back():
    class Bump(torch.nn.Module):
        def forward(self, x):
            x.add_(1.0)
            return x * 2

    x = torch.zeros(2, 3)
    out = poptorch.inferenceModel(Bump(), _opts())(x)
    assert torch.equal(x, torch.ones(2, 3))
    assert torch.equal(out, torch.full((2, 3), 2.0))


def test_buffers_are_trained_and_synced():
    torch.manual_seed(0)

    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return poptorch.identity_loss(self.bn(x).sum(), "none")

    model = Normed()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 4)
    poptorch.trainingModel(model, _opts())(x)
    ref(x)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-5, atol=1e-6)


def test_legacy_signatures_map_to_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(net)
    x, y = _data(8)
    with pytest.warns(DeprecationWarning):
        training = poptorch.trainingModel(
            net, 2, loss=torch.nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), profile=True
        )
    out, loss = training(x, y)
    assert out.shape == (4, 3) and loss.shape == ()
    assert (tmp_path / "profile.json").exists()
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        cpu.zero_grad()
        torch.nn.functional.mse_loss(reference(xs), ys).backward()
        cpu.step()
    torch.testing.assert_close(net.weight, reference.weight, rtol=1e-5, atol=1e-6)
    with pytest.warns(DeprecationWarning):
        inference = poptorch.inferenceModel(torch.nn.Linear(4, 3), device_iterations=4)
    assert inference.options.device_iterations == 4
