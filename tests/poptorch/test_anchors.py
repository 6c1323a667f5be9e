"""Anchored tensors: Options.anchorTensor, getAnchoredTensor and getTensorNames, against eager PyTorch."""

import copy

import pytest
import torch

import poptorch

LR = 0.1
BATCH = 2


class Model(torch.nn.Module):
    """The user guide's anchoring example: two linear layers and an MSE loss."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 5)
        self.fc2 = torch.nn.Linear(5, 3)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, labels):
        return self.loss(self.fc2(torch.relu(self.fc1(x))), labels)


def _eager_steps(model, xs, ys, micro_batches=1):
    """Eager SGD steps over the chunks of xs/ys (each step averaging ``micro_batches`` micro-batch
    gradients); returns per step (fc2.bias gradient, fc2.weight after the step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step_x, step_y in zip(xs.split(BATCH * micro_batches), ys.split(BATCH * micro_batches)):
        optimizer.zero_grad()
        for x, y in zip(step_x.split(BATCH), step_y.split(BATCH)):
            (model(x, y) / micro_batches).backward()
        optimizer.step()
        steps.append((model.fc2.bias.grad.clone(), model.fc2.weight.detach().clone()))
    return steps


def _anchored_training(model, opts, mode=None, period=1):
    opts.anchorTensor("grad_bias", "Gradient___model.fc2.bias", mode, period)
    opts.anchorTensor("update_weight", "UpdatedVar___model.fc2.weight", mode, period)
    return poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=LR))


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def _select(values, mode, period):
    """What one call returns of its per-step ``values`` in ``mode``."""
    if mode == poptorch.OutputMode.Final:
        return values[-1]
    if mode == poptorch.OutputMode.Sum:
        return torch.stack(values).sum(0)
    if mode == poptorch.OutputMode.EveryN:
        values = values[period - 1 :: period]
    return values[0] if len(values) == 1 else torch.stack(values)


@pytest.mark.parametrize(
    ("mode", "period", "iterations"),
    [
        (poptorch.OutputMode.All, 1, 4),
        (poptorch.OutputMode.Final, 1, 4),
        (poptorch.OutputMode.EveryN, 2, 4),
        (poptorch.OutputMode.Sum, 1, 4),
        # The default follows the model's output mode, Final for a training model: one value, no leading dimension.
        (None, 1, 3),
    ],
)
def test_gradient_and_updated_weight_match_eager_step_by_step(mode, period, iterations):
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    poptorch_model = _anchored_training(model, poptorch.Options().deviceIterations(iterations), mode, period)
    returned = mode or poptorch.OutputMode.Final
    for _ in range(2):
        x, y = torch.randn(iterations * BATCH, 4), torch.randn(iterations * BATCH, 3)
        poptorch_model(x, y)
        grads, weights = zip(*_eager_steps(reference, x, y))
        _close(poptorch_model.getAnchoredTensor("grad_bias"), _select(list(grads), returned, period))
        _close(poptorch_model.getAnchoredTensor("update_weight"), _select(list(weights), returned, period))


@pytest.mark.parametrize(
    ("configure", "iterations", "mode"),
    [
        # Two steps of two accumulated micro-batches: each step's gradient is their mean, the one it applies.
        (lambda opts: opts.Training.gradientAccumulation(2), 2, poptorch.OutputMode.All),
        # One step over two replicas' micro-batches: the mean of their gradients, reduced over the replicas.
        (lambda opts: opts.replicationFactor(2), 1, None),
    ],
    ids=["gradient_accumulation", "replicas"],
)
def test_the_anchored_gradient_is_the_mean_over_the_micro_batches_the_step_applies(configure, iterations, mode):
    torch.manual_seed(2)
    model, micro_batches = Model(), 2
    reference = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(iterations)
    configure(opts)
    poptorch_model = _anchored_training(model, opts, mode)
    rows = iterations * micro_batches * BATCH
    x, y = torch.randn(rows, 4), torch.randn(rows, 3)
    poptorch_model(x, y)
    grads, weights = zip(*_eager_steps(reference, x, y, micro_batches=micro_batches))
    returned = mode or poptorch.OutputMode.Final
    _close(poptorch_model.getAnchoredTensor("grad_bias"), _select(list(grads), returned, 1))
    _close(poptorch_model.getAnchoredTensor("update_weight"), _select(list(weights), returned, 1))


