"""``poptorch.testing``: PopTorch's helper comparing nested model outputs."""

import torch


def allclose(ref, other):
    """True when ``other`` has the structure of ``ref`` (tensors nested in tuples and lists, the same kind
    of container at each level) and each tensor is ``torch.allclose`` to ``ref``'s."""
    if isinstance(ref, torch.Tensor):
        return isinstance(other, torch.Tensor) and torch.allclose(other, ref)
    if not isinstance(ref, (tuple, list)):
        raise TypeError(f"allclose compares tensors, tuples and lists, not {type(ref).__name__}")
    if type(other) is not type(ref) or len(other) != len(ref):
        return False
    return all(allclose(r, o) for r, o in zip(ref, other))
