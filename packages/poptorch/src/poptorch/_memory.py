"""Memory controls of large models: ``serializedMatMul`` splits a matrix product into smaller ones run one
after another, so each needs less temporary tile memory (at the cost of cycles). ``set_available_memory``
bounds the share of tile memory the plans of the matmuls and convolutions producing a tensor may use."""

import torch

from poptorch import _logging
from poptorch._executor_api import isRunningOnIpu
from poptorch._marker_ops import define_marker
from poptorch.enums import MatMulSerializationMode
from poptorch.errors import Error
from poptorch.options import check_proportion

# popir ops whose popsim plan takes an available-memory proportion (their gradients inherit it).
PLANNED_OPS = frozenset({"matmul", "conv2d", "conv2d_grad_input", "conv2d_grad_weight"})

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


_set_available_memory = define_marker("set_available_memory", ("float proportion",))


def set_available_memory(tensor, available_memory_proportion):
    """Let the matmul or convolution producing ``tensor`` (and its gradients) plan with at most
    ``available_memory_proportion`` (0 to 1) of each tile's memory for temporary data, instead of the
    per-IPU or default 0.6: a lower proportion gives a plan with less temporary memory and usually more
    cycles. On another op it is an identity, as in PopTorch. Returns ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"You may only set available memory for torch.tensor values. {type(tensor)} is not supported.")
    check_proportion(available_memory_proportion, "set_available_memory")
    if isRunningOnIpu():
        return _set_available_memory(tensor, float(available_memory_proportion))
    return tensor


def planned_nodes(value):
    """The planned ops (matmul, convolution) that produced popir ``value``: those of the ATen op that produced
    it (through its bias add), or of the op before a reshape (a linear layer on a 3-D input is a matmul
    between two views)."""
    pending = [(value.producer, value.producer.aten)] if value.producer is not None else []
    seen, planned = set(), []
    while pending:
        node, aten = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op in PLANNED_OPS:
            planned.append(node)
            continue
        for v in node.inputs:
            if v.producer is not None and (v.producer.aten == aten or node.op == "reshape"):
                pending.append((v.producer, v.producer.aten))
    return planned


def mark_available_memory(value, proportion):
    """Annotate the planned ops that produced popir ``value`` (``planned_nodes``) with ``proportion``."""
    planned = planned_nodes(value)
    for node in planned:
        node.available_memory = proportion
    if not planned:
        _logging.logger.warning(
            "set_available_memory(%s) at %s: the tensor is not the output of a matmul or convolution, so it has "
            "no effect (apply it to the op's output)",
            proportion,
            value.producer.source if value.producer is not None else "an input",
        )
