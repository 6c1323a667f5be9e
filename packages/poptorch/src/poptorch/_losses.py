"""PopTorch's graph-marking ops as torch custom ops: ``identity_loss`` and ``ipu_print_tensor``; and
``ctc_loss``, which capture substitutes for torch's (see ``CaptureCtcLoss``).

They are ``torch.library`` ops (``poptorch::identity_loss``, ``poptorch::ipu_print_tensor``) with CPU,
fake and autograd implementations, so a model using them runs eagerly on the CPU, exports as a single
recognisable node, and capture lowers that node to popir.
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from poptorch import _host_print
from poptorch.options import not_modelled

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


def ipu_print_tensor(tensor, title="", print_gradient=True, **formatting):
    """Return ``tensor`` unchanged and print it (prefixed by ``title``) each time the model runs, on the
    device as on the CPU; in training, the gradient reaching it prints in the backward pass too (unless
    ``print_gradient`` is False). Use the returned tensor, so the print stays part of the model.
    PopTorch's formatting arguments (``summarise_threshold``, ``digits``...) are refused: values print in
    NumPy's format."""
    _check_print_formatting(formatting)
    return _ipu_print_tensor(tensor, title, bool(print_gradient))


# PopTorch's ipu_print_tensor formatting arguments, which the simulator does not model.
_PRINT_FORMATTING = (
    "summarise_threshold",
    "edge_items",
    "max_line_width",
    "digits",
    "float_format",
    "separator",
    "open_bracket",
    "close_bracket",
)


def _check_print_formatting(formatting):
    unknown = sorted(set(formatting) - set(_PRINT_FORMATTING))
    if unknown:
        raise TypeError(f"ipu_print_tensor() got unexpected keyword arguments: {', '.join(unknown)}")
    if formatting:
        raise not_modelled(
            f"ipu_print_tensor's formatting ({', '.join(sorted(formatting))})",
            "tensors print in NumPy's format (', ' separators, summarised above 1000 elements with 3 edge "
            "items at each end); remove the formatting arguments",
        )


@torch.library.custom_op("poptorch::ctc_loss", mutates_args=())
def _ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> torch.Tensor:
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)


@_ctc_loss.register_fake
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return log_probs.new_empty(() if reduction != "none" else (log_probs.shape[1],))


_CTC_DEFAULTS = {"blank": 0, "reduction": "mean", "zero_infinity": False}
_CTC_ARGS = ("log_probs", "targets", "input_lengths", "target_lengths", *_CTC_DEFAULTS)


class CaptureCtcLoss(TorchFunctionMode):
    """During capture, route F.ctc_loss to ``poptorch::ctc_loss``: torch's own kernel has an output shape that
    depends on the target lengths' values, which torch.export refuses; ours is one loss node of fixed shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.ctc_loss:
            return func(*args, **kwargs)
        call = {**_CTC_DEFAULTS, **dict(zip(_CTC_ARGS, args)), **kwargs}
        longest = _longest_target(call["target_lengths"])
        for name in ("input_lengths", "target_lengths"):
            call[name] = torch.as_tensor(call[name])
        if call["targets"].ndim == 1:
            call["targets"] = _padded_targets(call["targets"], call["target_lengths"], longest)
        return _ctc_loss(*(call[name] for name in _CTC_ARGS))


def _longest_target(target_lengths):
    """The longest target when the lengths are Python numbers (known at compile time), else None."""
    if isinstance(target_lengths, (list, tuple)) and target_lengths:
        return max(int(n) for n in target_lengths)
    return None


def _padded_targets(targets, target_lengths, longest):
    """Concatenated 1-D targets as padded (N, S) rows: row n reads its own slice of ``targets`` (its start is
    the sum of the lengths before it). S is the longest target when the lengths are known at compile time,
    else the whole concatenation (the only bound a tensor of lengths gives); the padding repeats valid labels,
    which the loss never reads."""
    total = targets.shape[0]
    if total == 0:
        return targets.reshape(target_lengths.shape[0], 0)
    width = total if longest is None else longest
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    positions = starts.unsqueeze(1) + torch.arange(width, device=targets.device).unsqueeze(0)
    return targets[positions.clamp(max=total - 1)]
