"""Loss composites with torch's reductions ("mean", "sum", "none") and ignore_index handling."""

import math

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.ops.activations import log_softmax, softplus
from popir.ops.base import exp, full, reduce_sum, reshape, zeros_like
from popir.ops.elementwise import (
    abs_,
    cast,
    eq,
    gt,
    log,
    logical_and,
    logical_or,
    lt,
    maximum,
    minimum,
    ne,
    sqrt,
    where,
)
from popir.ops.movement import concat, gather, slice_, take_along_axis
from popir.ops.reduction import reduce_max
from popir.ops.stats import mean, norm


def reduce_loss(loss, reduction):
    """Apply torch's ``reduction`` to a per-element loss."""
    if reduction == "mean":
        return mean(loss)
    if reduction == "sum":
        return reduce_sum(loss, axes=None, keepdims=False)
    if reduction == "none":
        return loss
    raise IRError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _weighted_mean(loss_sum, weight_sum):
    """``loss_sum / weight_sum`` as torch computes it: NaN when every target is ignored, yet a zero gradient
    (torch's backward leaves ignored positions untouched rather than propagating 0/0)."""
    g, dtype = loss_sum.graph, loss_sum.dtype
    empty = eq(weight_sum, full(g, (), 0.0, dtype))
    safe = where(empty, full(g, (), 1.0, dtype), weight_sum)
    return loss_sum / safe + where(empty, full(g, (), float("nan"), dtype), full(g, (), 0.0, dtype))


def _valid_targets(target, ignore_index):
    """(mask of targets != ignore_index, targets with ignored entries replaced by class 0)."""
    keep = ne(target, full(target.graph, (), ignore_index, DType.int32))
    return keep, where(keep, target, full(target.graph, target.shape, 0, DType.int32))


def _class_vector(v, ndim, class_axis):
    """A (C,) vector shaped to broadcast along ``class_axis``."""
    return reshape(v, shape=tuple(v.shape[0] if i == class_axis else 1 for i in range(ndim)))


def nll_loss(log_probs, target, weight=None, reduction="mean", ignore_index=-100):
    """torch.nn.functional.nll_loss: log_probs (N, C, ...) or (C,), int32 target (N, ...) or ()."""
    if target.dtype != DType.int32:
        raise IRError(f"nll_loss target must be int32 class indices, got {target.dtype}")
    batched = log_probs.ndim > 1
    lp = log_probs if batched else reshape(log_probs, shape=(1,) + log_probs.shape)
    tg = target if batched else reshape(target, shape=(1,))
    if tg.shape != (lp.shape[0],) + lp.shape[2:]:
        raise IRError(f"nll_loss target {list(target.shape)} does not fit input {list(log_probs.shape)}")
    keep, safe = _valid_targets(tg, ignore_index)
    picked = take_along_axis(lp, reshape(safe, shape=(tg.shape[0], 1) + tg.shape[1:]), axis=1)
    w = cast(keep, dtype=lp.dtype)
    if weight is not None:
        w = w * gather(weight, safe, axis=0)
    loss = -(reshape(picked, shape=tg.shape) * w)
    if reduction == "mean":
        return _weighted_mean(reduce_sum(loss, axes=None, keepdims=False), reduce_sum(w, axes=None, keepdims=False))
    loss = reduce_loss(loss, reduction)
    return loss if batched or reduction != "none" else reshape(loss, shape=())


