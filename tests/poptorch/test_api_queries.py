"""PopTorch's executor queries, hardware queries, hooks, custom argument parsers, logging and errors."""

import dataclasses
import logging
import math
import sys

import pytest
import torch

import poptorch
from poptorch import _logging


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def test_hardware_queries_answer_as_a_simulated_device():
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(4) is False
    with pytest.raises(poptorch.Error, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()
    with pytest.raises(poptorch.Error, match="positive number of IPUs"):
        poptorch.ipuHardwareIsAvailable(0)


def test_mlir_platform_query_answers_no_mlir_compiler():
    # Guide scripts gate MLIR-only code on this query under either spelling; the simulator has no MLIR compiler.
    assert poptorch.hasMlirSupportOnPlatform() is False
    assert poptorch.hasMLIRSupportOnPlatform() is False


class _Branching(torch.nn.Module):
    def forward(self, x):
        return x * 2 if poptorch.isRunningOnIpu() else x * 3


def test_is_running_on_ipu_selects_the_device_branch():
    x = torch.ones(2, 2)
    assert torch.equal(_Branching()(x), x * 3)
    assert torch.equal(poptorch.inferenceModel(_Branching(), _opts())(x), x * 2)
    assert not poptorch.isRunningOnIpu()


def test_compile_hooks_run_around_each_compilation():
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2), _opts())
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert calls == ["pre", "post"]
    pre.remove()
    post.remove()
    poptorch.inferenceModel(torch.nn.Linear(2, 2), _opts())(torch.ones(1, 2))
    assert calls == ["pre", "post"]


def test_compilation_time_and_latencies():
    model = poptorch.inferenceModel(torch.nn.Linear(8, 4), _opts().deviceIterations(2))
    with pytest.raises(poptorch.Error, match="not been compiled"):
        model.compilationTime()
    model(torch.randn(4, 8))
    assert model.compilationTime() > 0
    low, high, mean = model.getLatency()
    assert 0 < low <= mean <= high
    host_ipu, compute, ipu_host = (
        f()[2] for f in (model.getHostIpuLatency, model.getComputeLatency, model.getIpuHostLatency)
    )
    target = model.profile.target

    def streaming(nbytes):
        return math.ceil(nbytes / target.host_bytes_per_second * target.clock_hz) / target.clock_hz

    # 2 x 8 float32 inputs and 2 x 4 outputs per micro-batch, at the host link's bandwidth.
    assert host_ipu == pytest.approx(streaming(64))
    assert ipu_host == pytest.approx(streaming(32))
    assert compute > 0
    assert host_ipu + compute + ipu_host == pytest.approx(mean)


class _Noisy(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


def test_seeds_differing_only_above_bit_31_draw_different_numbers():
    x = torch.ones(4, 64)
    draws = [poptorch.inferenceModel(_Noisy(), _opts().randomSeed(seed))(x) for seed in (5, 5, 5 + 2**40, 5 + 2**31)]
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[3])
    assert not torch.equal(draws[2], draws[3])


def test_rng_state_replays_device_randomness():
    model = poptorch.inferenceModel(_Noisy(), _opts().randomSeed(5))
    x = torch.ones(4, 16)
    model(x)
    state = model.rng_state
    assert len(state) == 2
    first = model(x)
    second = model(x)
    assert not torch.equal(first, second)
    model.rng_state = state
    assert torch.equal(model(x), first)
    with pytest.raises(poptorch.Error, match="2 integers"):
        model.rng_state = [1, 2, 3]
    plain = poptorch.inferenceModel(torch.nn.Linear(2, 2), _opts())
    plain(torch.ones(1, 2))
    assert plain.rng_state == []


class _Offset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.zeros(3))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return x * self.scale + self.offset


def test_copy_named_buffers_to_device_uploads_the_named_buffers():
    module = _Offset()
    model = poptorch.inferenceModel(module, _opts().updatableNamedBuffers(["offset"]))
    x = torch.ones(1, 3)
    model(x)
    module.offset.fill_(2.0)
    model.copyNamedBuffersToDevice()
    assert torch.equal(model(x), x + 2)
    unnamed = poptorch.inferenceModel(_Offset(), _opts())
    unnamed(x)
    with pytest.raises(poptorch.Error, match="updatableNamedBuffers"):
        unnamed.copyNamedBuffersToDevice()


