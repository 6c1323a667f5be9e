"""Advanced indexing (``x[i, j]``, ``x[:, i, None, j]``, ``x[i, j] = v``, ``index_put_``) as popir gathers
and scatters.

The indexed axes are moved to the front and merged into one, and the broadcast index tensors are combined
into one flat index into that merged axis; a read is then one ``gather`` along axis 0 (whose gradient is a
``scatter_add``), a write one ``scatter_add`` or ``scatter``. popsim plans both as tile-level gathers and
scatters over slices of the table. torch's placement rule for the result is kept: the broadcast index
dimensions replace the indexed axes when those are adjacent, and come first otherwise.
"""

import numpy as np

import popir
from poptorch import _device_checks
from poptorch.errors import Error

MASK_INDEX_HINT = (
    "indexing with a boolean mask (x[mask]) gives a result whose shape depends on the mask's values, which "
    "the IPU cannot compile; keep the shape fixed with torch.where(mask, x, other) or x * mask instead"
)


def _op(name, *inputs, **attrs):
    outputs = inputs[0].graph.apply(name, inputs, attrs)
    return outputs[0] if len(outputs) == 1 else outputs


def _int_const(graph, value):
    return graph.constant(np.asarray(value, dtype=np.int32))


def wrapped_index(idx, size):
    """Integer indices as int32 with negative ones counted from the end of an axis of ``size``."""
    if idx.dtype != "int32":
        idx = _op("cast", idx, dtype="int32")
    g = idx.graph
    negative = _op("lt", idx, _int_const(g, 0))
    return _op("where", negative, _op("add", idx, _int_const(g, size)), idx)


class _Plan:
    """How ``x[indices]`` maps onto a gather along axis 0 of x with its indexed axes merged in front."""

    def __init__(self, x, indices):
        used = [(axis, idx) for axis, idx in enumerate(indices) if idx is not None]
        if any(idx.dtype == "bool" for _, idx in used):
            raise Error(MASK_INDEX_HINT)
        self.x = x
        self.axes = [axis for axis, _ in used]
        self.rest = [a for a in range(x.ndim) if a not in self.axes]
        self.sizes = [x.shape[a] for a in self.axes]
        self.index_shape = tuple(np.broadcast_shapes(*(idx.shape for _, idx in used)))
        self.rest_shape = tuple(x.shape[a] for a in self.rest)
        # torch keeps the index dimensions in place only when the indexed axes are adjacent.
        adjacent = self.axes == list(range(self.axes[0], self.axes[-1] + 1))
        self.insert_at = self.axes[0] if adjacent else 0
        self.flat = self._flat_index([idx for _, idx in used])

    def _flat_index(self, idxs):
        g = self.x.graph
        strides = np.cumprod([1, *self.sizes[:0:-1]])[::-1]
        flat = None
        for idx, size, stride in zip(idxs, self.sizes, strides):
            term = wrapped_index(idx, size)
            if stride != 1:
                term = _op("mul", term, _int_const(g, int(stride)))
            flat = term if flat is None else _op("add", flat, term)
        if flat.shape != self.index_shape:
            flat = _op("broadcast_to", flat, shape=self.index_shape)
        return flat

    def table(self):
        """x with its indexed axes first, merged into one: (prod(sizes), *rest_shape)."""
        perm = tuple(self.axes + self.rest)
        x = self.x if perm == tuple(range(self.x.ndim)) else _op("transpose", self.x, perm=perm)
        return _op("reshape", x, shape=(int(np.prod(self.sizes)),) + self.rest_shape)

    def untable(self, table):
        """The inverse of ``table``: back to x's shape and axis order."""
        perm = self.axes + self.rest
        moved = _op("reshape", table, shape=tuple(self.x.shape[a] for a in perm))
        inverse = tuple(int(i) for i in np.argsort(perm))
        return moved if inverse == tuple(range(len(perm))) else _op("transpose", moved, perm=inverse)

    def _front_to_torch_perm(self):
        k, r = len(self.index_shape), len(self.rest_shape)
        at = self.insert_at
        return tuple(range(k, k + at)) + tuple(range(k)) + tuple(range(k + at, k + r))

    def torch_shape(self):
        """The shape torch gives ``x[indices]``."""
        front = self.index_shape + self.rest_shape
        return tuple(front[i] for i in self._front_to_torch_perm())

    def to_torch_layout(self, front):
        """A (*index_shape, *rest_shape) result moved to where torch puts the index dimensions."""
        perm = self._front_to_torch_perm()
        return front if perm == tuple(range(len(perm))) else _op("transpose", front, perm=perm)

    def to_front_layout(self, value):
        """The inverse of ``to_torch_layout``."""
        perm = self._front_to_torch_perm()
        inverse = tuple(int(i) for i in np.argsort(perm))
        return value if inverse == tuple(range(len(perm))) else _op("transpose", value, perm=inverse)


