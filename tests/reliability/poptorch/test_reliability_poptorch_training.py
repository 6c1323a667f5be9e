"""Catalogue: bad training set-ups, optimizers and options. Each case asserts the clear error and that the
weights and optimizer state it could have touched are as before (training then goes on as in eager)."""

import json
import subprocess
import sys

import pytest
import torch

import poptorch

error = pytest.mark.outcome("clear error")
right = pytest.mark.outcome("right result")

X = torch.linspace(-1, 1, 8).reshape(4, 2)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x):
        return poptorch.identity_loss(self.linear(x).pow(2).sum(), "sum")


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _eager_steps(steps, lr=0.1, momentum=0.0):
    module = Regression()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    for _ in range(steps):
        optimizer.zero_grad()
        module(X).backward()
        optimizer.step()
    return _weights(module)


def _assert_weights(module, expected):
    for name, value in _weights(module).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


def _trained(optimizer_factory=None, steps=1):
    module = Regression()
    optimizer = (optimizer_factory or (lambda p: poptorch.optim.SGD(p, lr=0.1)))(module.parameters())
    model = poptorch.trainingModel(module, _opts(), optimizer)
    for _ in range(steps):
        model(X)
    return module, model


@error
def test_accum_type_changed_by_set_optimizer_keeps_the_compiled_optimizer():
    module, model = _trained(lambda p: poptorch.optim.SGD(p, lr=0.1, accum_type=torch.float32))
    other = poptorch.optim.SGD(module.parameters(), lr=0.1, accum_type=torch.float16)
    with pytest.raises(ValueError, match="accum_type is already compiled.*float32.*float16.*destroy"):
        model.setOptimizer(other)
    model(X)
    _assert_weights(module, _eager_steps(2))


@error
def test_set_optimizer_of_another_type():
    module, model = _trained()
    with pytest.raises(poptorch.Error, match="same type and parameter groups"):
        model.setOptimizer(poptorch.optim.Adam(module.parameters(), lr=0.1))
    model(X)
    _assert_weights(module, _eager_steps(2))


@error
def test_set_optimizer_changing_a_compiled_in_constant():
    module, model = _trained(lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(poptorch.Error, match="momentum of parameter group 0 was compiled in as a constant"):
        model.setOptimizer(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    model(X)
    _assert_weights(module, _eager_steps(2))


@error
def test_adam_amsgrad():
    with pytest.raises(ValueError, match="amsgrad=True is not supported on the IPU"):
        poptorch.optim.Adam(Regression().parameters(), amsgrad=True)


@error
def test_loading_a_cpu_optimizer_state():
    module, model = _trained()
    cpu_state = torch.optim.SGD(module.parameters(), lr=0.1).state_dict()
    with pytest.raises(poptorch.Error, match="Only IPU optimizer states can be loaded onto the IPU."):
        poptorch.optim.SGD(module.parameters(), lr=0.1).load_state_dict(cpu_state)


@error
def test_training_model_without_a_loss():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.linear(x)

    module = NoLoss()
    before = _weights(module)
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        poptorch.trainingModel(module, _opts())(X)
    _assert_weights(module, before)


@error
def test_training_model_with_two_independent_losses():
    class TwoLosses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x):
            y = self.linear(x)
            return poptorch.identity_loss(y.sum(), "sum"), poptorch.identity_loss(y.pow(2).sum(), "sum")

    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph"):
        poptorch.trainingModel(TwoLosses(), _opts())(X)


@error
def test_inference_model_with_gradient_accumulation():
    opts = _opts()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation"):
        poptorch.inferenceModel(Regression(), opts)(X)


@error
def test_changing_options_a_wrapper_uses():
    opts = _opts()
    poptorch.inferenceModel(Regression(), opts)
    with pytest.raises(poptorch.Error):
        opts.deviceIterations(2)


@error
def test_output_mode_every_n_not_dividing_the_iterations():
    opts = _opts().deviceIterations(3).outputMode(poptorch.OutputMode.EveryN, 2)
    with pytest.raises(poptorch.Error, match=r"EveryN\(2\) needs a period dividing the 3 iterations"):
        poptorch.inferenceModel(torch.nn.Identity(), opts)(torch.ones(3, 1))


@error
def test_jit_trace_model():
    with pytest.raises(poptorch.Error):
        _opts().Jit.traceModel(True)


@error
@pytest.mark.parametrize("tiles", [31, 33, 194])
def test_io_tiles_outside_the_allowed_set(tiles):
    with pytest.raises((poptorch.Error, ValueError)):
        _opts().TensorLocations.numIOTiles(tiles)


@error
def test_unknown_option_in_the_default_options_variable(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps({"noSuchOption": 2}))
    with pytest.raises(poptorch.Error, match="noSuchOption"):
        poptorch.Options()


@right
def test_a_failed_call_leaves_training_state_as_it_was():
    module, model = _trained(lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9), steps=2)
    with pytest.raises(poptorch.Error, match="expected torch.Size"):
        model(torch.ones(3, 2))
    model(X)
    _assert_weights(module, _eager_steps(3, momentum=0.9))


@right
def test_training_after_detach_and_reattach():
    module, model = _trained(steps=1)
    model.detachFromDevice()
    model(X)
    _assert_weights(module, _eager_steps(2))


@right
def test_nan_loss_is_reported_not_hidden():
    module, model = _trained(steps=0)
    loss = model(torch.tensor([[float("nan"), 0.0]] * 4))
    assert torch.isnan(loss)


@error
def test_cache_max_bytes_that_is_not_a_number(monkeypatch, tmp_path):
    monkeypatch.setenv("POPTORCH_CACHE_MAX_BYTES", "abc")
    module = Regression()
    before = _weights(module)
    with pytest.raises(poptorch.Error, match="POPTORCH_CACHE_MAX_BYTES must be a positive whole number.*'abc'"):
        poptorch.trainingModel(module, _opts().enableExecutableCaching(str(tmp_path)))(X)
    _assert_weights(module, before)


@error
def test_model_too_large_for_the_ipu_is_refused_from_sizes_in_a_subprocess():
    # 5 x Linear(4096, 4096) holds 335 MB of weights, more than an ipu1's 318 MB of tile memory.
    script = (
        "import torch, poptorch\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(5)])\n"
        "opts = poptorch.Options().showCompilationProgressBar(False).ipuVersion('ipu1')\n"
        "try:\n"
        "    poptorch.inferenceModel(model, opts)(torch.ones(1, 4096))\n"
        "except poptorch.Error as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "the program set needs at least 335," in run.stdout, run.stderr[-2000:]
    assert "318,767,104 bytes of ipu1's 1,216 tiles" in run.stdout
