"""Optimizer hyper-parameters the host sets (setOptimizer) are placed on the tiles when they are written, as
Poplar streams them only when they change: training equals eager step by step across a change of lr and
momentum, and the step no longer exchanges them."""

import copy

import pytest
import torch

import popsim
import poptorch

SMALL = popsim.Target.small(num_tiles=16, tile_bytes=262_144)
STEPS = 4
SCHEDULE = {1: (0.02, 0.5), 2: (0.1, 0.9)}  # step -> (lr, momentum) set before it


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.fc = torch.nn.Linear(3 * 6 * 6, 4)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out, self.loss(out, labels)


@pytest.fixture(autouse=True)
def _small_target(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: SMALL)


def _batch():
    torch.manual_seed(1)
    return torch.randn(4, 1, 8, 8), torch.randint(0, 4, (4,))


def _train(model):
    """Losses and parameters after each step on the simulated IPU, lr and momentum set between steps."""
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    training = poptorch.trainingModel(model, poptorch.Options().showCompilationProgressBar(False), optimizer)
    x, labels = _batch()
    history = []
    for step in range(STEPS):
        if step in SCHEDULE:
            lr, momentum = SCHEDULE[step]
            training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
        loss = training(x, labels)[1]
        history.append((loss.item(), [p.detach().clone() for p in model.parameters()]))
    (program,) = training.profile.programs.values()
    return history, program


def test_sgd_trains_as_torch_step_by_step_when_set_optimizer_changes_lr_and_momentum():
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    history, _ = _train(model)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, labels = _batch()
    for step, (loss, params) in enumerate(history):
        if step in SCHEDULE:
            for group in cpu.param_groups:
                group["lr"], group["momentum"] = SCHEDULE[step]
        cpu.zero_grad()
        want = reference(x, labels)[1]
        want.backward()
        cpu.step()
        torch.testing.assert_close(loss, want.item(), rtol=1e-5, atol=1e-6)
        for got, expected in zip(params, reference.parameters()):
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")


def test_the_step_exchanges_less_than_when_hyper_parameters_are_broadcast_every_run(monkeypatch):
    torch.manual_seed(0)
    model = SmallCNN()
    before = copy.deepcopy(model)
    history, program = _train(model)
    # Each run broadcasting the host-written hyper-parameters again, as the step did before they were placed
    # at load: the same numbers, more exchange.
    monkeypatch.setattr(popsim.planner.Lowerer, "_scalar_loaded", popsim.planner.Lowerer._scalar_everywhere)
    broadcast_history, broadcast_program = _train(before)
    for (loss, params), (other_loss, other_params) in zip(history, broadcast_history):
        assert loss == other_loss
        for a, b in zip(params, other_params):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert program["exchange_cycles"] < broadcast_program["exchange_cycles"]
    assert program["total_cycles"] < broadcast_program["total_cycles"]


def test_set_optimizer_costs_its_host_writes_in_the_next_calls_cycles():
    """The writes go to each hyper-parameter and its copies on the tiles that read it: the next call's cycle
    count includes them as host-to-device transfers, and the call after it does not."""
    x, labels = _batch()
    calls = {}
    for set_between in (False, True):
        torch.manual_seed(0)
        model = SmallCNN()
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opts = poptorch.Options().showCompilationProgressBar(False).logCycleCount(True)
        training = poptorch.trainingModel(model, opts, optimizer)
        training(x, labels)
        written = []
        if set_between:
            exe = training._exe
            write = exe.write_variable
            exe.write_variable = lambda name, value, into=written, write=write: into.append(name) or write(name, value)
            training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
            exe.write_variable = write
        cycles, writes = [], []
        for _ in range(2):
            training(x, labels)
            cycles.append(training.cycleCount())
            programs = training.profile.programs
            intervals = next(p for p in programs.values() if "run_timeline" in p)["run_timeline"]["intervals"]
            writes.append([e for e in intervals if e.get("program") == "host write"])
        calls[set_between] = cycles, sum(training._exe.write_cycles(name) for name in written), writes
    (plain, _, no_writes), (after_set, write_cycles, writes) = calls[False], calls[True]
    assert write_cycles > 0
    assert after_set == [plain[0] + write_cycles, plain[1]]
    # On the call's timeline: the writes hold the host link before the call's runs start.
    assert no_writes == [[], []] and writes[1] == []
    (write,) = writes[0]
    assert (write["start"], write["end"]) == (0, write_cycles)
    assert "replica 0 host link" in write["lanes"] and "replica 0 IPU 0 compute" in write["lanes"]
