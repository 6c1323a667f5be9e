"""Counter-based random numbers: the same seed and shape give the same bits on every backend."""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import numpy_dtype
from popir.registry import defop


def uniform_bits(seed, size):
    """The uint32 hash of each flat index (the exact recipe popsim reproduces), before scaling."""
    s0, s1 = (np.uint32(np.int64(v) & 0xFFFFFFFF) for v in np.asarray(seed).reshape(2))
    i = np.arange(size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        h = (i * np.uint32(0x9E3779B9) + s0) ^ (s1 * np.uint32(0x85EBCA6B))
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def _uniform_ref(seed, shape, dtype):
    size = int(np.prod(shape, dtype=np.int64))
    u = (uniform_bits(seed, size) >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    return u.reshape(shape).astype(numpy_dtype(dtype))


def _uniform_infer(seed, shape, dtype):
    if seed.shape != (2,) or seed.dtype != DType.int32:
        raise IRError(f"seed must be int32[2], got {seed}")
    t = TensorType.of(shape, dtype)
    if not t.dtype.is_float:
        raise IRError(f"random_uniform makes floats, not {t.dtype}")
    return t


random_uniform = defop(
    "random_uniform",
    infer=_uniform_infer,
    ref=_uniform_ref,
    differentiable=False,
    doc="Uniform [0, 1) values from an int32[2] seed, hashed per flat element index.",
)
