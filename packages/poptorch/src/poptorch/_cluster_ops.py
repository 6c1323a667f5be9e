"""PopTorch's ``torch_cluster`` operators ``fps`` and ``nearest``, written as torch ops so they are captured
(and run on the device) like the rest of the model."""

import math

import torch

from poptorch.errors import Error


def _check_tensor(op, name, value):
    if not isinstance(value, torch.Tensor):
        raise Error(f"`{op}` must take a torch.tensor `{name}` input. {type(value)} is not supported.")


def _points(tensor):
    """torch_cluster's view of a point set: one row per point (a 1-d tensor holds 1-feature points)."""
    return tensor.reshape(-1, 1) if tensor.dim() == 1 else tensor.reshape(tensor.shape[0], -1)


def _check_fps_arguments(src, ptr, ratio, random_start):
    _check_tensor("fps", "src", src)
    if not isinstance(ptr, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in ptr):
        raise Error("`ptr` must be a list of integers.")
    if len(ptr) < 2:
        raise Error("`ptr` must contain at least 2 elements.")
    if any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[0] < 0 or ptr[-1] > src.shape[0]:
        raise Error(f"`ptr` must be non-decreasing offsets within the {src.shape[0]} points of `src`, got {ptr}")
    if not isinstance(ratio, float):
        raise Error(f"`ratio` must be of float type. {type(ratio)} is not supported.")
    if not 0.0 < ratio <= 1.0:
        raise Error(f"`ratio` must be in (0, 1], got {ratio}")
    if not isinstance(random_start, bool):
        raise Error(f"`random_start` must be of bool type. {type(random_start)} is not supported.")


def fps(src, ptr, ratio=0.5, random_start=False):
    """Farthest point sampling (torch_cluster's ``fps``): from each sample ``src[ptr[i]:ptr[i + 1]]``,
    ``ceil(ratio * size)`` points, each the one farthest (squared Euclidean distance) from those already
    chosen, starting from the sample's first point (or a random one with ``random_start``). Returns the
    chosen points' indices into ``src``, sample after sample."""
    _check_fps_arguments(src, ptr, ratio, random_start)
    points = _points(src)
    picks = []
    for start, end in zip(ptr, ptr[1:]):
        size = end - start
        count = math.ceil(ratio * size)
        if count == 0:
            continue
        if random_start:
            first = (torch.rand(1) * size).long().clamp(max=size - 1)
        else:
            first = torch.zeros(1, dtype=torch.long)
        picks.append(_farthest(points[start:end], first, count) + start)
    if not picks:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(picks)


def _farthest(points, first, count):
    chosen = [first]
    distance = _squared_distance(points, first)
    for _ in range(count - 1):
        farthest = distance.argmax().reshape(1)
        chosen.append(farthest)
        distance = torch.minimum(distance, _squared_distance(points, farthest))
    return torch.cat(chosen)


def _squared_distance(points, index):
    return ((points - points.index_select(0, index)) ** 2).sum(dim=1)


def _batch_vector(batch):
    if batch is None or (isinstance(batch, list) and not batch):
        return None
    if isinstance(batch, list):
        return torch.tensor(batch, dtype=torch.long)
    if isinstance(batch, torch.Tensor):
        return batch
    raise Error(f"`batch_x` and `batch_y` must be torch.Tensors or lists, got {type(batch)}.")


def nearest(x, y, batch_x=None, batch_y=None):
    """torch_cluster's ``nearest``: for each point of ``x``, the index of the nearest point of ``y``
    (Euclidean distance; the first on ties) among those of the same sample when ``batch_x`` / ``batch_y``
    (lists or tensors of sample numbers) are given."""
    _check_tensor("nearest", "x", x)
    _check_tensor("nearest", "y", y)
    x, y = _points(x), _points(y)
    if x.shape[1] != y.shape[1]:
        raise Error(f"`nearest`: `x` and `y` must have the same number of features, got {x.shape[1]} and {y.shape[1]}")
    distance = torch.cdist(x, y)
    batch_x, batch_y = _batch_vector(batch_x), _batch_vector(batch_y)
    if (batch_x is None) != (batch_y is None):
        raise Error("`nearest` needs both `batch_x` and `batch_y`, or neither.")
    if batch_x is not None:
        if batch_x.numel() != x.shape[0] or batch_y.numel() != y.shape[0]:
            raise Error("`batch_x` and `batch_y` must hold one sample number per point of `x` and `y`.")
        same_sample = batch_x.reshape(-1, 1) == batch_y.reshape(1, -1)
        distance = torch.where(same_sample, distance, torch.inf)
    return distance.argmin(dim=1)
