"""PopTorch's graph-marking ops as torch custom ops: ``identity_loss`` and ``ipu_print_tensor``.

They are ``torch.library`` ops (``poptorch::identity_loss``, ``poptorch::ipu_print_tensor``) with CPU,
fake and autograd implementations, so a model using them runs eagerly on the CPU, exports as a single
recognisable node, and capture lowers that node to popir.
"""

import torch

from poptorch import _host_print

REDUCTIONS = ("sum", "mean", "none")


@torch.library.custom_op("poptorch::identity_loss", mutates_args=())
def _identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    return x.clone()


@_identity_loss.register_fake
def _identity_loss_fake(x, reduction):
    return x.new_empty(()) if reduction in ("sum", "mean") else torch.empty_like(x)


def _identity_loss_setup(ctx, inputs, output):
    x, reduction = inputs
    ctx.shape, ctx.reduction = x.shape, reduction


def _identity_loss_backward(ctx, grad):
    if ctx.reduction == "none":
        return grad, None
    scale = 1.0 / max(1, torch.Size(ctx.shape).numel()) if ctx.reduction == "mean" else 1.0
    return (grad * scale).expand(ctx.shape), None


_identity_loss.register_autograd(_identity_loss_backward, setup_context=_identity_loss_setup)


def identity_loss(x, reduction):
    """Mark ``x`` as the model's loss, reduced by ``reduction`` ("sum", "mean" or "none").

    The output of the final ``identity_loss`` is the loss a ``trainingModel`` minimises; an
    ``identity_loss`` that feeds another loss is a plain reduction.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"identity_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return _identity_loss(x, reduction)


@torch.library.custom_op("poptorch::ipu_print_tensor", mutates_args=())
def _ipu_print_tensor(x: torch.Tensor, title: str, print_gradient: bool) -> torch.Tensor:
    print(_host_print.describe(title, x.detach().numpy()))
    return x.clone()


@_ipu_print_tensor.register_fake
def _ipu_print_tensor_fake(x, title, print_gradient):
    return torch.empty_like(x)


def _print_setup(ctx, inputs, output):
    ctx.title, ctx.print_gradient = inputs[1], inputs[2]


def _print_backward(ctx, grad):
    if ctx.print_gradient:
        print(_host_print.describe(ctx.title, grad.detach().numpy(), gradient=True))
    return grad, None, None


_ipu_print_tensor.register_autograd(_print_backward, setup_context=_print_setup)


def ipu_print_tensor(tensor, title="", print_gradient=True):
    """Return ``tensor`` unchanged and print it (prefixed by ``title``) each time the model runs, on the
    device as on the CPU; in training, the gradient reaching it prints in the backward pass too (unless
    ``print_gradient`` is False). Use the returned tensor, so the print stays part of the model."""
    return _ipu_print_tensor(tensor, title, bool(print_gradient))
