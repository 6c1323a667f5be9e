"""Flatten a batch (tensors nested in tuples, lists and dicts) into a list of tensors and back."""

import pickle

import torch


class PackedTensor:
    """A tensor that pickles by value (its bytes travel through the pipe).

    Torch sends tensors between processes as shared-memory file descriptors, one socket round trip each:
    far slower than copying the bytes of a small batch.
    """

    def __init__(self, tensor):
        self.blob = pickle.dumps(tensor)

    def unpack(self):
        return pickle.loads(self.blob)


def pack(batch):
    """``batch`` with every tensor replaced by a :class:`PackedTensor`."""
    if isinstance(batch, torch.Tensor):
        return PackedTensor(batch)
    if isinstance(batch, dict):
        return {key: pack(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        values = [pack(value) for value in batch]
        return type(batch)(values) if type(batch) in (tuple, list) else type(batch)(*values)
    return batch


def flatten(batch):
    """Return ``(tensors, spec)`` where ``unflatten(tensors, spec)`` rebuilds ``batch`` (PackedTensors unpacked)."""
    tensors = []

    def walk(node):
        if isinstance(node, (torch.Tensor, PackedTensor)):
            tensors.append(node.unpack() if isinstance(node, PackedTensor) else node)
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
