"""Element types of popir values and their NumPy equivalents."""

import enum

import numpy as np

from popir.errors import IRError


class DType(str, enum.Enum):
    """Device element types. Frontends narrow int64 to int32 and float64 to float32."""

    float32 = "float32"
    float16 = "float16"
    int32 = "int32"
    bool = "bool"

    @property
    def numpy(self):
        return _NUMPY[self]

    @property
    def itemsize(self):
        return _ITEMSIZE[self]

    @property
    def is_float(self):
        return self in (DType.float32, DType.float16)

    def __str__(self):
        return str.__str__(self)  # the value, without Enum's descriptor lookup (hot in the compile path)


# Looked up per vertex and per block at compile time, so computed once here.
_NUMPY = {d: np.dtype(str.__str__(d)) for d in DType}
_ITEMSIZE = {d: n.itemsize for d, n in _NUMPY.items()}

_NARROW = {np.dtype("int64"): DType.int32, np.dtype("float64"): DType.float32}


def as_dtype(value):
    """A DType from a DType, its name, or a NumPy dtype (int64/float64 narrowed, as on the device)."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str) and value in DType.__members__:
        return DType[value]
    try:
        np_dtype = np.dtype(value)
    except TypeError as exc:
        raise IRError(f"not a dtype: {value!r}") from exc
    if np_dtype in _NARROW:
        return _NARROW[np_dtype]
    try:
        return DType(np_dtype.name)
    except ValueError:
        raise IRError(f"dtype {np_dtype} is not supported on the device") from None
