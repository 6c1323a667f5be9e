"""Check a torch function on the simulated IPU as a user would: forward through ``inferenceModel`` and the
gradient through one ``trainingModel`` SGD step, both against eager PyTorch."""

import copy

import torch

import poptorch

RTOL, ATOL = 1e-4, 1e-5


def options():
    return poptorch.Options().showCompilationProgressBar(False)


class Forward(torch.nn.Module):
    """``fn(*inputs)`` as a module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class WithParameter(torch.nn.Module):
    """``fn`` with its input ``wrt`` as a trainable parameter; the loss weighs every output element."""

    def __init__(self, fn, inputs, wrt):
        super().__init__()
        self.fn, self.wrt = fn, wrt
        self.p = torch.nn.Parameter(inputs[wrt].detach().clone())
        out = fn(*self._args(inputs[:wrt] + inputs[wrt + 1 :]))
        self.register_buffer("weights", torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape).to(out.dtype))

    def _args(self, rest):
        return list(rest[: self.wrt]) + [self.p] + list(rest[self.wrt :])

    def forward(self, *rest):
        return poptorch.identity_loss((self.fn(*self._args(rest)) * self.weights).float(), "sum")


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_matches(device, eager, rtol=RTOL, atol=ATOL):
    for d, e in zip(_flat(device), _flat(eager), strict=True):
        e = e.detach()
        assert d.shape == e.shape, f"shape {list(d.shape)} != eager {list(e.shape)}"
        if e.dtype.is_floating_point:
            torch.testing.assert_close(d.to(e.dtype), e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            assert torch.equal(d.to(e.dtype), e), f"{d} != {e}"


def check_forward(fn, inputs, rtol=RTOL, atol=ATOL):
    """``fn(*inputs)`` through inferenceModel equals eager (in eval mode, as inferenceModel runs it)."""
    module = Forward(fn).eval()
    with torch.no_grad():
        eager = module(*inputs)
    model = poptorch.inferenceModel(module, options())
    try:
        assert_matches(model(*inputs), eager, rtol, atol)
    finally:
        model.destroy()


def check_gradient(fn, inputs, wrt=0, rtol=RTOL, atol=ATOL):
    """One SGD step (lr=1) on input ``wrt`` made a parameter moves it by eager's gradient."""
    model = WithParameter(fn, list(inputs), wrt).train()
    eager = copy.deepcopy(model)
    rest = list(inputs[:wrt]) + list(inputs[wrt + 1 :])
    eager(*rest).backward()
    training = poptorch.trainingModel(model, options(), torch.optim.SGD(model.parameters(), lr=1.0))
    try:
        training(*rest)
        training.copyWeightsToHost()
    finally:
        training.destroy()
    torch.testing.assert_close(eager.p.detach() - model.p.detach(), eager.p.grad, rtol=rtol, atol=atol, equal_nan=True)
