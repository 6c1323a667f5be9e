"""Integer inputs checked on the host before each run, where eager torch would raise.

The device's integers are 32-bit (int64 tensors run as int32), so an int64 value beyond int32 would wrap
silently. And a device gather reads whatever row an index names, so an out-of-range class label or
embedding index would silently read (and train) another row. Capture records, for every index operand that
comes straight from a user input, the range its op accepts (``IndexBound``); each call checks the values.
"""

from dataclasses import dataclass

import numpy as np
import torch

from poptorch.errors import Error

_INT32 = np.iinfo(np.int32)
# Ops that keep the set of values of their input, so an index read through them still comes from that input.
_VALUE_PRESERVING = frozenset({"cast", "reshape", "broadcast_to", "transpose", "stop_gradient", "slice"})


@dataclass(frozen=True)
class IndexBound:
    """Values an index operand accepts: [low, high) plus ``allowed`` (an ignore_index); where it is used."""

    low: int
    high: int
    what: str
    source: str | None = None
    allowed: tuple = ()


def user_input_of(value):
    """The graph input of kind "input" whose values ``value`` carries unchanged, else None."""
    while value.producer is not None and value.producer.op in _VALUE_PRESERVING:
        value = value.producer.inputs[0]
    return value if value.producer is None and value.kind == "input" else None


def check_input(name, tensor, bounds=()):
    """Raise ``poptorch.Error`` if integer input ``name`` does not fit int32 or breaks one of its ``bounds``."""
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(tensor))
    if low < _INT32.min or high > _INT32.max:
        bad = low if low < _INT32.min else high
        raise Error(
            f"Input {name} holds the value {bad}, which does not fit the IPU's 32-bit integers (int64 tensors run "
            f"as int32; valid range {_INT32.min}..{_INT32.max}). Bring the values into range before the call."
        )
    for bound in bounds:
        if bound.low <= low and high < bound.high:
            continue  # every value is in range: no per-element check needed
        values = tensor.detach().reshape(-1).numpy()
        outside = (values < bound.low) | (values >= bound.high)
        if bound.allowed:
            outside &= ~np.isin(values, bound.allowed)
        if outside.any():
            where = f" at {bound.source}" if bound.source else ""
            raise Error(
                f"Input {name} holds the index {int(values[outside][0])}, out of range for {bound.what}{where}: "
                f"valid indices are {bound.low}..{bound.high - 1}"
                + (f" (or {', '.join(map(str, bound.allowed))})" if bound.allowed else "")
                + ". Eager PyTorch raises an IndexError here; the IPU would read another row."
            )
