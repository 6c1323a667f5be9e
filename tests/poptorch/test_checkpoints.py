"""Checkpoints of a wrapped model: load_state_dict through the wrapper or the model, the resume recipe
(model.load_state_dict + optimizer.load_state_dict + setOptimizer), optimizer.state_dict() read while the
device is ahead, malformed optimizer states, torch.save of the model and of the wrapper. Every resumed run
is compared step by step with eager PyTorch doing the same."""

import copy
import io
import signal
import warnings

import pytest
import torch
from sgd_step import eager_step

import poptorch

OPTIMIZERS = {
    "sgd_momentum": (
        lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "adamw": (lambda p: poptorch.optim.AdamW(p, lr=0.02), lambda p: torch.optim.AdamW(p, lr=0.02)),
}
TOL = {"atol": 1e-5, "rtol": 1e-4}


class Net(torch.nn.Module):
    """A BatchNorm (buffers) and two Linears, returning the output and the loss."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.tanh(self.fc1(self.norm(x))))
        return out, self.loss(out, y)


def _data(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _assert_same_state(model, eager):
    got, want = model.state_dict(), eager.state_dict()
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _setup(optimizer):
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    ipu_opt, eager_opt = OPTIMIZERS[optimizer]
    opt = ipu_opt(model.parameters())
    training = poptorch.trainingModel(model, optimizer=opt)
    return model, opt, training, eager, eager_opt(eager.parameters())


def _train_both(training, eager, eager_opt, seeds):
    for seed in seeds:
        x, y = _data(seed)
        _, loss = training(x, y)
        torch.testing.assert_close(loss, eager_step(eager, eager_opt, x, y), **TOL)


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("through", ["wrapper", "model"])
def test_load_state_dict_while_wrapped_takes_effect_at_the_next_step(through):
    model, _, training, eager, eager_opt = _setup("sgd_momentum")
    _train_both(training, eager, eager_opt, range(2))
    torch.manual_seed(7)
    fresh = Net().state_dict()
    (training if through == "wrapper" else model).load_state_dict(fresh)
    eager.load_state_dict(fresh)
    _train_both(training, eager, eager_opt, range(2, 4))
    _assert_same_state(model, eager)


@pytest.mark.parametrize("into", ["new_optimizer", "live_optimizer"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_resume_recipe_resumes_exactly(optimizer, into):
    """Checkpoint after 2 steps, train on (the run to discard), then load the checkpoint into the live
    wrapper's model and into a new optimizer given to setOptimizer (or into the optimizer in use), and
    continue: eager from the checkpoint agrees."""
    model, opt, training, eager, eager_opt = _setup(optimizer)
    _train_both(training, eager, eager_opt, range(2))
    model_state = torch.load(_saved(model.state_dict()))
    opt_state = torch.load(_saved(opt.state_dict()))
    for seed in range(10, 13):
        training(*_data(seed))
    model.load_state_dict(model_state)
    resumed = OPTIMIZERS[optimizer][0](model.parameters()) if into == "new_optimizer" else opt
    resumed.load_state_dict(opt_state)
    if into == "new_optimizer":
        training.setOptimizer(resumed)
    _train_both(training, eager, eager_opt, range(2, 5))
    torch.testing.assert_close(resumed.state_dict()["state"], eager_opt.state_dict()["state"], **TOL)
    _assert_same_state(model, eager)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_resume_in_a_new_wrapper_resumes_exactly(optimizer):
    model, opt, training, eager, eager_opt = _setup(optimizer)
    _train_both(training, eager, eager_opt, range(2))
    checkpoint = torch.load(_saved({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    training.destroy()
    restored = Net()
    restored.load_state_dict(checkpoint["model"])
    restored_opt = OPTIMIZERS[optimizer][0](restored.parameters())
    restored_opt.load_state_dict(checkpoint["optimizer"])
    resumed = poptorch.trainingModel(restored, optimizer=restored_opt)
    _train_both(resumed, eager, eager_opt, range(2, 5))
    # The optimizer's state is read before the model's weights (which would copy everything back).
    torch.testing.assert_close(restored_opt.state_dict()["state"], eager_opt.state_dict()["state"], **TOL)
    _assert_same_state(restored, eager)


def test_optimizer_state_dict_is_current_without_reading_the_model():
    _, opt, training, eager, eager_opt = _setup("adamw")
    _train_both(training, eager, eager_opt, range(3))
    first = opt.state_dict()
    assert [float(s["step"]) for s in first["state"].values()] == [3.0] * 6
    _train_both(training, eager, eager_opt, range(3, 5))
    state = opt.state_dict()
    assert [float(s["step"]) for s in state["state"].values()] == [5.0] * 6
    want = eager_opt.state_dict()["state"]
    for index, slots in want.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state["state"][index][slot], slots[slot], **TOL)
            torch.testing.assert_close(state["ipu_state"][index][slot], slots[slot], **TOL)


def test_wrongly_shaped_optimizer_state_is_an_error_naming_parameter_and_slot():
    model, opt, training, eager, eager_opt = _setup("adamw")
    _train_both(training, eager, eager_opt, range(2))
    state = opt.state_dict()
    state["state"][2]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(poptorch.Error, match=r"'exp_avg' of parameter 2 of parameter group 0 .*shape \[3, 3\]"):
        opt.load_state_dict(state)
    # The failed load changed nothing: training goes on as eager.
    _train_both(training, eager, eager_opt, range(2, 4))
    _assert_same_state(model, eager)


def test_wrongly_shaped_state_of_a_named_torch_optimizer_names_the_parameter():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.02)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*_data(0))
    state = opt.state_dict()
    state["state"][1]["exp_avg_sq"] = torch.zeros(2)
    with pytest.raises(poptorch.Error, match=r"'exp_avg_sq' of parameter 'norm.bias' is a torch.float32 tensor"):
        opt.load_state_dict(state)


def test_cpu_or_empty_state_cannot_be_loaded_into_a_poptorch_optimizer():
    torch.manual_seed(0)
    model = Net()
    cpu = torch.optim.AdamW(model.parameters(), lr=0.02)
    eager_step(model, cpu, *_data(0))
    opt = poptorch.optim.AdamW(model.parameters(), lr=0.02)
    with pytest.raises(RuntimeError, match=r"^Only IPU optimizer states can be loaded onto the IPU\.$"):
        opt.load_state_dict(cpu.state_dict())
    with pytest.raises(RuntimeError, match=r"^Cannot load optimizer state dictionary because it is empty\.$"):
        opt.load_state_dict({})
    assert not opt.state


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_torch_save_of_the_wrapped_model_round_trips(optimizer):
    model, _, training, eager, eager_opt = _setup(optimizer)
    _train_both(training, eager, eager_opt, range(2))
    loaded = torch.load(_saved(model), weights_only=False)
    assert type(loaded) is Net
    _assert_same_state(loaded, eager)
    # The saved copy trains on its own, like eager from the same point.
    again = poptorch.trainingModel(loaded, optimizer=OPTIMIZERS[optimizer][0](loaded.parameters()))
    twin = copy.deepcopy(eager)
    twin_opt = OPTIMIZERS[optimizer][1](twin.parameters())
    _train_both(again, twin, twin_opt, range(5, 7))
    _assert_same_state(loaded, twin)
    # The original keeps training, unaffected.
    _train_both(training, eager, eager_opt, range(2, 4))
    _assert_same_state(model, eager)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_torch_save_of_the_wrapper_resumes_exactly(optimizer):
    model, _, training, eager, eager_opt = _setup(optimizer)
    _train_both(training, eager, eager_opt, range(2))
    loaded = torch.load(_saved(training), weights_only=False)
    assert isinstance(loaded, poptorch.PoplarExecutor)
    assert loaded.model is not model and type(loaded.model).__mro__[1] is Net
    _train_both(loaded, eager, eager_opt, range(2, 5))
    _assert_same_state(loaded.model, eager)


def test_torch_save_of_an_inference_wrapper_runs_with_the_trained_weights():
    model, _, training, eager, eager_opt = _setup("adamw")
    inference = poptorch.inferenceModel(model)
    _train_both(training, eager, eager_opt, range(2))
    loaded = torch.load(_saved(inference), weights_only=False)
    x, y = _data(9)
    eager.eval()
    with torch.no_grad():
        want = eager(x, y)
    for got, expected in zip(loaded(x, y), want):
        torch.testing.assert_close(got, expected, **TOL)


# -- executor state: Ctrl-C, wrapping again, a user's optimizer.step() --------------------------------------


def test_ctrl_c_in_a_long_call_keeps_the_completed_steps_and_the_executor_usable(monkeypatch):
    """SIGINT arrives during the 3rd of 6 device iterations: that optimizer step completes, the call stops
    with a KeyboardInterrupt saying so, the host reads exactly 3 steps of training, and the next call goes on
    from there, as eager does."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    options = poptorch.Options().deviceIterations(6)
    training = poptorch.trainingModel(model, options, poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 4, generator=generator), torch.randint(0, 3, (12,), generator=generator)
    training.compile(x, y)

    run_on_device, runs, handlers = poptorch._executor._run_on_device, [], []

    def interrupting(exe, feeds, program, *args):
        if feeds:
            runs.append(program)
            if len(runs) == 3:
                handlers.append(signal.getsignal(signal.SIGINT))
                signal.raise_signal(signal.SIGINT)  # to this thread, at once: a kill may be taken by another
        return run_on_device(exe, feeds, program, *args)

    monkeypatch.setattr(poptorch._executor, "_run_on_device", interrupting)
    # A process started in the background by a shell without job control inherits an ignored SIGINT (POSIX),
    # where Ctrl-C does nothing and PopTorch leaves it so: the test needs Python's default handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        training(x, y)
    except KeyboardInterrupt as interrupt:
        assert "Interrupted after 3 of 6 device iterations" in str(interrupt)
    else:  # says which premise failed: the runs seen, and the SIGINT handler when the signal was raised
        pytest.fail(f"no KeyboardInterrupt after {len(runs)} runs; SIGINT handler at the 3rd: {handlers}")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(runs) == 3
    for i in range(3):
        eager_step(eager, eager_opt, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
    _assert_same_state(model, eager)
    monkeypatch.undo()
    training(x, y)
    for i in range(6):
        eager_step(eager, eager_opt, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
    _assert_same_state(model, eager)


def test_already_wrapped_error_says_how_to_unwrap_and_model_destroy_does_it():
    model, _, training, eager, eager_opt = _setup("sgd_momentum")
    _train_both(training, eager, eager_opt, range(2))
    with pytest.raises(RuntimeError) as error:
        poptorch.trainingModel(model)
    assert str(error.value).startswith(
        "Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() on the model to unwrap it "
        "before wrapping it again."
    )
    assert "destroy() is a method of both the wrapped model and the PoplarExecutor" in str(error.value)
    model.destroy()
    assert type(model) is Net and not training.isCompiled()
    _assert_same_state(model, eager)
    rewrapped = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _train_both(rewrapped, eager, torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9), range(2, 3))
    _assert_same_state(model, eager)


def test_optimizer_step_called_by_the_user_warns_while_wrapped():
    model, opt, training, eager, eager_opt = _setup("sgd_momentum")
    _train_both(training, eager, eager_opt, range(1))
    with pytest.warns(UserWarning, match=r"optimizer.step\(\) was called on an optimizer that a poptorch"):
        opt.step()
    _train_both(training, eager, eager_opt, range(1, 2))
    _assert_same_state(model, eager)
    training.destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
