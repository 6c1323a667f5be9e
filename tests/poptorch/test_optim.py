"""Optimizers on the device: poptorch.optim extras, setOptimizer, parameter groups, state round trip."""

import copy
import warnings

import pytest
import torch

import poptorch


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return out, self.loss(out, y)


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _data():
    torch.manual_seed(1)
    return torch.randn(4, 4), torch.randn(4, 2)


def _close(model, reference):
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _train_both(make_ipu, make_cpu, steps=3, clip=None):
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    training = poptorch.trainingModel(model, _opts(), make_ipu(model.parameters()))
    cpu = make_cpu(reference.parameters())
    x, y = _data()
    for _ in range(steps):
        training(x, y)
        cpu.zero_grad()
        reference(x, y)[1].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        cpu.step()
    return model, reference, training


@pytest.mark.parametrize(
    ("ipu", "cpu", "clip"),
    [
        (
            lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, loss_scaling=64.0, velocity_scaling=4.0),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            None,
        ),
        (lambda p: poptorch.optim.Adam(p, lr=0.01, max_grad_norm=0.1), lambda p: torch.optim.Adam(p, lr=0.01), 0.1),
        (
            lambda p: poptorch.optim.AdamW(p, lr=0.01, weight_decay=0.1, loss_scaling=16.0),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
            None,
        ),
        (
            lambda p: poptorch.optim.RMSprop(p, lr=0.01, momentum=0.3),
            lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.3),
            None,
        ),
    ],
)
def test_poptorch_optimizers_match_torch(ipu, cpu, clip):
    model, reference, _ = _train_both(ipu, cpu, clip=clip)
    _close(model, reference)


class _LambReference(torch.optim.Optimizer):
    """LAMB as documented for poptorch.optim.LAMB, in eager torch."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"]
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat, v_hat = state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                r1, r2 = p.norm().clamp(max=65500.0), update.norm()
                trust = 1.0 if r1 == 0 or r2 == 0 else float(r1 / r2)
                p.sub_(group["lr"] * trust * update)


def test_lamb_matches_its_definition():
    model, reference, _ = _train_both(lambda p: poptorch.optim.LAMB(p, lr=0.01), lambda p: _LambReference(p, lr=0.01))
    _close(model, reference)


@pytest.mark.parametrize(
    "settings",
    [{}, {"bias_correction": False, "weight_decay": 0.1}, {"max_weight_norm": 0.5, "max_grad_norm": 0.05}],
    ids=["default", "no_bias_correction", "clipped"],
)
def test_lamb_step_on_the_cpu_matches_the_device(settings):
    """poptorch.optim.LAMB.step() runs on the host, as PopTorch's does, with the device's rule and state."""
    ipu = lambda p: poptorch.optim.LAMB(p, lr=0.01, **settings)  # noqa: E731
    model, reference, _ = _train_both(ipu, ipu)
    _close(model, reference)


def test_rmsprop_tf_variant_differs_from_torch():
    model, reference, _ = _train_both(
        lambda p: poptorch.optim.RMSprop(p, lr=0.01, use_tf_variant=True),
        lambda p: torch.optim.RMSprop(p, lr=0.01),
        steps=1,
    )
    assert not torch.allclose(model.a.weight, reference.a.weight)


def test_set_optimizer_changes_variable_lr_without_recompiling():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, _opts(), optimizer)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    cpu_scheduler = torch.optim.lr_scheduler.StepLR(cpu, step_size=1, gamma=0.5)
    x, y = _data()
    exe = None
    for _ in range(3):
        training(x, y)
        scheduler.step()
        training.setOptimizer(optimizer)
        cpu.zero_grad()
        reference(x, y)[1].backward()
        cpu.step()
        cpu_scheduler.step()
        exe = exe or training._exe
        assert training._exe is exe
    _close(model, reference)


def test_constant_attributes_cannot_change():
    torch.manual_seed(0)
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    training(*_data())
    with pytest.raises(poptorch.Error, match="momentum"):
        training.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    training.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5))


def test_explicit_poptorch_attributes_are_variable():
    torch.manual_seed(0)
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    training(*_data())
    training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0))
    with pytest.raises(ValueError, match="accum_type is already compiled"):
        training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5, accum_type=torch.half))


def test_parameter_group_with_lr_zero_is_bit_identical():
    torch.manual_seed(0)
    model = Regressor()
    frozen = model.a.weight.detach().clone()
    groups = [{"params": [model.a.weight], "lr": 0.0}, {"params": [model.a.bias, *model.b.parameters()]}]
    training = poptorch.trainingModel(model, _opts(), torch.optim.Adam(groups, lr=0.01))
    training(*_data())
    training(*_data())
    assert torch.equal(model.a.weight, frozen)
    assert not torch.equal(model.b.weight, model.b.weight.detach() * 0)


def test_state_dict_round_trip_continues_like_torch():
    """Train 2 steps on the IPU, copy the optimizer state into eager torch, continue both: they agree."""
    model, reference, training = _train_both(
        lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01), steps=2
    )
    training.copyWeightsToHost()
    state = training._optimizer.state_dict()
    assert state["state"][0]["step"] == 2
    continued = copy.deepcopy(model)
    cpu = torch.optim.Adam(continued.parameters(), lr=0.01)
    cpu.load_state_dict(state)
    x, y = _data()
    cpu.zero_grad()
    continued(x, y)[1].backward()
    cpu.step()
    training(x, y)
    _close(model, continued)


def test_poptorch_state_dict_load_rules():
    model = Regressor()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(poptorch.Error, match="^Only IPU optimizer states can be loaded onto the IPU.$"):
        optimizer.load_state_dict(torch.optim.Adam(model.parameters(), lr=0.01).state_dict())
    optimizer.load_state_dict(poptorch.optim.Adam(model.parameters(), lr=0.01).state_dict())


def test_amsgrad_and_subclass_warning():
    model = Regressor()
    with pytest.raises(ValueError, match="amsgrad"):
        poptorch.optim.Adam(model.parameters(), amsgrad=True)

    class Custom(torch.optim.SGD):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        poptorch.trainingModel(model, _opts(), Custom(model.parameters(), lr=0.1))
    assert any("Poptorch does not run Python optimizer code directly" in str(w.message) for w in caught)


def test_default_optimizer_is_sgd_lr_0_01():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    poptorch.trainingModel(model, _opts())(*_data())
    cpu = torch.optim.SGD(reference.parameters(), lr=0.01)
    reference(*_data())[1].backward()
    cpu.step()
    _close(model, reference)


def test_variable_momentum_set_after_zero_starts_afresh_as_torch():
    """While momentum is 0 torch leaves its buffer untouched (and creates none): a momentum set later goes on
    from the buffer as it was, or starts from that step's gradient."""
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    training = poptorch.trainingModel(model, _opts(), optimizer)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.0)
    x, y = _data()
    for momentum in (0.0, 0.0, 0.9, 0.9, 0.0, 0.5):
        for group, cpu_group in zip(optimizer.param_groups, cpu.param_groups):
            group["momentum"] = cpu_group["momentum"] = momentum
        training.setOptimizer(optimizer)
        training(x, y)
        cpu.zero_grad()
        reference(x, y)[1].backward()
        cpu.step()
        _close(model, reference)