def advanced_index(x, indices):
    """``x[indices]`` (aten.index.Tensor): ``indices`` holds one index Value or None per leading axis."""
    used = [(axis, idx) for axis, idx in enumerate(indices) if idx is not None]
    if len(used) == 1 and used[0][1].dtype != "bool":
        axis, idx = used[0]  # one index tensor: a gather along its own axis already has torch's layout
        return _op("gather", x, wrapped_index(idx, x.shape[axis]), axis=axis)
    plan = _Plan(x, indices)
    return plan.to_torch_layout(_op("gather", plan.table(), plan.flat, axis=0))


def index_put(x, indices, values, accumulate):
    """``x[indices] = values`` (``+=`` when ``accumulate``) as a new Value (aten.index_put)."""
    if values.dtype != x.dtype:
        values = _op("cast", values, dtype=x.dtype)
    masks = [idx for idx in indices if idx is not None and idx.dtype == "bool"]
    if masks:
        return _masked_put(x, indices, values, accumulate)
    plan = _Plan(x, indices)
    result_shape = plan.torch_shape()
    if values.shape != result_shape:
        values = _op("broadcast_to", values, shape=result_shape)
    values = plan.to_front_layout(values)
    count = int(np.prod(plan.index_shape))
    updates = _op("reshape", values, shape=(count,) + plan.rest_shape)
    flat = _op("reshape", plan.flat, shape=(count,) + (1,) * len(plan.rest_shape))
    flat = _op("broadcast_to", flat, shape=updates.shape)
    table = plan.table()
    if accumulate:
        table = _op("scatter_add", table, flat, updates, axis=0)
    else:
        table = popir.ops.scatter(table, 0, flat, updates)
        _check_no_conflicting_writes(table, flat, updates)
    return plan.untable(table)


# Duplicates writing one value get that value back up to the rounding of their mean.
_CONFLICT_RTOL = 1e-4
_CONFLICT_MESSAGE = (
    "Assigning through indices (x[index] = values or index_put_) wrote different values to one position "
    "through duplicate indices. torch leaves which of them wins undefined (the last written on the CPU) and "
    "the simulated IPU does not model a write order, so it refuses rather than pick one: make the indices "
    "unique, or use index_put_(..., accumulate=True) / index_add_ to add them up"
)


def _check_no_conflicting_writes(table, flat, updates):
    """Check on the device that every position written more than once got one value (``scatter`` gives the
    mean of duplicates, which is no value torch would write when they differ)."""
    written = _op("cast", _op("take_along_axis", table, flat, axis=0), dtype="float32")
    wanted = _op("cast", updates, dtype="float32")
    graph = table.graph
    limit = _op("abs", wanted) * graph.constant(np.float32(_CONFLICT_RTOL)) + graph.constant(np.float32(1e-30))
    conflict = _op("cast", _op("gt", _op("abs", written - wanted), limit), dtype="float32")
    flag = _op("reduce_max", conflict, axes=None, keepdims=False)
    _device_checks.record(graph, flag, _CONFLICT_MESSAGE, table.producer.source)


def _masked_put(x, indices, values, accumulate):
    """``x[mask] = value`` with one boolean mask and a single value: a ``where``, no value-dependent shape."""
    used = [(axis, idx) for axis, idx in enumerate(indices) if idx is not None]
    (axis, mask), *others = used
    if others or values.type.size != 1:
        raise Error(
            f"{MASK_INDEX_HINT} (assigning through a boolean mask is supported when the mask is the only index "
            "and the value is a single element)"
        )
    if tuple(x.shape[axis : axis + mask.ndim]) != mask.shape:
        raise Error(f"the boolean mask {list(mask.shape)} does not match the indexed axes of {list(x.shape)}")
    mask = _op("reshape", mask, shape=(1,) * axis + mask.shape + (1,) * (x.ndim - axis - mask.ndim))
    mask = _op("broadcast_to", mask, shape=x.shape)
    value = _op("broadcast_to", _op("reshape", values, shape=()), shape=x.shape)
    if accumulate:
        return _op("add", x, _op("where", mask, value, popir.ops.zeros_like(value)))
    return _op("where", mask, value, x)
