"""Normalisation composites: layer, group, batch and instance norm (torch numerics: biased variance)."""

from popir.errors import IRError
from popir.ops.base import reshape
from popir.ops.elementwise import rsqrt
from popir.ops.stats import mean, var


def _normalise(x, axes, eps):
    centred = x - mean(x, axes, keepdims=True)
    return centred * rsqrt(var(x, axes, keepdims=True, correction=0) + eps)


def _per_channel(v, ndim):
    """A (C,) vector shaped to broadcast over axis 1 of an (N, C, ...) tensor."""
    return reshape(v, shape=(1, v.shape[0]) + (1,) * (ndim - 2))


def _affine(y, weight, bias, shape_weight):
    if weight is not None:
        y = y * shape_weight(weight)
    if bias is not None:
        y = y + shape_weight(bias)
    return y


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm over the trailing ``normalized_shape`` axes."""
    axes = tuple(range(x.ndim - len(tuple(normalized_shape)), x.ndim))
    return _affine(_normalise(x, axes, eps), weight, bias, lambda v: v)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.group_norm on an (N, C, ...) tensor."""
    n, c = x.shape[:2]
    if num_groups < 1 or c % num_groups:
        raise IRError(f"group_norm: {c} channels of {list(x.shape)} do not split into {num_groups} groups")
    grouped = reshape(x, shape=(n, num_groups, x.type.size // max(n * num_groups, 1)))
    y = reshape(_normalise(grouped, (2,), eps), shape=x.shape)
    return _affine(y, weight, bias, lambda v: _per_channel(v, x.ndim))


def instance_norm(x, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.instance_norm without running statistics: each (sample, channel) normalised alone."""
    y = _normalise(x, tuple(range(2, x.ndim)), eps)
    return _affine(y, weight, bias, lambda v: _per_channel(v, x.ndim))


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """torch.nn.functional.batch_norm; returns (y, new_running_mean, new_running_var).

    In training the batch statistics normalise (biased variance) and the running statistics move by
    ``momentum`` towards the batch mean and the unbiased batch variance; in eval the running statistics
    normalise and come back unchanged. Either running statistic may be None (then None is returned for it).
    """
    axes = (0,) + tuple(range(2, x.ndim))
    if training:
        y = _normalise(x, axes, eps)
        batch_mean = reshape(mean(x, axes, keepdims=True), shape=(x.shape[1],))
        batch_var = reshape(var(x, axes, keepdims=True, correction=1), shape=(x.shape[1],))
        new_mean = None if running_mean is None else running_mean * (1.0 - momentum) + batch_mean * momentum
        new_var = None if running_var is None else running_var * (1.0 - momentum) + batch_var * momentum
    else:
        y = (x - _per_channel(running_mean, x.ndim)) * rsqrt(_per_channel(running_var, x.ndim) + eps)
        new_mean, new_var = running_mean, running_var
    return _affine(y, weight, bias, lambda v: _per_channel(v, x.ndim)), new_mean, new_var
