"""The zoo's one check: a model on the simulated IPU behaves as in eager PyTorch.

``check_inference`` compares every tensor an inferenceModel returns with eager's; ``check_training`` runs
trainingModel and eager side by side from identical weights for ``STEPS`` optimizer steps and compares, after
every step, the loss, every parameter (tied ones are one tensor, so they are compared too) and every buffer.
A model's ``loss_of(output)`` picks the loss out of what it returns.
"""

import copy

import torch
from torch.utils import _pytree as pytree

import poptorch

STEPS = 3
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    # eps 1e-6: a gradient that is zero in exact arithmetic (an attention key bias: softmax ignores it) is
    # rounding noise on both sides, which AdamW's default eps of 1e-8 would blow up to full-size updates.
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-6),
}
# Summation order differs from eager's; AdamW divides by the root of small second moments, so its updates
# magnify gradient rounding more than SGD's: its absolute tolerance is 5% of one step (lr), so a missed or
# doubled update still fails.
TOLERANCE = {"inference": (1e-4, 1e-5), "sgd": (1e-4, 1e-5), "adamw": (1e-3, 5e-4)}


def _tensors(output):
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


def _assert_close(actual, expected, tolerance, what):
    rtol, atol = tolerance
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, check_dtype=False, msg=lambda m: f"{what}: {m}")


def _fields(output):
    """Tensor fields by name (a ModelOutput, dict or tuple), so an output eager fills and the IPU drops
    (a cache) is not compared with the next field."""
    if isinstance(output, dict):
        return {k: v for k, v in output.items() if isinstance(v, torch.Tensor)}
    return dict(enumerate(_tensors(output)))


def check_inference(model, args=(), kwargs=None):
    """inferenceModel(model) returns what eager returns: same structure type, every tensor close."""
    kwargs = kwargs or {}
    model.eval()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    executor = poptorch.inferenceModel(model)
    try:
        actual = executor(*args, **kwargs)
    finally:
        executor.destroy()
    if not isinstance(expected, torch.Tensor):  # a tensor comes back as poptorch's tensor subclass
        assert type(actual) is type(expected)
    expected_fields, actual_fields = _fields(expected), _fields(actual)
    assert set(actual_fields) <= set(expected_fields) and actual_fields
    for name, tensor in actual_fields.items():
        _assert_close(tensor, expected_fields[name], TOLERANCE["inference"], f"output {name}")


def check_training(model, optimizer, loss_of, args=(), kwargs=None):
    """trainingModel and eager train alike for ``STEPS`` steps of ``optimizer`` (a key of OPTIMIZERS)."""
    kwargs = kwargs or {}
    model.train()
    eager = copy.deepcopy(model)
    eager_optimizer = OPTIMIZERS[optimizer](eager.parameters())
    executor = poptorch.trainingModel(model, optimizer=OPTIMIZERS[optimizer](model.parameters()))
    tolerance = TOLERANCE[optimizer]
    try:
        for step in range(STEPS):
            loss = loss_of(executor(*args, **kwargs))
            eager_optimizer.zero_grad()
            expected = loss_of(eager(*args, **kwargs))
            expected.backward()
            eager_optimizer.step()
            _assert_close(loss, expected.detach(), tolerance, f"loss of step {step}")
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                _assert_close(p.detach(), q.detach(), tolerance, f"parameter {name} after step {step}")
            for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
                _assert_close(b, c, tolerance, f"buffer {name} after step {step}")
    finally:
        executor.destroy()
