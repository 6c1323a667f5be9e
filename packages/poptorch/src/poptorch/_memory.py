"""Memory controls of large models: ``serializedMatMul`` splits a matrix product into smaller ones run one
after another, so each needs less temporary tile memory (at the cost of cycles). ``set_available_memory``
is refused on the device: the simulator's planners take no temporary-memory budget."""

import torch

from poptorch._executor_api import isRunningOnIpu
from poptorch.enums import MatMulSerializationMode
from poptorch.errors import Error
from poptorch.options import not_modelled

# The dimension each mode splits: of lhs (dim -2, m), of both (lhs -1 / rhs -2, n), of rhs (dim -1, p).
_SPLIT = {
    MatMulSerializationMode.InputChannels: "m",
    MatMulSerializationMode.ReducingDim: "n",
    MatMulSerializationMode.OutputChannels: "p",
}


def serializedMatMul(lhs, rhs, mode, factor=0, keep_precision=False):
    """``lhs @ rhs`` computed as ``factor`` smaller products, one after another: over the rows of lhs
    (InputChannels), the reduced dimension (ReducingDim, the partial products summed) or the columns of rhs
    (OutputChannels). ``factor`` must divide that dimension. ``keep_precision`` sums float16 partial
    products in float32."""
    if not isinstance(mode, MatMulSerializationMode):
        raise Error(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, got {mode!r}")
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 0:
        raise Error(f"serializedMatMul: factor must be a non-negative integer, got {factor!r}")
    if not isinstance(keep_precision, bool):
        raise Error(f"serializedMatMul: keep_precision must be True or False, got {keep_precision!r}")
    if mode == MatMulSerializationMode.Disabled or factor <= 1:
        return torch.matmul(lhs, rhs)
    if lhs.dim() < 2 or rhs.dim() < 2:
        raise Error("serializedMatMul: lhs and rhs must be matrices (at least 2-D)")
    which = _SPLIT[mode]
    size = {"m": lhs.shape[-2], "n": lhs.shape[-1], "p": rhs.shape[-1]}[which]
    if size % factor:
        raise Error(f"serializedMatMul: factor {factor} does not divide the {mode.name} dimension ({size})")
    if which == "m":
        return torch.cat([torch.matmul(part, rhs) for part in lhs.chunk(factor, -2)], -2)
    if which == "p":
        return torch.cat([torch.matmul(lhs, part) for part in rhs.chunk(factor, -1)], -1)
    partials = [torch.matmul(a, b) for a, b in zip(lhs.chunk(factor, -1), rhs.chunk(factor, -2))]
    wide = keep_precision and partials[0].dtype == torch.float16
    total = partials[0].float() if wide else partials[0]
    for partial in partials[1:]:
        total = total + (partial.float() if wide else partial)
    return total.to(partials[0].dtype)


def set_available_memory(tensor, available_memory_proportion):
    """PopTorch bounds the temporary memory of the op producing ``tensor`` to this share of a tile. The
    simulator's matmul and convolution planners take no such budget, so capturing a model that calls it
    raises; on the CPU it returns ``tensor`` unchanged."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"You may only set available memory for torch.tensor values. {type(tensor)} is not supported.")
    if isRunningOnIpu():
        raise not_modelled(
            "set_available_memory",
            "the simulator's planners take no temporary-memory budget; remove the call (serializedMatMul "
            "lowers a matmul's peak memory)",
        )
    return tensor