def test_inference_anchors_a_parameter():
    model = torch.nn.Linear(4, 3)
    opts = poptorch.Options()
    opts.anchorTensor("w", "model.weight")
    poptorch_model = poptorch.inferenceModel(model, opts)
    poptorch_model(torch.randn(2, 4))
    torch.testing.assert_close(poptorch_model.getAnchoredTensor("w"), model.weight.detach())


def test_tensor_names_list_parameters_gradients_and_updated_values():
    model = Model()
    poptorch_model = poptorch.trainingModel(model)
    with pytest.raises(AssertionError, match="Model must be compiled before calling getTensorNames"):
        poptorch_model.getTensorNames()
    poptorch_model(torch.randn(BATCH, 4), torch.randn(BATCH, 3))
    names = poptorch_model.getTensorNames()
    for fqn, _ in model.named_parameters():
        assert {f"model.{fqn}", f"Gradient___model.{fqn}", f"UpdatedVar___model.{fqn}"} <= set(names)
    assert any(name.startswith("scaledLearningRate") for name in names)  # as PopTorch's own test checks


def test_unknown_names_raise_poptorchs_errors():
    opts = poptorch.Options()
    opts.anchorTensor("grad_bias", "Gradient___model.fc2.bias")
    poptorch_model = poptorch.trainingModel(Model(), opts)
    with pytest.raises(AssertionError, match="No tensor with name grad_bias found."):
        poptorch_model.getAnchoredTensor("grad_bias")  # nothing has run yet
    poptorch_model(torch.randn(BATCH, 4), torch.randn(BATCH, 3))
    with pytest.raises(AssertionError, match="No tensor with name other found."):
        poptorch_model.getAnchoredTensor("other")

    opts = poptorch.Options()
    opts.anchorTensor("grad_bias", "Gradient___fc3.bias")  # the model has no fc3
    poptorch_model = poptorch.trainingModel(Model(), opts)
    with pytest.raises(poptorch.Error, match="no tensor named 'Gradient___fc3.bias'.*Gradient___model.fc2.bias"):
        poptorch_model(torch.randn(BATCH, 4), torch.randn(BATCH, 3))


def test_an_anchor_is_streamed_to_the_host_and_costed_as_a_host_transfer():
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)

    def host_cycles(opts):
        poptorch_model = poptorch.trainingModel(Model(), opts)
        poptorch_model(x, y)
        return poptorch_model.profile.programs["train"]["host_cycles"]

    anchored = poptorch.Options()
    anchored.anchorTensor("update_weight", "UpdatedVar___model.fc1.weight")
    assert host_cycles(anchored) > host_cycles(poptorch.Options())


def test_every_n_period_must_divide_the_device_iterations_before_anything_runs():
    model = Model()
    before = copy.deepcopy(model.state_dict())
    opts = poptorch.Options().deviceIterations(3)
    poptorch_model = _anchored_training(model, opts, poptorch.OutputMode.EveryN, 2)
    with pytest.raises(poptorch.Error, match=r"EveryN\(2\) needs a period dividing the 3 device iterations"):
        poptorch_model(torch.randn(3 * BATCH, 4), torch.randn(3 * BATCH, 3))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])


# (poptorch optimizer, its eager twin, keyword arguments, PopART prefix -> eager state slot)
OPTIMIZER_STATES = [
    (
        poptorch.optim.Adam,
        torch.optim.Adam,
        {"lr": 0.01},
        {"Accl1___": "exp_avg", "Accl2___": "exp_avg_sq", "Step___": "step"},
    ),
    (poptorch.optim.SGD, torch.optim.SGD, {"lr": LR, "momentum": 0.9}, {"Accl___": "momentum_buffer"}),
    (
        poptorch.optim.RMSprop,
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.5, "centered": True},
        {"Accl1___": "square_avg", "Accl2___": "grad_avg", "Accl3___": "momentum_buffer"},
    ),
]


@pytest.mark.parametrize(("poptorch_optim", "eager_optim", "kwargs", "slots"), OPTIMIZER_STATES)
def test_optimizer_state_anchors_match_eager_state_after_each_step(poptorch_optim, eager_optim, kwargs, slots):
    torch.manual_seed(0)
    model, iterations = Model(), 2
    reference = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(iterations)
    for prefix in slots:
        opts.anchorTensor(prefix, f"{prefix}model.fc2.weight", poptorch.OutputMode.All)
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=poptorch_optim(model.parameters(), **kwargs))
    x, y = torch.randn(iterations * BATCH, 4), torch.randn(iterations * BATCH, 3)
    poptorch_model(x, y)
    assert set(slots) <= {name.split("model.")[0] for name in poptorch_model.getTensorNames()}
    eager = eager_optim(reference.parameters(), **kwargs)
    expected = {prefix: [] for prefix in slots}
    for step_x, step_y in zip(x.split(BATCH), y.split(BATCH)):
        eager.zero_grad()
        reference(step_x, step_y).backward()
        eager.step()
        state = eager.state[reference.fc2.weight]
        for prefix, slot in slots.items():
            expected[prefix].append(torch.as_tensor(state[slot], dtype=torch.float32).clone())
    for prefix in slots:
        _close(poptorch_model.getAnchoredTensor(prefix), torch.stack(expected[prefix]))