def test_variable_attributes_choose_what_set_optimizer_may_change():
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    attrs = optimizer.variable_attrs
    assert not attrs.isConstant("lr") and attrs.isConstant("momentum")
    attrs.markAsVariable("momentum")
    attrs.markAsConstant("lr")
    with pytest.raises(poptorch.Error, match="Unknown attribute nesterov, allowed values"):
        attrs.markAsVariable("nesterov")
    training = poptorch.trainingModel(model, _opts(), optimizer)
    cpu = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _data()
    for momentum in (0.9, 0.5, 0.5):
        for group, cpu_group in zip(optimizer.param_groups, cpu.param_groups):
            group["momentum"] = cpu_group["momentum"] = momentum
        training.setOptimizer(optimizer)
        training(x, y)
        cpu.zero_grad()
        reference(x, y)[1].backward()
        cpu.step()
    _close(model, reference)
    optimizer.param_groups[0]["lr"] = 0.05
    with pytest.raises(poptorch.Error, match="lr of parameter group 0 was compiled in as a constant"):
        training.setOptimizer(optimizer)


@pytest.mark.parametrize("cls", [poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW, poptorch.optim.RMSprop])
def test_maximize_is_refused_not_ignored(cls):
    model = Regressor()
    with pytest.raises(poptorch.Error, match="maximize=True is not supported"):
        poptorch.trainingModel(model, _opts(), cls(model.parameters(), lr=0.01, maximize=True))


def test_sgd_combined_accumulator_variant_trains_as_torch():
    model, reference, _ = _train_both(
        lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, use_combined_accum=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )
    _close(model, reference)


def _compute_sets(optimizer_of):
    torch.manual_seed(0)
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), optimizer_of(model.parameters()))
    training(*_data())
    (program,) = training.profile.programs.values()
    return sum(step["kind"] == "compute" for step in program["steps"])


def test_a_variable_momentum_adds_one_predicate_per_group_not_a_step_per_parameter():
    """The momentum-0 test of a variable momentum is computed once per group and selected inside each
    parameter's fused buffer and parameter updates: one compute set more than a constant momentum."""
    constant = _compute_sets(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    variable = _compute_sets(lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert variable == constant + 1