def cross_entropy(logits, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """torch.nn.functional.cross_entropy with class-index targets (int32) or class probabilities (float).

    Supports ``weight``, ``ignore_index`` and ``label_smoothing`` with torch's formulas.
    """
    class_axis = 1 if logits.ndim > 1 else 0
    lp = log_softmax(logits, axis=class_axis)
    if target.dtype.is_float:
        return _soft_cross_entropy(lp, target, weight, reduction, label_smoothing, class_axis)
    nll = nll_loss(lp, target, weight, reduction, ignore_index)
    if label_smoothing == 0.0:
        return nll
    # torch: (1 - s) * nll + s / C * smooth, smooth = -sum_c w_c lp_c with ignored targets masked and
    # the mean taken over the same (weighted) count as nll_loss.
    weighted = lp if weight is None else lp * _class_vector(weight, lp.ndim, class_axis)
    keep, safe = _valid_targets(target, ignore_index)
    keep = cast(keep, dtype=lp.dtype)
    smooth = -reduce_sum(weighted, axes=(class_axis,), keepdims=False) * keep
    if reduction == "mean":
        counted = keep if weight is None else gather(weight, safe, axis=0) * keep
        smooth = _weighted_mean(
            reduce_sum(smooth, axes=None, keepdims=False), reduce_sum(counted, axes=None, keepdims=False)
        )
    else:
        smooth = reduce_loss(smooth, reduction)
    return nll * (1.0 - label_smoothing) + smooth * (label_smoothing / logits.shape[class_axis])


def _soft_cross_entropy(lp, target, weight, reduction, label_smoothing, class_axis):
    if target.shape != lp.shape:
        raise IRError(f"probability target {list(target.shape)} must match the input {list(lp.shape)}")
    classes = lp.shape[class_axis]
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + label_smoothing / classes
    if weight is not None:
        target = target * _class_vector(weight, lp.ndim, class_axis)
    loss = -reduce_sum(lp * target, axes=(class_axis,), keepdims=False)
    if reduction == "mean" and lp.ndim > 1:
        return reduce_sum(loss, axes=None, keepdims=False) * (1.0 / (lp.type.size // classes))
    return reduce_loss(loss, reduction)


def mse_loss(a, b, reduction="mean"):
    """torch.nn.functional.mse_loss."""
    d = a - b
    return reduce_loss(d * d, reduction)


def l1_loss(a, b, reduction="mean"):
    """torch.nn.functional.l1_loss."""
    return reduce_loss(abs_(a - b), reduction)


def smooth_l1_loss(a, b, reduction="mean", beta=1.0):
    """torch.nn.functional.smooth_l1_loss: 0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta."""
    d = abs_(a - b)
    if beta == 0.0:
        return reduce_loss(d, reduction)
    quadratic = d * d * (0.5 / beta)
    return reduce_loss(where(lt(d, full(d.graph, (), beta, d.dtype)), quadratic, d - 0.5 * beta), reduction)


def huber_loss(a, b, reduction="mean", delta=1.0):
    """torch.nn.functional.huber_loss: smooth L1 scaled by delta."""
    return smooth_l1_loss(a, b, reduction, beta=delta) * delta if delta != 1.0 else smooth_l1_loss(a, b, reduction)


def binary_cross_entropy(p, target, weight=None, reduction="mean"):
    """torch.nn.functional.binary_cross_entropy; each log is clamped at -100 as in torch."""
    floor = full(p.graph, (), -100.0, p.dtype)
    loss = -(target * maximum(log(p), floor) + (1.0 - target) * maximum(log(1.0 - p), floor))
    return reduce_loss(loss if weight is None else loss * weight, reduction)


def binary_cross_entropy_with_logits(x, target, weight=None, reduction="mean", pos_weight=None):
    """torch.nn.functional.binary_cross_entropy_with_logits, in the stable log-sigmoid form."""
    log_sig = -softplus(-x)  # log(sigmoid(x))
    log_one_minus = -softplus(x)  # log(1 - sigmoid(x))
    positive = target * log_sig if pos_weight is None else target * pos_weight * log_sig
    loss = -(positive + (1.0 - target) * log_one_minus)
    return reduce_loss(loss if weight is None else loss * weight, reduction)


def kl_div(log_input, target, reduction="mean", log_target=False):
    """torch.nn.functional.kl_div (reduction "batchmean" divides the sum by the batch size)."""
    if log_target:
        loss = exp(target) * (target - log_input)
    else:
        positive = gt(target, zeros_like(target))
        safe = where(positive, target, full(target.graph, target.shape, 1.0, target.dtype))
        loss = where(positive, target * (log(safe) - log_input), zeros_like(target))
    if reduction == "batchmean":
        return reduce_sum(loss, axes=None, keepdims=False) * (1.0 / log_input.shape[0] if log_input.ndim else 1.0)
    return reduce_loss(loss, reduction)


def _hinge(x):
    """max(x, 0)."""
    return maximum(x, zeros_like(x))


def _select(cond, x):
    """``x`` where ``cond``, else 0."""
    return where(cond, x, zeros_like(x))


def poisson_nll_loss(x, target, log_input=True, full_loss=False, eps=1e-8, reduction="mean"):
    """torch.nn.functional.poisson_nll_loss; ``full_loss`` adds Stirling's term where target > 1."""
    loss = exp(x) - target * x if log_input else x - target * log(x + eps)
    if full_loss:
        above_one = gt(target, full(target.graph, (), 1.0, target.dtype))
        safe = where(above_one, target, full(target.graph, target.shape, 1.0, target.dtype))
        stirling = safe * log(safe) - safe + log(safe * (2.0 * math.pi)) * 0.5
        loss = loss + _select(above_one, stirling)
    return reduce_loss(loss, reduction)


def hinge_embedding_loss(x, target, margin=1.0, reduction="mean"):
    """torch.nn.functional.hinge_embedding_loss: x where target is 1, max(margin - x, 0) where it is -1."""
    one = full(target.graph, (), 1.0, target.dtype)
    loss = _select(ne(target, one), _hinge(margin - x)) + _select(ne(target, -one), x)
    return reduce_loss(loss, reduction)


def soft_margin_loss(x, target, reduction="mean"):
    """torch.nn.functional.soft_margin_loss: log(1 + exp(-target x)), as a softplus that cannot overflow."""
    return reduce_loss(softplus(-(target * x)), reduction)


# torch's epsilon added to each squared magnitude in cosine_embedding_loss.
_COSINE_EPS = 1e-12


def cosine_embedding_loss(a, b, target, margin=0.0, reduction="mean"):
    """torch.nn.functional.cosine_embedding_loss over the last axis; target is 1 or -1 per row."""
    dot = reduce_sum(a * b, axes=(-1,), keepdims=False)
    mag_a = reduce_sum(a * a, axes=(-1,), keepdims=False) + _COSINE_EPS
    mag_b = reduce_sum(b * b, axes=(-1,), keepdims=False) + _COSINE_EPS
    cos = dot / sqrt(mag_a * mag_b)
    one = full(target.graph, (), 1.0, target.dtype)
    loss = _select(eq(target, one), 1.0 - cos) + _select(eq(target, -one), _hinge(cos - margin))
    return reduce_loss(loss, reduction)


def margin_ranking_loss(a, b, target, margin=0.0, reduction="mean"):
    """torch.nn.functional.margin_ranking_loss: max(-target (a - b) + margin, 0)."""
    return reduce_loss(_hinge(-(target * (a - b)) + margin), reduction)


def pairwise_distance(a, b, p=2.0, eps=1e-6):
    """torch.nn.functional.pairwise_distance: the p-norm of a - b + eps over the last axis."""
    return norm(a - b + eps, p=p, axes=(-1,), keepdims=False)


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False, reduction="mean"):
    """torch.nn.functional.triplet_margin_loss (``swap``: the negative's distance is the smaller of the two)."""
    d_pos = pairwise_distance(anchor, positive, p, eps)
    d_neg = pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_neg = minimum(d_neg, pairwise_distance(positive, negative, p, eps))
    return reduce_loss(_hinge(d_pos - d_neg + margin), reduction)


def _logsumexp3(a, b, c):
    """log(e^a + e^b + e^c) elementwise; -inf where all three are, with zero (not NaN) gradients there."""
    g, dtype = a.graph, a.dtype
    top = maximum(maximum(a, b), c)
    dead = eq(top, full(g, (), -math.inf, dtype))
    shift = where(dead, zeros_like(top), top)
    total = exp(a - shift) + exp(b - shift) + exp(c - shift)
    alive = log(where(dead, full(g, (), 1.0, dtype), total)) + shift
    return where(dead, full(g, (), -math.inf, dtype), alive)


def _shift_states(alpha, by):
    """alpha (N, L) moved ``by`` states to the right along L, -inf filling the start."""
    n, length = alpha.shape
    filler = full(alpha.graph, (n, by), -math.inf, alpha.dtype)
    return concat(filler, slice_(alpha, starts=(0, 0), stops=(n, length - by)), axis=1)


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """torch.nn.functional.ctc_loss of log_probs (T, N, C) and padded int32 targets (N, S), with int32
    input_lengths and target_lengths (N,): the forward algorithm over the blank-extended labels, unrolled over
    T. Frames beyond a sample's input length leave its state unchanged; its loss is read at its own length."""
    steps, n, classes = log_probs.shape
    s = targets.shape[1]
    g, dtype, i32 = log_probs.graph, log_probs.dtype, DType.int32
    length = 2 * s + 1
    # Extended labels: blank, t1, blank, t2, ..., blank (N, L).
    blank_column = full(g, (n, 1), blank, i32)
    parts = [blank_column]
    for k in range(s):
        parts += [slice_(targets, starts=(0, k), stops=(n, k + 1)), blank_column]
    labels = concat(*parts, axis=1)
    # A label may skip the blank before it when it differs from the label two states back.
    two_back = concat(full(g, (n, 2), blank, i32), slice_(labels, starts=(0, 0), stops=(n, length - 2)), axis=1)
    skip = logical_and(ne(labels, full(g, (), blank, i32)), ne(labels, two_back))
    minus_inf = full(g, (), -math.inf, dtype)
    state = g.constant(np.arange(length, dtype=np.int32).reshape(1, length))
    alpha = None
    for t in range(steps):
        frame = reshape(slice_(log_probs, starts=(t, 0, 0), stops=(t + 1,) + log_probs.shape[1:]), shape=(n, classes))
        emit = take_along_axis(frame, labels, axis=1)  # (N, L)
        if alpha is None:
            alpha = where(lt(state, full(g, (), 2, i32)), emit, minus_inf)
            continue
        step = _logsumexp3(alpha, _shift_states(alpha, 1), where(skip, _shift_states(alpha, 2), minus_inf)) + emit
        running = reshape(lt(full(g, (), t, i32), input_lengths), shape=(n, 1))
        alpha = where(running, step, alpha)
    last = reshape(target_lengths * 2, shape=(n, 1))
    at_end = logical_or(eq(state, last), eq(state, last - 1))
    ends = where(at_end, alpha, minus_inf)
    top = reduce_max(ends, axes=(1,), keepdims=True)
    dead = eq(top, minus_inf)  # no alignment fits the input length: an infinite loss
    shift = where(dead, zeros_like(top), top)
    total = where(dead, full(g, (), 1.0, dtype), reduce_sum(exp(ends - shift), axes=(1,), keepdims=True))
    loss = -reshape(where(dead, minus_inf, log(total) + shift), shape=(n,))
    if zero_infinity:
        loss = where(eq(loss, full(g, (), math.inf, dtype)), zeros_like(loss), loss)
    if reduction == "mean":
        per_label = maximum(cast(target_lengths, dtype=dtype), full(g, (), 1.0, dtype))
        return mean(loss / per_label)
    return reduce_loss(loss, reduction)
