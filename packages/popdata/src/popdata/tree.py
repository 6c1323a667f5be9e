"""Flatten a batch (tensors nested in tuples, lists and dicts) into a list of tensors and back."""

import torch


def flatten(batch):
    """Return ``(tensors, spec)`` where ``unflatten(tensors, spec)`` rebuilds ``batch``."""
    tensors = []

    def walk(node):
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return None
        if isinstance(node, dict):
            return (dict, tuple((key, walk(value)) for key, value in node.items()))
        if isinstance(node, (tuple, list)):
            return (type(node), tuple(walk(value) for value in node))
        raise TypeError(
            f"batches must be tensors nested in tuples, lists and dicts; found {type(node).__name__}: {node!r}"
        )

    spec = walk(batch)
    return tensors, spec


def unflatten(tensors, spec):
    """Inverse of :func:`flatten`."""
    leaves = iter(tensors)

    def build(node):
        if node is None:
            return next(leaves)
        kind, children = node
        if kind is dict:
            return {key: build(child) for key, child in children}
        values = [build(child) for child in children]
        return kind(values) if kind in (tuple, list) else kind(*values)

    return build(spec)
