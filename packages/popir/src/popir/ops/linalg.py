"""Matrix multiplication with NumPy semantics (1-D promotion and batch broadcasting)."""

import numpy as np

from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import broadcast_shapes, same_dtype
from popir.ops.base import reshape, sum_to
from popir.ops.movement import transpose
from popir.registry import defop


def _matmul_infer(a, b):
    dtype = same_dtype(a, b)
    if not a.shape or not b.shape:
        raise IRError("matmul needs inputs of rank >= 1")
    a2 = (1,) + a.shape if len(a.shape) == 1 else a.shape
    b2 = b.shape + (1,) if len(b.shape) == 1 else b.shape
    if a2[-1] != b2[-2]:
        raise IRError(f"contraction sizes differ: {list(a.shape)} @ {list(b.shape)}")
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except IRError:
        raise IRError(f"batch dimensions of {list(a.shape)} and {list(b.shape)} do not broadcast") from None
    shape = batch + (a2[-2] if len(a.shape) > 1 else None, b2[-1] if len(b.shape) > 1 else None)
    return TensorType(tuple(d for d in shape if d is not None), dtype)


def _matmul_ref(a, b):
    if a.dtype == np.float16:
        # Accumulate half-precision products in float32, as torch does.
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


def _swap_last(x):
    perm = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
    return transpose(x, perm=perm)


def _matmul_vjp(ins, outs, cts):
    a, b = ins
    a2 = reshape(a, shape=(1,) + a.shape) if a.ndim == 1 else a
    b2 = reshape(b, shape=b.shape + (1,)) if b.ndim == 1 else b
    out_shape = broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
    ct = reshape(cts[0], shape=out_shape)
    ga = sum_to(matmul(ct, _swap_last(b2)), a2.shape)
    gb = sum_to(matmul(_swap_last(a2), ct), b2.shape)
    return reshape(ga, shape=a.shape), reshape(gb, shape=b.shape)


matmul = defop(
    "matmul",
    infer=_matmul_infer,
    ref=_matmul_ref,
    vjp=_matmul_vjp,
    doc="np.matmul / torch.matmul, with float16 accumulated in float32.",
)