def test_copy_weights_to_host_if_needed():
    model = torch.nn.Linear(2, 1)
    training = poptorch.trainingModel(torch.nn.Sequential(model), _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert training.copyWeightsToHostIfNeeded() is False
    x = torch.ones(2, 2)

    class _Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = model

        def forward(self, x):
            return poptorch.identity_loss(self.fc(x).sum(), "none")

    training.destroy()
    wrapped = poptorch.trainingModel(_Loss(), _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped(x)
    assert wrapped.copyWeightsToHostIfNeeded() is True
    assert wrapped.copyWeightsToHostIfNeeded() is False


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    tag: str = "batch"


class _BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.image
        yield struct.label

    def reconstruct(self, original_structure, tensor_iterator):
        return Batch(next(tensor_iterator), next(tensor_iterator), original_structure.tag)


poptorch.registerCustomArgParser(Batch, _BatchParser())


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, batch):
        return self.fc(batch.image).argmax(-1) == batch.label


def test_custom_arg_parser_feeds_the_tensors_of_a_custom_type():
    torch.manual_seed(0)
    module = _Classifier()
    model = poptorch.inferenceModel(module, _opts().deviceIterations(2))
    for _ in range(2):
        batch = Batch(torch.randn(4, 4), torch.randint(0, 3, (4,)))
        assert torch.equal(model(batch), module(batch))
    with pytest.raises(poptorch.Error, match="ICustomArgParser"):
        poptorch.registerCustomArgParser(Batch, object())


# -- logging and errors ------------------------------------------------------------------------------
def test_set_log_level_names_and_legacy_integers():
    level = _logging.logger.level
    try:
        poptorch.setLogLevel("TRACE_ALL")
        assert _logging.logger.isEnabledFor(_logging.TRACE_ALL)
        poptorch.setLogLevel("DEBUG")
        assert _logging.logger.level == logging.DEBUG
        poptorch.setLogLevel(2)
        assert _logging.logger.level == logging.INFO
        with pytest.raises(
            ValueError, match="Unknown log level: LOUD. Valid values are DEBUG, ERR, INFO, OFF, TRACE and WARN"
        ):
            poptorch.setLogLevel("LOUD")
        with pytest.raises(ValueError, match="Invalid log level integer"):
            poptorch.setLogLevel(5)
    finally:
        _logging.logger.setLevel(level)


def _fresh_level(env):
    """The poptorch logger's level in a fresh process with ``env``. ``import poptorch`` imports the logging
    module, which reads POPTORCH_LOG_LEVEL when imported; the process imports that module alone (by its
    path), so it does not pay for importing torch."""
    import subprocess

    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('probe', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.logger.level)"
    )
    return subprocess.run([sys.executable, "-c", code, _logging.__file__], env=env, capture_output=True, text=True)


def test_log_level_environment(monkeypatch):
    import os

    env = dict(os.environ)
    env.pop("POPTORCH_LOG_LEVEL", None)
    assert _fresh_level(env).stdout.strip() == str(logging.WARNING)
    env["POPTORCH_LOG_LEVEL"] = "TRACE_ALL"
    assert _fresh_level(env).stdout.strip() == str(_logging.TRACE_ALL)
    env["POPTORCH_LOG_LEVEL"] = "CHATTY"
    failed = _fresh_level(env)
    assert failed.returncode != 0 and "POPTORCH_LOG_LEVEL" in failed.stderr


def test_error_attributes():
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(torch.nn.Linear(2, 2), _opts())(torch.ones(1, 3))
    error = info.value
    assert error.message == str(error) and error.message
    assert error.type == "Error" and error.location == ""
    recoverable = poptorch.RecoverableError("device failed", recovery_action="IPU_RESET")
    assert isinstance(recoverable, poptorch.Error) and recoverable.recovery_action == "IPU_RESET"
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)


def test_capture_errors_carry_the_source_location():
    class _Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(5, 2, scale_grad_by_freq=True)

        def forward(self, x):
            return self.embedding(x) * 2

    with pytest.raises(poptorch.Error, match="scale_grad_by_freq") as info:
        poptorch.inferenceModel(_Embed(), _opts())(torch.tensor([[1, 2]]))
    assert "test_api_queries.py" in info.value.location and "self.embedding(x)" in info.value.location
