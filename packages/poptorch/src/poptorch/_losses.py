"""PopTorch's graph-marking ops as torch custom ops: ``identity_loss`` and ``ipu_print_tensor``.

They are ``torch.library`` ops (``poptorch::identity_loss``, ``poptorch::ipu_print_tensor``) with CPU,
fake and autograd implementations, so a model using them runs eagerly on the CPU, exports as a single
recognisable node, and capture lowers that node to popir.
"""

import torch

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
def _ipu_print_tensor(x: torch.Tensor, title: str) -> torch.Tensor:
    print(f"{title}{x}" if title else x)
    return x.clone()


@_ipu_print_tensor.register_fake
def _ipu_print_tensor_fake(x, title):
    return torch.empty_like(x)


_ipu_print_tensor.register_autograd(lambda ctx, grad: (grad, None))


def ipu_print_tensor(tensor, title=""):
    """Return ``tensor`` unchanged; eagerly it is printed (prefixed by ``title``), gradients pass through."""
    return _ipu_print_tensor(tensor, title)