def _names_of(model, opts=None, optimizer=None, rows=BATCH):
    """The tensor names of ``model`` trained with ``opts`` after one call."""
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    poptorch_model(torch.randn(rows, 4), torch.randn(rows, 3))
    return poptorch_model.getTensorNames()


def test_every_listed_name_can_be_anchored():
    torch.manual_seed(4)
    names = _names_of(Model())
    assert {"input", "input/1", "fc1/Add:0", "Relu:0", "lossScaling_FLOAT"} <= set(names)
    opts = poptorch.Options()
    for name in names:
        opts.anchorTensor(name, name)
    poptorch_model = poptorch.trainingModel(Model(), opts)
    poptorch_model(torch.randn(BATCH, 4), torch.randn(BATCH, 3))
    assert sorted(poptorch_model.getTensorNames()) == sorted(names)
    for name in names:
        assert isinstance(poptorch_model.getAnchoredTensor(name), torch.Tensor)


@pytest.mark.parametrize("training", [True, False])
def test_inputs_and_activations_match_eager_forward_per_micro_batch(training):
    torch.manual_seed(5)
    model, iterations = Model(), 2
    reference = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(iterations)
    for long_name in ("input", "input/1", "fc1/Add:0", "Relu:0", "fc2/Add:0"):
        opts.anchorTensor(long_name, long_name, poptorch.OutputMode.All)
    if training:
        poptorch_model = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=LR))
    else:
        poptorch_model = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(iterations * BATCH, 4), torch.randn(iterations * BATCH, 3)
    poptorch_model(x, y)
    expected = {name: [] for name in ("input", "input/1", "fc1/Add:0", "Relu:0", "fc2/Add:0")}
    eager = torch.optim.SGD(reference.parameters(), lr=LR)
    for step_x, step_y in zip(x.split(BATCH), y.split(BATCH)):
        hidden = reference.fc1(step_x)
        out = reference.fc2(torch.relu(hidden))
        for name, value in zip(expected, (step_x, step_y, hidden, torch.relu(hidden), out)):
            expected[name].append(value.detach().clone())
        if training:  # the next step's activations come from the updated weights
            eager.zero_grad()
            reference.loss(out, step_y).backward()
            eager.step()
    for name, values in expected.items():
        _close(poptorch_model.getAnchoredTensor(name), torch.stack(values))


def test_accumulators_hold_the_summed_gradients_of_the_step():
    torch.manual_seed(6)
    model, accumulation = Model(), 3
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    opts.anchorTensor("accum", "Accum___model.fc1.weight")
    opts.anchorTensor("grad", "Gradient___model.fc1.weight")
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(model.parameters(), lr=LR))
    x, y = torch.randn(accumulation * BATCH, 4), torch.randn(accumulation * BATCH, 3)
    poptorch_model(x, y)
    assert {f"Accum___model.{fqn}" for fqn, _ in model.named_parameters()} <= set(poptorch_model.getTensorNames())
    summed = torch.zeros_like(reference.fc1.weight)
    for step_x, step_y in zip(x.split(BATCH), y.split(BATCH)):
        reference.zero_grad()
        reference(step_x, step_y).backward()
        summed += reference.fc1.weight.grad
    _close(poptorch_model.getAnchoredTensor("accum"), summed)
    _close(poptorch_model.getAnchoredTensor("grad"), summed / accumulation)  # the step applies their mean


@pytest.mark.parametrize(
    ("optimizer", "prefixes"),
    [
        (lambda params: poptorch.optim.SGD(params, lr=LR), ("Accl", "Step___")),  # plain SGD keeps no state
        (None, ("Accum___",)),  # no accumulator without gradient accumulation
    ],
    ids=["plain_sgd_state", "accumulators"],
)
def test_tensors_the_step_does_not_have_are_not_named(optimizer, prefixes):
    model = Model()
    names = _names_of(model, optimizer=optimizer(model.parameters()) if optimizer else None)
    assert names and not [name for name in names if name.startswith(prefixes)]


def test_sgd_hyper_parameter_tensors_follow_the_optimizer_and_set_optimizer():
    lr, wd, ls = 0.05, 0.025, 0.75
    model = Model()
    opts = poptorch.Options()
    for name in ("scaledLearningRate0___specific___", "weightDecayScaleFactor0___specific___"):
        opts.anchorTensor(name, f"{name}model.fc2.bias")
    opts.anchorTensor("ls", "lossScaling_FLOAT")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd, loss_scaling=ls)
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
    poptorch_model(x, y)
    anchored = poptorch_model.getAnchoredTensor
    _close(anchored("scaledLearningRate0___specific___"), torch.tensor(lr / ls))
    _close(anchored("weightDecayScaleFactor0___specific___"), torch.tensor(1 - lr * wd))
    _close(anchored("ls"), torch.tensor(ls))
    optimizer.param_groups[0]["lr"] = 2 * lr
    poptorch_model.setOptimizer(optimizer)
    poptorch_model(x, y)
    _close(anchored("scaledLearningRate0___specific___"), torch.tensor(2 * lr / ls))


@pytest.mark.parametrize("optim", [poptorch.optim.Adam, poptorch.optim.AdamW, poptorch.optim.RMSprop])
def test_other_optimizers_name_their_learning_rate_and_weight_decay(optim):
    lr, wd = 0.02, 0.01
    model = Model()
    opts = poptorch.Options()
    opts.anchorTensor("lr", "learningRate___specific___model.fc1.weight")
    opts.anchorTensor("wd", "weightDecay___specific___model.fc1.weight")
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=optim(model.parameters(), lr=lr, weight_decay=wd))
    poptorch_model(torch.randn(BATCH, 4), torch.randn(BATCH, 3))
    _close(poptorch_model.getAnchoredTensor("lr"), torch.tensor(lr))
    _close(poptorch_model.getAnchoredTensor("wd"), torch.tensor(wd))


def test_disable_module_namescope_names_forward_values_without_their_modules():
    torch.manual_seed(8)
    names = _names_of(Model(), poptorch.Options().disableModuleNamescope())
    assert not [name for name in names if name.startswith(("fc1/", "fc2/", "loss/"))]
    assert {"MatMul:0", "MatMul:0/1", "Add:0", "Add:0/1", "Relu:0"} <= set(names)
    model = Model()
    reference = copy.deepcopy(model)
    opts = poptorch.Options().disableModuleNamescope()
    opts.anchorTensor("second", "Add:0/1")  # fc2's bias add, the second Add of the forward pass
    poptorch_model = poptorch.inferenceModel(model, opts)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
    poptorch_model(x, y)
    _close(poptorch_model.getAnchoredTensor("second"), reference.fc2(torch.relu(reference.fc1(x))).detach())


def test_a_float16_velocity_accum_type_keeps_the_momentum_buffer_in_float16():
    torch.manual_seed(9)
    model = Model()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.anchorTensor("velocity", "Accl___model.fc1.weight")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, velocity_accum_type=torch.float16)
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    eager = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    for _ in range(2):
        x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
        poptorch_model(x, y)
        eager.zero_grad()
        reference(x, y).backward()
        eager.step()
    velocity = poptorch_model.getAnchoredTensor("velocity")
    assert velocity.dtype == torch.float16
    expected = eager.state[reference.fc1.weight]["momentum_buffer"]
    torch.testing.assert_close(velocity.float(), expected, rtol=2e-3, atol=2e-3)


def test_names_without_the_model_scope_anchor_the_same_tensors():
    # PopTorch 3.x's guide anchors "Gradient___fc2.bias"; older releases wrote "Gradient___model.fc2.bias".
    torch.manual_seed(9)
    model = Model()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.anchorTensor("grad_bias", "Gradient___fc2.bias")
    opts.anchorTensor("update_weight", "UpdatedVar___fc2.weight")
    opts.anchorTensor("momentum", "Accl___fc1.weight")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    poptorch_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    x, y = torch.randn(BATCH, 4), torch.randn(BATCH, 3)
    poptorch_model(x, y)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    reference(x, y).backward()
    eager_optimizer.step()
    _close(poptorch_model.getAnchoredTensor("grad_bias"), reference.fc2.bias.grad)
    _close(poptorch_model.getAnchoredTensor("update_weight"), reference.fc2.weight.detach())
    _close(poptorch_model.getAnchoredTensor("momentum"), eager_optimizer.state[reference.fc1.weight]["momentum_buffer"])
