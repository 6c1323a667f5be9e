"""The op database, in the OpInfo style: one entry per popir primitive and per composite op.

Each ``OpEntry`` holds a hypothesis strategy of ``Sample``s (input arrays and attributes), the function that
applies the op to graph Values, the value domain its float inputs are drawn from, tolerances, which inputs
are differentiable, and the name of the equivalent torch function (a string: this module never imports torch)
with ``torch_args`` mapping a sample to that function's (args, kwargs) as NumPy arrays and Python values.

    entry = OPDB["conv2d"]
    sample = data.draw(entry.samples())
    graph, feeds = entry.make_graph(sample)     # one node (or one composite) with outputs out0, out1, ...

popir tests check shape rules and VJPs; popsim tests run the same graphs; poptorch tests call torch.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

import popir
from popir import ops


@dataclass
class Sample:
    """Named input arrays (in argument order) and keyword attributes for one application of an op."""

    inputs: dict
    attrs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OpEntry:
    """One op of the database (see the module docstring)."""

    name: str
    draw: Callable  # (draw, dtype) -> Sample
    apply: Callable  # (*values, **attrs) -> Value(s); an op without Value inputs gets (graph, **attrs)
    torch: str | None  # dotted name of the eager torch equivalent (None: no public torch function)
    torch_args: Callable | None = None  # Sample -> (args, kwargs); default: inputs in order, attrs as kwargs
    primitive: bool = True
    grad: tuple = ()  # names of the inputs whose gradient is checked
    domain: tuple = (-2.0, 2.0)
    dtypes: tuple = ("float32",)
    rtol: float = 1e-5
    atol: float = 1e-6
    fp16_rtol: float = 1e-2
    fp16_atol: float = 1e-3

    def samples(self, dtype=None):
        """A hypothesis strategy of Samples (float inputs in ``dtype``, default the entry's first dtype)."""
        dtype = dtype or self.dtypes[0]
        return st.composite(lambda draw: self.draw(Drawer(draw, dtype, self.domain)))()

    def make_graph(self, sample):
        """(graph, feeds): a graph whose inputs are the sample's arrays and whose outputs are out0, out1, ..."""
        graph = popir.Graph(self.name)
        values = [graph.add_input(k, v.shape, popir.as_dtype(v.dtype)) for k, v in sample.inputs.items()]
        result = self.apply(*(values or [graph]), **sample.attrs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for i, value in enumerate(r for r in results if r is not None):
            graph.output(f"out{i}", value)
        return graph, dict(sample.inputs)

    def torch_call(self, sample):
        """(args, kwargs) for the torch function named by ``torch``."""
        if self.torch_args is not None:
            return self.torch_args(sample)
        return list(sample.inputs.values()), dict(sample.attrs)


class Drawer:
    """Draws shapes, attributes and seeded arrays for one sample."""

    def __init__(self, draw, dtype, domain):
        self.draw, self.dtype, self.domain = draw, np.dtype(dtype), domain
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def __call__(self, strategy):
        return self.draw(strategy)

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def bool(self):
        return self.draw(st.booleans())

    def choice(self, options):
        return self.draw(st.sampled_from(list(options)))

    def shape(self, min_rank=0, max_rank=3, min_side=1, max_side=4):
        return tuple(self.int(min_side, max_side) for _ in range(self.int(min_rank, max_rank)))

    def broadcastable(self, shape):
        """A shape that broadcasts with ``shape``: some leading axes dropped, some sides set to 1."""
        shape = shape[self.int(0, len(shape)) :]
        return tuple(1 if self.bool() else d for d in shape)

    def floats(self, shape, domain=None):
        lo, hi = domain or self.domain
        return np.asarray(self.rng.uniform(lo, hi, shape), self.dtype)

    def away_from_zero(self, shape, magnitude=(0.5, 2.0)):
        return np.asarray(self.rng.uniform(*magnitude, shape) * self.rng.choice([-1, 1], shape), self.dtype)

    def ints(self, shape, lo, hi):
        return np.asarray(self.rng.integers(lo, hi, shape, endpoint=False), np.int32)

    def bools(self, shape):
        return np.asarray(self.rng.random(shape) < 0.5)

    def axes(self, ndim):
        """None or a tuple of distinct axes (possibly negative) of a rank-``ndim`` tensor."""
        if ndim == 0 or self.bool():
            return None
        chosen = [a for a in range(ndim) if self.bool()] or [0]
        return tuple(a - ndim if self.bool() else a for a in chosen)


OPDB = {}


def entry(name, draw, apply, torch, **kw):
    OPDB[name] = OpEntry(name, draw, apply, torch, **kw)


def primitives():
    """Entries of registry primitives."""
    return [e for e in OPDB.values() if e.primitive]


def composites():
    """Entries of composite ops."""
    return [e for e in OPDB.values() if not e.primitive]


# -- elementwise ------------------------------------------------------------------------------------------
def _unary(domain=None):
    return lambda d: Sample({"x": d.floats(d.shape(), domain)})


_POSITIVE = (0.2, 3.0)
_UNARY = {
    "neg": ("torch.neg", None),
    "exp": ("torch.exp", None),
    "log": ("torch.log", _POSITIVE),
    "sqrt": ("torch.sqrt", _POSITIVE),
    "rsqrt": ("torch.rsqrt", _POSITIVE),
    "tanh": ("torch.tanh", None),
    "sigmoid": ("torch.sigmoid", (-6.0, 6.0)),
    "erf": ("torch.erf", None),
    "abs": ("torch.abs", None),
    "sin": ("torch.sin", (-4.0, 4.0)),
    "cos": ("torch.cos", (-4.0, 4.0)),
    "relu": ("torch.relu", None),
}
for _name, (_torch, _domain) in _UNARY.items():
    entry(_name, _unary(_domain), getattr(ops, _name), _torch, grad=("x",), dtypes=("float32", "float16"))
entry("sign", _unary(), ops.sign, "torch.sign", dtypes=("float32", "int32"))


def _binary(b_values=None, a_domain=None):
    def draw(d):
        shape = d.shape()
        a_shape, b_shape = (shape, d.broadcastable(shape)) if d.bool() else (d.broadcastable(shape), shape)
        b = b_values(d, b_shape) if b_values else d.floats(b_shape)
        return Sample({"a": d.floats(a_shape, a_domain), "b": b})

    return draw


_BINARY = {
    "add": ("torch.add", _binary()),
    "sub": ("torch.sub", _binary()),
    "mul": ("torch.mul", _binary()),
    "div": ("torch.div", _binary(lambda d, s: d.away_from_zero(s))),
    "pow": ("torch.pow", _binary(a_domain=_POSITIVE)),
    "maximum": ("torch.maximum", _binary()),
    "minimum": ("torch.minimum", _binary()),
}
for _name, (_torch, _draw) in _BINARY.items():
    entry(_name, _draw, getattr(ops, _name), _torch, grad=("a", "b"), dtypes=("float32", "float16"))


def _comparison(d):
    shape = d.shape()
    # Few distinct values, so equality actually happens.
    return Sample(
        {"a": d.ints(shape, -2, 3).astype(d.dtype), "b": d.ints(d.broadcastable(shape), -2, 3).astype(d.dtype)}
    )


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    entry(_name, _comparison, getattr(ops, _name), f"torch.{_name}", dtypes=("float32", "int32"))


def _logical(arity):
    def draw(d):
        shape = d.shape()
        names = ("a", "b")[:arity]
        return Sample({n: d.bools(shape if i == 0 else d.broadcastable(shape)) for i, n in enumerate(names)})

    return draw


for _name, _arity in (("logical_and", 2), ("logical_or", 2), ("logical_not", 1)):
    entry(_name, _logical(_arity), getattr(ops, _name), f"torch.{_name}")


def _where(d):
    shape = d.shape()
    return Sample(
        {"cond": d.bools(d.broadcastable(shape)), "a": d.floats(shape), "b": d.floats(d.broadcastable(shape))}
    )


entry("where", _where, ops.where, "torch.where", grad=("a", "b"), dtypes=("float32", "float16"))


def _cast(d):
    return Sample({"x": d.floats(d.shape(), (-5.0, 5.0))}, {"dtype": d.choice(["float32", "float16", "int32", "bool"])})


entry(
    "cast",
    _cast,
    ops.cast,
    "torch.Tensor.to",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["dtype"]], {}),
    grad=("x",),
)


entry("stop_gradient", _unary(), ops.stop_gradient, "torch.Tensor.detach", dtypes=("float32", "float16", "int32"))


def _constant(d):
    return Sample({}, {"value": d.floats(d.shape())})


entry(
    "constant",
    _constant,
    lambda graph, value: graph.constant(value),
    "torch.tensor",
    torch_args=lambda s: ([s.attrs["value"]], {}),
)


# -- reductions -------------------------------------------------------------------------------------------
def _reduce(d):
    shape = d.shape(min_rank=1)
    return Sample({"x": d.floats(shape)}, {"axes": d.axes(len(shape)), "keepdims": d.bool()})


def _reduce_torch(s):
    axes = s.attrs["axes"]
    dim = tuple(range(s.inputs["x"].ndim)) if axes is None else axes
    return [s.inputs["x"]], {"dim": dim, "keepdim": s.attrs["keepdims"]}


entry(
    "reduce_sum",
    _reduce,
    ops.reduce_sum,
    "torch.sum",
    torch_args=_reduce_torch,
    grad=("x",),
    dtypes=("float32", "float16"),
)
entry("reduce_max", _reduce, ops.reduce_max, "torch.amax", torch_args=_reduce_torch, grad=("x",))
entry("reduce_min", _reduce, ops.reduce_min, "torch.amin", torch_args=_reduce_torch, grad=("x",))


def _arg(d):
    shape = d.shape(min_rank=1)
    axis = None if d.bool() else d.int(-len(shape), len(shape) - 1)
    return Sample({"x": d.floats(shape)}, {"axis": axis, "keepdims": d.bool() and axis is not None})


def _arg_torch(s):
    return [s.inputs["x"]], {"dim": s.attrs["axis"], "keepdim": s.attrs["keepdims"]}


entry("argmax", _arg, ops.argmax, "torch.argmax", torch_args=_arg_torch)
entry("argmin", _arg, ops.argmin, "torch.argmin", torch_args=_arg_torch)


# -- movement ---------------------------------------------------------------------------------------------
def _reshape(d):
    shape = d.shape()
    size = math.prod(shape)
    factors = [f for f in range(1, size + 1) if size % f == 0]
    first = d.choice(factors)
    target = d.choice([(size,), (first, size // first), (size // first, 1, first)])
    return Sample({"x": d.floats(shape)}, {"shape": target})


entry("reshape", _reshape, ops.reshape, "torch.reshape", grad=("x",))


def _broadcast(d):
    target = d.shape(min_rank=1)
    return Sample({"x": d.floats(d.broadcastable(target))}, {"shape": target})


entry(
    "broadcast_to",
    _broadcast,
    ops.broadcast_to,
    "torch.broadcast_to",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["shape"]], {}),
    grad=("x",),
)


def _transpose(d):
    shape = d.shape(min_rank=1, max_rank=4)
    return Sample({"x": d.floats(shape)}, {"perm": tuple(d(st.permutations(range(len(shape)))))})


entry(
    "transpose",
    _transpose,
    ops.transpose,
    "torch.permute",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["perm"]], {}),
    grad=("x",),
)


def _slice(d):
    shape = d.shape(min_rank=1, max_side=7)
    starts = tuple(d.int(-n, n) for n in shape)
    stops = tuple(d.int(-n, n + 2) for n in shape)
    return Sample(
        {"x": d.floats(shape)}, {"starts": starts, "stops": stops, "steps": tuple(d.int(1, 3) for _ in shape)}
    )


def _slice_torch(s):
    index = tuple(slice(a, b, c) for a, b, c in zip(s.attrs["starts"], s.attrs["stops"], s.attrs["steps"]))
    return [s.inputs["x"], index], {}


entry("slice", _slice, ops.slice, "torch.Tensor.__getitem__", torch_args=_slice_torch, grad=("x",))


def _slice_update(d):
    """One axis sliced (as torch.slice_scatter takes it), the others whole."""
    shape = d.shape(min_rank=1, max_side=7)
    axis = d.int(0, len(shape) - 1)
    start, step = d.int(0, shape[axis] - 1), d.int(1, 3)
    stop = d.int(start + 1, shape[axis])
    starts = tuple(start if i == axis else 0 for i in range(len(shape)))
    stops = tuple(stop if i == axis else n for i, n in enumerate(shape))
    steps = tuple(step if i == axis else 1 for i in range(len(shape)))
    region = tuple(len(range(a, b, c)) for a, b, c in zip(starts, stops, steps))
    attrs = {"starts": starts, "stops": stops, "steps": steps}
    return Sample({"x": d.floats(shape), "update": d.floats(region)}, attrs)


def _slice_update_torch(s):
    bounds = list(zip(s.attrs["starts"], s.attrs["stops"], s.attrs["steps"]))
    axis = next((i for i, (a, b, c) in enumerate(bounds) if (a, b, c) != (0, s.inputs["x"].shape[i], 1)), 0)
    start, stop, step = bounds[axis]
    return [s.inputs["x"], s.inputs["update"], axis, start, stop, step], {}


entry(
    "slice_update",
    _slice_update,
    ops.slice_update,
    "torch.slice_scatter",
    torch_args=_slice_update_torch,
    grad=("x", "update"),
)


def _concat(d):
    shape = d.shape(min_rank=1)
    axis = d.int(-len(shape), len(shape) - 1)
    parts = {}
    for i in range(d.int(1, 3)):
        part = list(shape)
        part[axis] = d.int(0 if i else 1, 3)
        parts[f"x{i}"] = d.floats(tuple(part))
    return Sample(parts, {"axis": axis})


entry(
    "concat",
    _concat,
    ops.concat,
    "torch.cat",
    torch_args=lambda s: ([list(s.inputs.values())], {"dim": s.attrs["axis"]}),
    grad=("x0", "x1", "x2"),
)


def _pad(d):
    shape = d.shape(min_rank=1)
    pads = tuple((d.int(0, 2), d.int(0, 2)) for _ in shape)
    return Sample({"x": d.floats(shape)}, {"pads": pads, "value": d.choice([0.0, 1.5, -3.0])})


def _pad_torch(s):
    flat = [p for pair in reversed(s.attrs["pads"]) for p in pair]
    return [s.inputs["x"], flat], {"value": s.attrs["value"]}


entry("pad", _pad, ops.pad, "torch.nn.functional.pad", torch_args=_pad_torch, grad=("x",))


def _gather(d):
    shape = d.shape(min_rank=1)
    axis = d.int(-len(shape), len(shape) - 1)
    indices = d.ints((d.int(0, 5),), 0, shape[axis])
    return Sample({"x": d.floats(shape), "indices": indices}, {"axis": axis})


entry(
    "gather",
    _gather,
    ops.gather,
    "torch.index_select",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.inputs["indices"]], {}),
    grad=("x",),
)


def _along(d):
    shape = d.shape(min_rank=1)
    axis = d.int(-len(shape), len(shape) - 1)
    index_shape = tuple(d.int(1, 4) if i == axis % len(shape) else n for i, n in enumerate(shape))
    return shape, index_shape, axis, d.ints(index_shape, 0, shape[axis])


def _take_along(d):
    shape, _, axis, indices = _along(d)
    return Sample({"x": d.floats(shape), "indices": indices}, {"axis": axis})


entry(
    "take_along_axis",
    _take_along,
    ops.take_along_axis,
    "torch.take_along_dim",
    torch_args=lambda s: ([s.inputs["x"], s.inputs["indices"]], {"dim": s.attrs["axis"]}),
    grad=("x",),
)


def _scatter_add(d):
    shape, index_shape, axis, indices = _along(d)
    return Sample({"x": d.floats(shape), "indices": indices, "updates": d.floats(index_shape)}, {"axis": axis})


entry(
    "scatter_add",
    _scatter_add,
    ops.scatter_add,
    "torch.scatter_add",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.inputs["indices"], s.inputs["updates"]], {}),
    grad=("x", "updates"),
)


def _matmul(d):
    m, k, n = d.int(1, 4), d.int(1, 4), d.int(1, 4)
    batch = d.shape(max_rank=2)
    a_shape = d.choice([(k,), (m, k), d.broadcastable(batch) + (m, k)])
    b_shape = d.choice([(k,), (k, n), d.broadcastable(batch) + (k, n)])
    return Sample({"a": d.floats(a_shape), "b": d.floats(b_shape)})


entry("matmul", _matmul, ops.matmul, "torch.matmul", grad=("a", "b"), dtypes=("float32", "float16"))


# -- convolution and pooling -----------------------------------------------------------------------------
def _conv_config(d):
    groups = d.int(1, 2)
    cg, og = d.int(1, 2), d.int(1, 2)
    kernel = (d.int(1, 3), d.int(1, 3))
    stride = (d.int(1, 2), d.int(1, 2))
    dilation = (d.int(1, 2), d.int(1, 2))
    padding = tuple((p, p) for p in (d.int(0, 2), d.int(0, 2)))
    spatial = tuple(dl * (k - 1) + 1 + d.int(0, 4) for k, dl in zip(kernel, dilation))
    x_shape = (d.int(1, 2), groups * cg) + spatial
    w_shape = (groups * og, cg) + kernel
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    x = popir.Graph().add_input("x", x_shape, "float32")
    w = x.graph.add_input("w", w_shape, "float32")
    return x_shape, w_shape, ops.conv2d(x, w, **attrs).shape, attrs


def _conv_torch_kwargs(attrs):
    return {
        "stride": attrs["stride"],
        "padding": tuple(lo for lo, _ in attrs["padding"]),
        "dilation": attrs["dilation"],
        "groups": attrs["groups"],
    }


def _conv2d(d):
    x_shape, w_shape, _, attrs = _conv_config(d)
    return Sample({"x": d.floats(x_shape), "w": d.floats(w_shape)}, attrs)


entry(
    "conv2d",
    _conv2d,
    ops.conv2d,
    "torch.nn.functional.conv2d",
    torch_args=lambda s: ([s.inputs["x"], s.inputs["w"]], _conv_torch_kwargs(s.attrs)),
    grad=("x", "w"),
    dtypes=("float32", "float16"),
    rtol=1e-4,
    atol=1e-5,
)


def _conv_grad_input(d):
    x_shape, w_shape, y_shape, attrs = _conv_config(d)
    return Sample({"gy": d.floats(y_shape), "w": d.floats(w_shape)}, {"input_shape": x_shape, **attrs})


entry(
    "conv2d_grad_input",
    _conv_grad_input,
    ops.conv2d_grad_input,
    "torch.nn.grad.conv2d_input",
    torch_args=lambda s: (
        [s.attrs["input_shape"], s.inputs["w"], s.inputs["gy"]],
        _conv_torch_kwargs(s.attrs),
    ),
    grad=("gy", "w"),
    rtol=1e-4,
    atol=1e-5,
)


def _conv_grad_weight(d):
    x_shape, w_shape, y_shape, attrs = _conv_config(d)
    return Sample({"x": d.floats(x_shape), "gy": d.floats(y_shape)}, {"weight_shape": w_shape, **attrs})


entry(
    "conv2d_grad_weight",
    _conv_grad_weight,
    ops.conv2d_grad_weight,
    "torch.nn.grad.conv2d_weight",
    torch_args=lambda s: (
        [s.inputs["x"], s.attrs["weight_shape"], s.inputs["gy"]],
        _conv_torch_kwargs(s.attrs),
    ),
    grad=("x", "gy"),
    rtol=1e-4,
    atol=1e-5,
)


def _pool_config(d):
    kernel = (d.int(1, 3), d.int(1, 3))
    stride = (d.int(1, 3), d.int(1, 3))
    dilation = (d.int(1, 2), d.int(1, 2))
    padding = tuple((p, p) for p in (d.int(0, k // 2) for k in kernel))
    spatial = tuple(dl * (k - 1) + 1 + d.int(0, 4) for k, dl in zip(kernel, dilation))
    shape = (d.int(1, 2), d.int(1, 3)) + spatial
    attrs = {"kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation, "ceil_mode": d.bool()}
    x = popir.Graph().add_input("x", shape, "float32")
    return shape, ops.max_pool2d(x, **attrs).shape, attrs


def _max_pool(d):
    shape, _, attrs = _pool_config(d)
    return Sample({"x": d.floats(shape)}, attrs)


def _pool_torch(s):
    a = s.attrs
    kwargs = {"stride": a["stride"], "padding": tuple(lo for lo, _ in a["padding"]), "dilation": a["dilation"]}
    return [s.inputs["x"], a["kernel"]], {**kwargs, "ceil_mode": a["ceil_mode"]}


entry(
    "max_pool2d",
    _max_pool,
    ops.max_pool2d,
    "torch.nn.functional.max_pool2d",
    torch_args=_pool_torch,
    grad=("x",),
    dtypes=("float32", "float16"),
)


def _max_pool_grad(d):
    shape, y_shape, attrs = _pool_config(d)
    return Sample({"x": d.floats(shape), "gy": d.floats(y_shape)}, attrs)


entry("max_pool2d_grad", _max_pool_grad, ops.max_pool2d_grad, None, grad=("gy",))


def _max_pool_select(d):
    shape, _, attrs = _pool_config(d)
    return Sample({"x": d.floats(shape), "c": d.floats(shape)}, attrs)


entry("max_pool2d_select", _max_pool_select, ops.max_pool2d_select, None, grad=("c",))


def _uniform(d):
    seed = np.array([d.int(-(2**31), 2**31 - 1), d.int(-(2**31), 2**31 - 1)], np.int32)
    return Sample({"seed": seed}, {"shape": d.shape(), "dtype": str(d.dtype)})


entry("random_uniform", _uniform, ops.random_uniform, None, dtypes=("float32", "float16"))

# A host callback with two results of different shapes: doubled values and row sums.
ops.register_host_callback("opdb.double_and_sum", lambda x: (x * 2, x.sum(axis=-1)))


def _host_call(d):
    shape = d.shape(min_rank=1)
    out_types = ((shape, str(d.dtype)), (shape[:-1], str(d.dtype)))
    return Sample({"x": d.floats(shape)}, {"callback": "opdb.double_and_sum", "out_types": out_types})


entry("host_call", _host_call, ops.host_call, None, dtypes=("float32", "float16"))


# -- composites -------------------------------------------------------------------------------------------
def _axis_of(d, ndim):
    return d.int(-ndim, ndim - 1)


def _softmax(d):
    shape = d.shape(min_rank=1)
    return Sample({"x": d.floats(shape, (-4.0, 4.0))}, {"axis": _axis_of(d, len(shape))})


_DIM = lambda s: ([s.inputs["x"]], {"dim": s.attrs["axis"]})  # noqa: E731
entry("softmax", _softmax, ops.softmax, "torch.softmax", torch_args=_DIM, primitive=False, grad=("x",))
entry("log_softmax", _softmax, ops.log_softmax, "torch.log_softmax", torch_args=_DIM, primitive=False, grad=("x",))


def _logsumexp(d):
    shape = d.shape(min_rank=1)
    return Sample({"x": d.floats(shape, (-4.0, 4.0))}, {"axes": d.axes(len(shape)), "keepdims": d.bool()})


entry(
    "logsumexp",
    _logsumexp,
    ops.logsumexp,
    "torch.logsumexp",
    torch_args=_reduce_torch,
    primitive=False,
    grad=("x",),
)
entry("mean", _reduce, ops.mean, "torch.mean", torch_args=_reduce_torch, primitive=False, grad=("x",))


def _var(d):
    shape = d.shape(min_rank=1, min_side=2)
    return Sample({"x": d.floats(shape)}, {"axes": d.axes(len(shape)), "keepdims": d.bool(), "correction": d.int(0, 1)})


def _var_torch(s):
    args, kwargs = _reduce_torch(s)
    return args, {**kwargs, "correction": s.attrs["correction"]}


entry("var", _var, ops.var, "torch.var", torch_args=_var_torch, primitive=False, grad=("x",))
entry("std", _var, ops.std, "torch.std", torch_args=_var_torch, primitive=False, grad=("x",))


def _gelu(d):
    return Sample({"x": d.floats(d.shape(), (-4.0, 4.0))}, {"approximate": d.choice(["none", "tanh"])})


entry("gelu", _gelu, ops.gelu, "torch.nn.functional.gelu", primitive=False, grad=("x",))
entry("silu", _unary((-4.0, 4.0)), ops.silu, "torch.nn.functional.silu", primitive=False, grad=("x",))


def _clamp(d):
    lo = d.choice([None, -1.0, 0.5])
    return Sample({"x": d.floats(d.shape())}, {"lo": lo, "hi": d.choice([None, 1.0]) if lo is not None else 1.5})


entry(
    "clamp",
    _clamp,
    ops.clamp,
    "torch.clamp",
    torch_args=lambda s: ([s.inputs["x"]], {"min": s.attrs["lo"], "max": s.attrs["hi"]}),
    primitive=False,
    grad=("x",),
)


# Layer, group, instance and batch norm samples normalise groups of at least 3 elements: a group of 2
# normalises to +-1 whatever its values, so its gradient is rounding noise in every implementation (torch's
# float32 gradient of such a pair does not even sum to zero).
def _layer_norm(d):
    shape = d.shape(min_rank=1, min_side=3)
    norm = shape[d.int(0, len(shape) - 1) :]
    affine = d.bool()
    inputs = {"x": d.floats(shape)}
    if affine:
        inputs.update(weight=d.floats(norm), bias=d.floats(norm))
    return Sample(inputs, {"normalized_shape": norm})


entry(
    "layer_norm",
    _layer_norm,
    lambda x, weight=None, bias=None, **a: ops.layer_norm(x, weight=weight, bias=bias, **a),
    "torch.nn.functional.layer_norm",
    torch_args=lambda s: (
        [s.inputs["x"], s.attrs["normalized_shape"], s.inputs.get("weight"), s.inputs.get("bias")],
        {},
    ),
    primitive=False,
    grad=("x", "weight", "bias"),
    rtol=1e-4,
    atol=1e-5,
)


def _group_norm(d):
    groups = d.int(1, 3)
    shape = (d.int(1, 3), groups * d.int(1, 2)) + d.shape(min_rank=1, max_rank=2, min_side=3)
    inputs = {"x": d.floats(shape)}
    if d.bool():
        inputs.update(weight=d.floats(shape[1:2]), bias=d.floats(shape[1:2]))
    return Sample(inputs, {"num_groups": groups})


entry(
    "group_norm",
    _group_norm,
    lambda x, weight=None, bias=None, **a: ops.group_norm(x, weight=weight, bias=bias, **a),
    "torch.nn.functional.group_norm",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["num_groups"], s.inputs.get("weight"), s.inputs.get("bias")], {}),
    primitive=False,
    grad=("x", "weight", "bias"),
    rtol=1e-4,
    atol=1e-5,
)


def _batch_norm(d):
    shape = (d.int(3, 4), d.int(1, 3)) + d.shape(max_rank=2)
    c = shape[1:2]
    inputs = {
        "x": d.floats(shape),
        "running_mean": d.floats(c),
        "running_var": d.floats(c, (0.5, 2.0)),
        "weight": d.floats(c),
        "bias": d.floats(c),
    }
    return Sample(inputs, {"training": d.bool(), "momentum": d.choice([0.1, 0.5]), "eps": 1e-5})


entry(
    "batch_norm",
    _batch_norm,
    ops.batch_norm,
    "torch.nn.functional.batch_norm",
    primitive=False,
    grad=("x", "weight", "bias"),
    rtol=1e-4,
    atol=1e-5,
)


def _linear(d):
    features_in, features_out = d.int(1, 4), d.int(1, 4)
    inputs = {"x": d.floats(d.shape(max_rank=2) + (features_in,)), "weight": d.floats((features_out, features_in))}
    if d.bool():
        inputs["bias"] = d.floats((features_out,))
    return Sample(inputs)


entry("linear", _linear, ops.linear, "torch.nn.functional.linear", primitive=False, grad=("x", "weight", "bias"))


def _embedding(d):
    rows = d.int(1, 5)
    return Sample({"weight": d.floats((rows, d.int(1, 4))), "indices": d.ints(d.shape(), 0, rows)})


entry(
    "embedding",
    _embedding,
    ops.embedding,
    "torch.nn.functional.embedding",
    torch_args=lambda s: ([s.inputs["indices"], s.inputs["weight"]], {}),
    primitive=False,
    grad=("weight",),
)


def _classification(d, ignore=True):
    n, c = d.int(1, 4), d.int(2, 4)
    spatial = d.shape(max_rank=1)
    target = d.ints((n,) + spatial, 0, c)
    if ignore and d.bool():
        target.flat[0] = -100
    return n, c, spatial, target


def _nll_loss(d):
    n, c, spatial, target = _classification(d)
    inputs = {"log_probs": d.floats((n, c) + spatial, (-3.0, 0.0)), "target": target}
    if d.bool():
        inputs["weight"] = d.floats((c,), (0.5, 2.0))
    return Sample(inputs, {"reduction": d.choice(["mean", "sum", "none"])})


def _loss_torch(s):
    args = list(s.inputs.values())
    return args, dict(s.attrs)


entry(
    "nll_loss",
    _nll_loss,
    ops.nll_loss,
    "torch.nn.functional.nll_loss",
    torch_args=_loss_torch,
    primitive=False,
    grad=("log_probs",),
)


def _cross_entropy(d):
    n, c, spatial, target = _classification(d)
    if d.bool():
        target = d.floats((n, c) + spatial, (0.0, 1.0))
    inputs = {"logits": d.floats((n, c) + spatial, (-3.0, 3.0)), "target": target}
    if d.bool():
        inputs["weight"] = d.floats((c,), (0.5, 2.0))
    attrs = {"reduction": d.choice(["mean", "sum", "none"]), "label_smoothing": d.choice([0.0, 0.1])}
    if not np.issubdtype(target.dtype, np.floating) and attrs["label_smoothing"] and attrs["reduction"] == "none":
        attrs["reduction"] = "mean"
    return Sample(inputs, attrs)


entry(
    "cross_entropy",
    _cross_entropy,
    ops.cross_entropy,
    "torch.nn.functional.cross_entropy",
    torch_args=_loss_torch,
    primitive=False,
    grad=("logits", "weight"),
    rtol=1e-4,
    atol=1e-5,
)


def _mse(d):
    shape = d.shape()
    return Sample({"a": d.floats(shape), "b": d.floats(shape)}, {"reduction": d.choice(["mean", "sum", "none"])})


entry("mse_loss", _mse, ops.mse_loss, "torch.nn.functional.mse_loss", primitive=False, grad=("a", "b"))


def _avg_pool(d):
    shape, _, attrs = _pool_config(d)
    kernel = attrs["kernel"]
    padding = tuple(min(lo, k // 2) for (lo, _), k in zip(attrs["padding"], kernel))
    return Sample(
        {"x": d.floats(shape)},
        {
            "kernel": kernel,
            "stride": attrs["stride"],
            "padding": padding,
            "ceil_mode": attrs["ceil_mode"],
            "count_include_pad": d.bool(),
        },
    )


entry(
    "avg_pool2d",
    _avg_pool,
    ops.avg_pool2d,
    "torch.nn.functional.avg_pool2d",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["kernel"]], {k: v for k, v in s.attrs.items() if k != "kernel"}),
    primitive=False,
    grad=("x",),
)


def _conv_transpose(d):
    x_shape, w_shape, y_shape, attrs = _conv_config(d)
    out_pad = tuple(d.int(0, max(s, dl) - 1) for s, dl in zip(attrs["stride"], attrs["dilation"]))
    return Sample(
        {"x": d.floats(y_shape), "weight": d.floats(w_shape)},
        {
            "stride": attrs["stride"],
            "padding": tuple(lo for lo, _ in attrs["padding"]),
            "output_padding": out_pad,
            "groups": attrs["groups"],
            "dilation": attrs["dilation"],
        },
    )


entry(
    "conv_transpose2d",
    _conv_transpose,
    ops.conv_transpose2d,
    "torch.nn.functional.conv_transpose2d",
    primitive=False,
    grad=("x", "weight"),
    rtol=1e-4,
    atol=1e-5,
)


def _dropout(d):
    seed = np.array([d.int(0, 1000), d.int(0, 1000)], np.int32)
    return Sample({"x": d.floats(d.shape()), "seed": seed}, {"p": d.choice([0.0, 0.25, 0.5, 1.0])})


entry("dropout", _dropout, lambda x, seed, p: ops.dropout(x, p, seed), None, primitive=False, grad=("x",))


def _masked_fill(d):
    shape = d.shape()
    return Sample({"x": d.floats(shape), "mask": d.bools(d.broadcastable(shape))}, {"value": d.choice([0.0, -1e4])})


entry(
    "masked_fill",
    _masked_fill,
    ops.masked_fill,
    "torch.Tensor.masked_fill",
    primitive=False,
    grad=("x",),
)


# -- gradient checking ------------------------------------------------------------------------------------
def vjp_check(graph, feeds, wrt, seed=0, eps=1e-6):
    """Dot-product test of popir autodiff on ``graph`` in float64: (<vjp(ct), dx>, central difference).

    The loss is sum_i <out_i, ct_i> over the float outputs with random cotangents ct_i; dx is a random
    direction in the inputs named by ``wrt``. Returns both numbers; they agree when the VJPs are right.
    """
    rng = np.random.default_rng(seed)
    outputs = [v for v in graph.outputs.values() if v.dtype.is_float]
    feeds = {
        k: np.asarray(v, np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating) else v for k, v in feeds.items()
    }
    loss = None
    for i, out in enumerate(outputs):
        ct = graph.add_input(f"__ct{i}", out.shape, out.dtype)
        feeds[ct.name] = rng.standard_normal(out.shape)
        term = ops.reduce_sum(out * ct, axes=None, keepdims=False)
        loss = term if loss is None else loss + term
    values = [graph.input(name) for name in wrt]
    grads = popir.autodiff.grad(graph, loss, values)
    graph.verify()
    directions = {name: rng.standard_normal(feeds[name].shape) for name in wrt}
    env = popir.interpreter.evaluate(graph, feeds, compute_dtype=np.float64)
    analytic = sum(float(np.sum(env[g.id] * directions[name])) for g, name in zip(grads, wrt))

    def loss_at(step):
        moved = {**feeds, **{name: feeds[name] + step * directions[name] for name in wrt}}
        return float(popir.interpreter.evaluate(graph, moved, compute_dtype=np.float64)[loss.id])

    return analytic, (loss_at(eps) - loss_at(-eps)) / (2 * eps)


# -- wave 2: more elementwise math ------------------------------------------------------------------------
def _off_half(d):
    # Keep rounding inputs away from .5 ties, where float16 and float32 may round differently.
    x = d.floats(d.shape(), (-4.0, 4.0))
    return Sample({"x": np.where(np.abs(x - np.round(x) - 0.5) < 0.05, x + 0.1, x).astype(d.dtype)})


for _name in ("floor", "ceil", "round"):
    entry(_name, _off_half, getattr(ops, _name), f"torch.{_name}", dtypes=("float32", "float16"))

_UNARY2 = {
    "tan": (-1.2, 1.2),
    "asin": (-0.9, 0.9),
    "acos": (-0.9, 0.9),
    "atan": (-3.0, 3.0),
    "sinh": (-3.0, 3.0),
    "cosh": (-3.0, 3.0),
    "asinh": (-3.0, 3.0),
    "acosh": (1.1, 4.0),
    "atanh": (-0.9, 0.9),
    "log1p": (-0.9, 3.0),
    "expm1": (-3.0, 3.0),
}
for _name, _domain in _UNARY2.items():
    entry(_name, _unary(_domain), getattr(ops, _name), f"torch.{_name}", grad=("x",), dtypes=("float32", "float16"))
for _name, _domain in (("log2", _POSITIVE), ("log10", _POSITIVE), ("exp2", None), ("reciprocal", _POSITIVE)):
    entry(_name, _unary(_domain), getattr(ops, _name), f"torch.{_name}", primitive=False, grad=("x",))
entry("trunc", _off_half, ops.trunc, "torch.trunc", primitive=False)
entry("square", _unary(), ops.square, "torch.square", primitive=False, grad=("x",))


def _remainder(d):
    shape = d.shape()
    a, b = d.floats(shape), d.away_from_zero(shape)
    q = a / b
    # Keep a / b away from integers, where the remainder jumps.
    a = np.where(np.abs(q - np.round(q)) < 0.05, a + 0.1 * b, a).astype(d.dtype)
    return Sample({"a": a, "b": b})


entry("remainder", _remainder, ops.remainder, "torch.remainder", grad=("a", "b"))
entry("atan2", _binary(lambda d, s: d.away_from_zero(s)), ops.atan2, "torch.atan2", grad=("a", "b"))
entry("hypot", _binary(lambda d, s: d.away_from_zero(s)), ops.hypot, "torch.hypot", primitive=False, grad=("a", "b"))


def _bitwise(arity):
    def draw(d):
        shape = d.shape()
        if d.bool():
            make = lambda s: d.bools(s)  # noqa: E731
        else:
            make = lambda s: d.ints(s, -50, 50)  # noqa: E731
        names = ("a", "b")[:arity]
        return Sample({n: make(shape if i == 0 else d.broadcastable(shape)) for i, n in enumerate(names)})

    return draw


for _name, _arity in (("bitwise_and", 2), ("bitwise_or", 2), ("bitwise_xor", 2), ("bitwise_not", 1)):
    entry(_name, _bitwise(_arity), getattr(ops, _name), f"torch.{_name}")


# -- wave 2: reductions, scans, sorting ------------------------------------------------------------------
def _prod(d):
    # torch.prod reduces one axis or all of them.
    shape = d.shape(min_rank=1)
    axes = None if d.bool() else (_axis_of(d, len(shape)),)
    return Sample({"x": d.floats(shape)}, {"axes": axes, "keepdims": axes is not None and d.bool()})


def _prod_torch(s):
    axes = s.attrs["axes"]
    return [s.inputs["x"]], ({} if axes is None else {"dim": axes[0], "keepdim": s.attrs["keepdims"]})


entry("reduce_prod", _prod, ops.reduce_prod, "torch.prod", torch_args=_prod_torch, grad=("x",))


def _norm(d):
    shape = d.shape(min_rank=1)
    return Sample(
        {"x": d.away_from_zero(shape)},
        {"p": d.choice([1.0, 2.0, 3.0, math.inf]), "axes": d.axes(len(shape)), "keepdims": d.bool()},
    )


entry(
    "norm",
    _norm,
    ops.norm,
    "torch.linalg.vector_norm",
    torch_args=lambda s: (
        [s.inputs["x"], s.attrs["p"]],
        {"dim": s.attrs["axes"], "keepdim": s.attrs["keepdims"]},
    ),
    primitive=False,
    grad=("x",),
)


def _cumsum(d):
    shape = d.shape(min_rank=1)
    # reverse=True (which torch lacks) is exercised by cumsum's own VJP.
    return Sample({"x": d.floats(shape)}, {"axis": _axis_of(d, len(shape))})


entry(
    "cumsum",
    _cumsum,
    ops.cumsum,
    "torch.cumsum",
    torch_args=lambda s: ([s.inputs["x"]], {"dim": s.attrs["axis"]}),
    grad=("x",),
    dtypes=("float32", "float16"),
)


def _sort(d):
    shape = d.shape(min_rank=1)
    return Sample({"x": d.floats(shape)}, {"axis": _axis_of(d, len(shape)), "descending": d.bool()})


entry(
    "sort",
    _sort,
    ops.sort,
    "torch.sort",
    torch_args=lambda s: (
        [s.inputs["x"]],
        {"dim": s.attrs["axis"], "descending": s.attrs["descending"], "stable": True},
    ),
    grad=("x",),
)


def _topk(d):
    shape = d.shape(min_rank=1)
    axis = _axis_of(d, len(shape))
    return Sample({"x": d.floats(shape)}, {"k": d.int(1, shape[axis]), "axis": axis, "largest": d.bool()})


entry(
    "topk",
    _topk,
    ops.topk,
    "torch.topk",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["k"]], {"dim": s.attrs["axis"], "largest": s.attrs["largest"]}),
    primitive=False,
    grad=("x",),
)


# -- wave 2: movement ------------------------------------------------------------------------------------
def _flip(d):
    shape = d.shape(min_rank=1)
    return Sample({"x": d.floats(shape)}, {"axes": d.axes(len(shape)) or (0,)})


entry(
    "flip",
    _flip,
    ops.flip,
    "torch.flip",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axes"]], {}),
    grad=("x",),
)


def _roll(d):
    shape = d.shape(min_rank=1)
    axes = tuple(sorted({_axis_of(d, len(shape)) % len(shape) for _ in range(d.int(1, 2))}))
    return Sample({"x": d.floats(shape)}, {"shifts": tuple(d.int(-5, 5) for _ in axes), "axes": axes})


entry(
    "roll",
    _roll,
    ops.roll,
    "torch.roll",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["shifts"], s.attrs["axes"]], {}),
    primitive=False,
    grad=("x",),
)


def _stack(d):
    shape = d.shape()
    return Sample({f"x{i}": d.floats(shape) for i in range(d.int(1, 3))}, {"axis": _axis_of(d, len(shape) + 1)})


entry(
    "stack",
    _stack,
    lambda *xs, axis: ops.stack(xs, axis),
    "torch.stack",
    torch_args=lambda s: ([list(s.inputs.values())], {"dim": s.attrs["axis"]}),
    primitive=False,
    grad=("x0", "x1", "x2"),
)


def _split(d):
    shape = d.shape(min_rank=1)
    axis = _axis_of(d, len(shape))
    return Sample({"x": d.floats(shape)}, {"split_size_or_sections": d.int(1, 3), "axis": axis})


entry(
    "split",
    _split,
    ops.split,
    "torch.split",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["split_size_or_sections"]], {"dim": s.attrs["axis"]}),
    primitive=False,
    grad=("x",),
)


def _expand(d):
    target = d.shape(min_rank=1)
    shape = d.broadcastable(target)
    request = tuple(-1 if i >= len(target) - len(shape) and d.bool() else n for i, n in enumerate(target))
    return Sample({"x": d.floats(shape)}, {"shape": request})


entry(
    "expand",
    _expand,
    ops.expand,
    "torch.Tensor.expand",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["shape"]], {}),
    primitive=False,
    grad=("x",),
)


def _index_select(d):
    s = _gather(d)
    return Sample({"x": s.inputs["x"], "indices": s.inputs["indices"]}, s.attrs)


entry(
    "index_select",
    _index_select,
    lambda x, indices, axis: ops.index_select(x, axis, indices),
    "torch.index_select",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.inputs["indices"]], {}),
    primitive=False,
    grad=("x",),
)


def _scatter(d):
    shape, index_shape, axis, _ = _along(d)
    n = shape[axis]
    # Distinct indices per line along the axis: torch leaves duplicates unspecified.
    k = min(index_shape[axis % len(shape)], n)
    index_shape = tuple(k if i == axis % len(shape) else m for i, m in enumerate(shape))
    perm = np.argsort(d.rng.random(shape), axis=axis)
    indices = np.take(perm, np.arange(k), axis=axis).astype(np.int32)
    return Sample({"x": d.floats(shape), "indices": indices, "src": d.floats(index_shape)}, {"axis": axis})


entry(
    "scatter",
    _scatter,
    lambda x, indices, src, axis: ops.scatter(x, axis, indices, src),
    "torch.scatter",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.inputs["indices"], s.inputs["src"]], {}),
    primitive=False,
    grad=("x", "src"),
)


def _pad_mode(d):
    shape = (1, 1) + d.shape(min_rank=1, max_rank=2, min_side=3)
    mode = d.choice(["constant", "reflect", "replicate", "circular"])
    pads = ((0, 0), (0, 0)) + tuple((d.int(0, 2), d.int(0, 2)) for _ in shape[2:])
    return Sample({"x": d.floats(shape)}, {"pads": pads, "mode": mode})


entry(
    "pad_mode",
    _pad_mode,
    ops.pad_mode,
    "torch.nn.functional.pad",
    torch_args=lambda s: (
        [s.inputs["x"], [p for pair in reversed(s.attrs["pads"][2:]) for p in pair]],
        {"mode": s.attrs["mode"]},
    ),
    primitive=False,
    grad=("x",),
)


# -- wave 2: layers ---------------------------------------------------------------------------------------
def _conv1d(d):
    s = _conv2d(d)
    x, w = s.inputs["x"][:, :, 0], s.inputs["w"][:, :, 0]
    a = s.attrs
    return Sample(
        {"x": x, "w": w},
        {"stride": a["stride"][1], "padding": a["padding"][1][0], "dilation": a["dilation"][1], "groups": a["groups"]},
    )


entry("conv1d", _conv1d, ops.conv1d, "torch.nn.functional.conv1d", primitive=False, grad=("x", "w"), rtol=1e-4)


def _conv3d(d):
    s = _conv2d(d)
    depth_k, depth_stride, depth_pad = d.int(1, 2), d.int(1, 2), d.int(0, 1)
    x = np.stack([s.inputs["x"]] * d.int(depth_k, depth_k + 2), axis=2) + d.floats((1,))
    w = np.stack([s.inputs["w"]] * depth_k, axis=2) * d.floats((depth_k, 1, 1))
    a = s.attrs
    return Sample(
        {"x": x.astype(d.dtype), "w": w.astype(d.dtype)},
        {
            "stride": (depth_stride,) + a["stride"],
            "padding": (depth_pad,) + tuple(lo for lo, _ in a["padding"]),
            "dilation": (1,) + a["dilation"],
            "groups": a["groups"],
        },
    )


entry("conv3d", _conv3d, ops.conv3d, "torch.nn.functional.conv3d", primitive=False, grad=("x", "w"), rtol=1e-4)


def _conv_transpose1d(d):
    s = _conv_transpose(d)
    a = s.attrs
    return Sample(
        {"x": s.inputs["x"][:, :, 0], "weight": s.inputs["weight"][:, :, 0]},
        {
            "stride": a["stride"][1],
            "padding": a["padding"][1],
            "output_padding": a["output_padding"][1],
            "groups": a["groups"],
            "dilation": a["dilation"][1],
        },
    )


entry(
    "conv_transpose1d",
    _conv_transpose1d,
    ops.conv_transpose1d,
    "torch.nn.functional.conv_transpose1d",
    primitive=False,
    grad=("x", "weight"),
    rtol=1e-4,
)


def _pool1d(d, with_dilation):
    shape, _, attrs = _pool_config(d)
    x = d.floats(shape)[:, :, 0]
    out = {"kernel": attrs["kernel"][1], "stride": attrs["stride"][1], "padding": attrs["padding"][1][0]}
    if with_dilation:
        out["dilation"] = attrs["dilation"][1]
    out["ceil_mode"] = attrs["ceil_mode"]
    if not with_dilation:
        out["count_include_pad"] = d.bool()
    return Sample({"x": x}, out)


def _kernel_first_torch(s):
    """torch's 1-D / 3-D pooling call: the kernel positional, the other attributes as keywords (any rank)."""
    return [s.inputs["x"], s.attrs["kernel"]], {k: v for k, v in s.attrs.items() if k != "kernel"}


def _pool_pair(rank, sample):
    """The max and average pooling entries of one rank; ``sample(d, with_dilation)`` draws a case."""
    for kind, with_dilation in (("max", True), ("avg", False)):
        name = f"{kind}_pool{rank}d"
        entry(
            name,
            lambda d, w=with_dilation: sample(d, w),
            getattr(ops, name),
            f"torch.nn.functional.{name}",
            torch_args=_kernel_first_torch,
            primitive=False,
            grad=("x",),
        )


_pool_pair(1, _pool1d)


def _adaptive(d):
    shape = (d.int(1, 2), d.int(1, 2), d.int(1, 7), d.int(1, 7))
    return Sample({"x": d.floats(shape)}, {"output_size": (d.int(1, shape[2]), d.int(1, shape[3]))})


entry(
    "adaptive_avg_pool2d",
    _adaptive,
    ops.adaptive_avg_pool2d,
    "torch.nn.functional.adaptive_avg_pool2d",
    primitive=False,
    grad=("x",),
)


def _instance_norm(d):
    shape = (d.int(1, 3), d.int(1, 3)) + d.shape(min_rank=1, max_rank=2, min_side=3)
    inputs = {"x": d.floats(shape)}
    if d.bool():
        inputs.update(weight=d.floats(shape[1:2]), bias=d.floats(shape[1:2]))
    return Sample(inputs)


entry(
    "instance_norm",
    _instance_norm,
    ops.instance_norm,
    "torch.nn.functional.instance_norm",
    torch_args=lambda s: ([s.inputs["x"]], {"weight": s.inputs.get("weight"), "bias": s.inputs.get("bias")}),
    primitive=False,
    grad=("x", "weight", "bias"),
    rtol=1e-4,
    atol=1e-5,
)


def _cell(d, gates, with_c=False):
    batch, features, hidden = d.int(1, 3), d.int(1, 4), d.int(1, 4)
    inputs = {"x": d.floats((batch, features)), "h": d.floats((batch, hidden))}
    if with_c:
        inputs["c"] = d.floats((batch, hidden))
    inputs.update(w_ih=d.floats((gates * hidden, features)), w_hh=d.floats((gates * hidden, hidden)))
    if d.bool():
        inputs.update(b_ih=d.floats((gates * hidden,)), b_hh=d.floats((gates * hidden,)))
    return Sample(inputs)


def _cell_torch(s):
    i = s.inputs
    state = [i["h"], i["c"]] if "c" in i else i["h"]
    return [i["x"], state, i["w_ih"], i["w_hh"], i.get("b_ih"), i.get("b_hh")], {}


_CELL_GRAD = ("x", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")
entry(
    "rnn_cell",
    lambda d: _cell(d, 1),
    ops.rnn_cell,
    "torch.rnn_tanh_cell",
    torch_args=_cell_torch,
    primitive=False,
    grad=_CELL_GRAD,
)
entry(
    "lstm_cell",
    lambda d: _cell(d, 4, with_c=True),
    ops.lstm_cell,
    "torch.lstm_cell",
    torch_args=_cell_torch,
    primitive=False,
    grad=_CELL_GRAD,
)
entry(
    "gru_cell",
    lambda d: _cell(d, 3),
    ops.gru_cell,
    "torch.gru_cell",
    torch_args=_cell_torch,
    primitive=False,
    grad=_CELL_GRAD,
)


# -- wave 2: activations and losses ----------------------------------------------------------------------
def _leaky(d):
    return Sample({"x": d.floats(d.shape())}, {"negative_slope": d.choice([0.01, 0.2])})


entry("leaky_relu", _leaky, ops.leaky_relu, "torch.nn.functional.leaky_relu", primitive=False, grad=("x",))


def _softplus(d):
    return Sample({"x": d.floats(d.shape(), (-30.0, 30.0))}, {"beta": d.choice([1.0, 2.0]), "threshold": 20.0})


entry("softplus", _softplus, ops.softplus, "torch.nn.functional.softplus", primitive=False, grad=("x",))


def _pair_loss(d, extra=None):
    shape = d.shape()
    attrs = {"reduction": d.choice(["mean", "sum", "none"])}
    attrs.update(extra(d) if extra else {})
    return Sample({"a": d.floats(shape), "b": d.floats(shape)}, attrs)


entry("l1_loss", _pair_loss, ops.l1_loss, "torch.nn.functional.l1_loss", primitive=False, grad=("a", "b"))
entry(
    "smooth_l1_loss",
    lambda d: _pair_loss(d, lambda d: {"beta": d.choice([0.5, 1.0])}),
    ops.smooth_l1_loss,
    "torch.nn.functional.smooth_l1_loss",
    primitive=False,
    grad=("a", "b"),
)
entry(
    "huber_loss",
    lambda d: _pair_loss(d, lambda d: {"delta": d.choice([0.5, 1.0, 2.0])}),
    ops.huber_loss,
    "torch.nn.functional.huber_loss",
    primitive=False,
    grad=("a", "b"),
)


def _bce(d, logits):
    shape = d.shape()
    x = d.floats(shape, (-4.0, 4.0)) if logits else d.floats(shape, (0.05, 0.95))
    inputs = {"x": x, "target": d.floats(shape, (0.0, 1.0))}
    if d.bool():
        inputs["weight"] = d.floats(d.broadcastable(shape), (0.5, 2.0))
    return Sample(inputs, {"reduction": d.choice(["mean", "sum", "none"])})


entry(
    "binary_cross_entropy",
    lambda d: _bce(d, False),
    ops.binary_cross_entropy,
    "torch.nn.functional.binary_cross_entropy",
    primitive=False,
    grad=("x", "target"),
)
entry(
    "binary_cross_entropy_with_logits",
    lambda d: _bce(d, True),
    ops.binary_cross_entropy_with_logits,
    "torch.nn.functional.binary_cross_entropy_with_logits",
    primitive=False,
    grad=("x", "target"),
)


def _kl_div(d):
    shape = d.shape(min_rank=1)
    log_target = d.bool()
    target = d.floats(shape, (-3.0, 0.0)) if log_target else d.floats(shape, (0.0, 1.0))
    attrs = {"reduction": d.choice(["mean", "sum", "none", "batchmean"]), "log_target": log_target}
    return Sample({"log_input": d.floats(shape, (-3.0, 0.0)), "target": target}, attrs)


entry("kl_div", _kl_div, ops.kl_div, "torch.nn.functional.kl_div", primitive=False, grad=("log_input", "target"))
entry(
    "adaptive_max_pool2d",
    _adaptive,
    ops.adaptive_max_pool2d,
    "torch.nn.functional.adaptive_max_pool2d",
    primitive=False,
    grad=("x",),
)

_ACTIVATIONS = {
    "elu": "torch.nn.functional.elu",
    "selu": "torch.nn.functional.selu",
    "celu": "torch.nn.functional.celu",
    "relu6": "torch.nn.functional.relu6",
    "hardsigmoid": "torch.nn.functional.hardsigmoid",
    "hardswish": "torch.nn.functional.hardswish",
    "mish": "torch.nn.functional.mish",
    "softsign": "torch.nn.functional.softsign",
    "logsigmoid": "torch.nn.functional.logsigmoid",
}
for _name, _torch in _ACTIVATIONS.items():
    entry(_name, _unary((-5.0, 5.0)), getattr(ops, _name), _torch, primitive=False, grad=("x",))


def _glu(d):
    shape = d.shape(min_rank=1)
    axis = _axis_of(d, len(shape))
    shape = tuple(2 * n if i == axis % len(shape) else n for i, n in enumerate(shape))
    return Sample({"x": d.floats(shape)}, {"axis": axis})


entry(
    "glu",
    _glu,
    ops.glu,
    "torch.nn.functional.glu",
    torch_args=lambda s: ([s.inputs["x"]], {"dim": s.attrs["axis"]}),
    primitive=False,
    grad=("x",),
)


def _prelu(d):
    shape = (d.int(1, 3), d.int(1, 3)) + d.shape(max_rank=2)
    return Sample({"x": d.floats(shape), "weight": d.floats((d.choice([1, shape[1]]),), (0.0, 0.5))})


entry("prelu", _prelu, ops.prelu, "torch.nn.functional.prelu", primitive=False, grad=("x", "weight"))


# -- resampling and the remaining losses -----------------------------------------------------------------------
def _interpolate(d):
    spatial = d.int(1, 3)
    mode = d.choice(["nearest", "nearest-exact", {1: "linear", 2: "bilinear", 3: "trilinear"}[spatial]])
    if spatial == 2 and d.bool():
        mode = "bicubic"
    shape = (d.int(1, 2), d.int(1, 2)) + tuple(d.int(1, 4) for _ in range(spatial))
    attrs = {"mode": mode, "align_corners": mode not in ("nearest", "nearest-exact") and d.bool()}
    if d.bool():
        attrs["size"] = tuple(d.int(1, 6) for _ in range(spatial))
    else:
        factors = tuple(d.choice([0.5, 1.0, 1.5, 2.0, 3.0] if n > 1 else [1.5, 2.0]) for n in shape[2:])
        attrs["size"] = tuple(max(1, int(math.floor(n * f))) for n, f in zip(shape[2:], factors))
        attrs["scales"] = factors
    return Sample({"x": d.floats(shape)}, attrs)


def _interpolate_torch(s):
    a = s.attrs
    kwargs = {"mode": a["mode"]}
    if a["mode"] not in ("nearest", "nearest-exact"):
        kwargs["align_corners"] = a["align_corners"]
    if a.get("scales") is not None:
        kwargs["scale_factor"] = a["scales"]
    else:
        kwargs["size"] = a["size"]
    return [s.inputs["x"]], kwargs


entry(
    "interpolate",
    _interpolate,
    ops.interpolate,
    "torch.nn.functional.interpolate",
    torch_args=_interpolate_torch,
    primitive=False,
    grad=("x",),
    rtol=1e-4,
    atol=1e-5,
)


def _sign_target(d, shape):
    return np.asarray(d.rng.choice([-1.0, 1.0], shape), d.dtype)


def _reduction_attr(d):
    return {"reduction": d.choice(["mean", "sum", "none"])}


def _poisson(d):
    shape = d.shape()
    log_input = d.bool()
    x = d.floats(shape) if log_input else d.floats(shape, (0.1, 3.0))
    attrs = {"log_input": log_input, "full_loss": d.bool(), **_reduction_attr(d)}
    return Sample({"x": x, "target": d.floats(shape, (0.0, 4.0))}, attrs)


def _poisson_torch(s):
    a = s.attrs
    kwargs = {"log_input": a["log_input"], "full": a["full_loss"], "reduction": a["reduction"]}
    return [s.inputs["x"], s.inputs["target"]], kwargs


entry(
    "poisson_nll_loss",
    _poisson,
    ops.poisson_nll_loss,
    "torch.nn.functional.poisson_nll_loss",
    torch_args=_poisson_torch,
    primitive=False,
    grad=("x",),
)


def _signed_pair(d, with_b, margin):
    shape = (d.int(1, 3), d.int(1, 4)) if margin == "cosine" else d.shape(min_rank=1)
    inputs = {"a": d.floats(shape)}
    if with_b:
        inputs["b"] = d.floats(shape)
    inputs["target"] = _sign_target(d, shape if margin != "cosine" else shape[:-1])
    attrs = _reduction_attr(d)
    if margin:
        attrs["margin"] = d.choice([0.0, 0.3])
    return Sample(inputs, attrs)


entry(
    "hinge_embedding_loss",
    lambda d: _signed_pair(d, False, True),
    ops.hinge_embedding_loss,
    "torch.nn.functional.hinge_embedding_loss",
    primitive=False,
    grad=("a",),
)
entry(
    "soft_margin_loss",
    lambda d: _signed_pair(d, False, False),
    ops.soft_margin_loss,
    "torch.nn.functional.soft_margin_loss",
    primitive=False,
    grad=("a",),
)
entry(
    "cosine_embedding_loss",
    lambda d: _signed_pair(d, True, "cosine"),
    ops.cosine_embedding_loss,
    "torch.nn.functional.cosine_embedding_loss",
    primitive=False,
    grad=("a", "b"),
    rtol=1e-4,
)
entry(
    "margin_ranking_loss",
    lambda d: _signed_pair(d, True, True),
    ops.margin_ranking_loss,
    "torch.nn.functional.margin_ranking_loss",
    primitive=False,
    grad=("a", "b"),
)


def _triplet(d):
    shape = (d.int(1, 3), d.int(1, 4))
    inputs = {k: d.floats(shape) for k in ("anchor", "positive", "negative")}
    attrs = {"margin": d.choice([0.5, 1.0]), "p": d.choice([1.0, 2.0]), "swap": d.bool(), **_reduction_attr(d)}
    return Sample(inputs, attrs)


entry(
    "triplet_margin_loss",
    _triplet,
    ops.triplet_margin_loss,
    "torch.nn.functional.triplet_margin_loss",
    primitive=False,
    grad=("anchor", "positive", "negative"),
    rtol=1e-4,
)


# -- composites added for the supported-ops list ----------------------------------------------------------------
entry("isnan", _unary(), ops.isnan, "torch.isnan", primitive=False)


def _along_axis(d, min_rank=1):
    shape = d.shape(min_rank=min_rank)
    return shape, d.int(0, len(shape) - 1)


def _cumprod(d):
    shape, axis = _along_axis(d)
    return Sample({"x": d.away_from_zero(shape)}, {"axis": axis})


entry(
    "cumprod",
    _cumprod,
    ops.cumprod,
    "torch.cumprod",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"]], {}),
    primitive=False,
    grad=("x",),
)


def _median(d):
    shape, axis = _along_axis(d)
    # Distinct values: ties make the index (and the gradient's target) ambiguous.
    x = np.asarray(d.rng.permutation(math.prod(shape)).reshape(shape) * 0.25, d.dtype)
    return Sample({"x": x}, {"axis": axis, "keepdims": d.bool()})


entry(
    "median",
    _median,
    ops.median,
    "torch.median",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.attrs["keepdims"]], {}),
    primitive=False,
    grad=("x",),
)


def _bucketize(d):
    edges = np.sort(d.floats((d.int(1, 4),)))
    return Sample({"x": d.floats(d.shape()), "boundaries": edges}, {"right": d.bool()})


entry("bucketize", _bucketize, ops.bucketize, "torch.bucketize", primitive=False)


def _cdist(d):
    lead, m = d.shape(max_rank=1), d.int(1, 3)
    a = d.floats(lead + (d.int(1, 3), m))
    return Sample({"a": a, "b": d.floats(lead + (d.int(1, 3), m))}, {"p": d.choice([1.0, 2.0, 3.0])})


entry("cdist", _cdist, ops.cdist, "torch.cdist", primitive=False, grad=("a", "b"), rtol=1e-4)


def _index_fill(d):
    shape, axis = _along_axis(d)
    index = d.ints((d.int(1, 3),), 0, shape[axis])
    return Sample({"x": d.floats(shape), "index": index}, {"axis": axis, "value": d.choice([-1.0, 0.5])})


entry(
    "index_fill",
    _index_fill,
    lambda x, index, axis, value: ops.index_fill(x, axis, index, value),
    "torch.index_fill",
    torch_args=lambda s: ([s.inputs["x"], s.attrs["axis"], s.inputs["index"], s.attrs["value"]], {}),
    primitive=False,
    grad=("x",),
)
_REDUCE_MODES = ("sum", "prod", "mean", "amax", "amin")


def _index_reduce(d):
    shape, axis = _along_axis(d)
    k = d.int(1, 4)
    source_shape = tuple(k if a == axis else n for a, n in enumerate(shape))
    index = d.ints((k,), 0, shape[axis])
    attrs = {"axis": axis, "reduce": d.choice(_REDUCE_MODES[1:]), "include_self": d.bool()}
    return Sample({"x": d.floats(shape), "index": index, "source": d.floats(source_shape)}, attrs)


def _fold_torch(s):
    i, a = s.inputs, s.attrs
    src = i["source"] if "source" in i else i["src"]
    return [i["x"], a["axis"], i["index"], src, a["reduce"]], {"include_self": a["include_self"]}


# Ties between contributions (amax/amin, repeated values) split gradients differently: values only.
entry(
    "index_reduce",
    _index_reduce,
    lambda x, index, source, axis, **attrs: ops.index_reduce(x, axis, index, source, **attrs),
    "torch.Tensor.index_reduce",
    torch_args=_fold_torch,
    primitive=False,
)


def _scatter_reduce(d):
    shape, axis = _along_axis(d)
    index_shape = tuple(d.int(1, n) if a == axis else n for a, n in enumerate(shape))
    index = d.ints(index_shape, 0, shape[axis])
    attrs = {"axis": axis, "reduce": d.choice(_REDUCE_MODES), "include_self": d.bool()}
    return Sample({"x": d.floats(shape), "index": index, "src": d.floats(index_shape)}, attrs)


entry(
    "scatter_reduce",
    _scatter_reduce,
    lambda x, index, src, axis, **attrs: ops.scatter_reduce(x, axis, index, src, **attrs),
    "torch.scatter_reduce",
    torch_args=_fold_torch,
    primitive=False,
)


def _bincount(d):
    length = d.int(1, 6)
    x = d.ints((d.int(1, 8),), 0, length)
    inputs = {"x": x, "weights": d.floats(x.shape)} if d.bool() else {"x": x}
    return Sample(inputs, {"length": length})


entry(
    "bincount",
    _bincount,
    lambda x, weights=None, length=1: ops.bincount(x, length, weights),
    "torch.bincount",
    torch_args=lambda s: ([s.inputs["x"], s.inputs.get("weights")], {"minlength": s.attrs["length"]}),
    primitive=False,
)


def _embedding_bag(d):
    rows, length = d.int(1, 5), d.int(1, 6)
    offsets = np.sort(d.ints((d.int(1, 3),), 0, length))
    offsets[0] = 0
    inputs = {"weight": d.floats((rows, d.int(1, 3))), "indices": d.ints((length,), 0, rows), "offsets": offsets}
    return Sample(inputs, {"mode": d.choice(["sum", "mean", "max"])})


entry(
    "embedding_bag",
    _embedding_bag,
    ops.embedding_bag,
    "torch.nn.functional.embedding_bag",
    torch_args=lambda s: ([s.inputs["indices"], s.inputs["weight"], s.inputs["offsets"]], {"mode": s.attrs["mode"]}),
    primitive=False,
    grad=("weight",),
)


def _volume(d):
    return (d.int(1, 2), d.int(1, 2), d.int(2, 4), d.int(2, 4), d.int(2, 4))


def _pool3d(d, with_dilation):
    shape = _volume(d)
    kernel = tuple(d.int(1, 2) for _ in range(3))
    attrs = {"kernel": kernel, "stride": tuple(d.int(1, 2) for _ in range(3)), "ceil_mode": d.bool()}
    attrs["padding"] = tuple(d.int(0, k // 2) for k in kernel)
    if with_dilation:
        attrs["dilation"] = 1
    else:
        attrs["count_include_pad"] = d.bool()
    return Sample({"x": d.floats(shape)}, attrs)


_pool_pair(3, _pool3d)
entry(
    "adaptive_avg_pool3d",
    lambda d: Sample({"x": d.floats(_volume(d))}, {"output_size": tuple(d.int(1, 3) for _ in range(3))}),
    ops.adaptive_avg_pool3d,
    "torch.nn.functional.adaptive_avg_pool3d",
    primitive=False,
    grad=("x",),
)


def _conv_transpose3d(d):
    groups = d.int(1, 2)
    x = d.floats((d.int(1, 2), groups * d.int(1, 2), d.int(1, 3), d.int(1, 3), d.int(1, 3)))
    w = d.floats((x.shape[1], d.int(1, 2), d.int(1, 2), d.int(1, 2), d.int(1, 2)))
    stride = tuple(d.int(1, 2) for _ in range(3))
    attrs = {"stride": stride, "groups": groups, "output_padding": tuple(d.int(0, s - 1) for s in stride)}
    return Sample({"x": x, "weight": w}, attrs)


entry(
    "conv_transpose3d",
    _conv_transpose3d,
    ops.conv_transpose3d,
    "torch.nn.functional.conv_transpose3d",
    primitive=False,
    grad=("x", "weight"),
    rtol=1e-4,
)


def _bilinear(d):
    lead, i, j, o = d.shape(min_rank=1, max_rank=2), d.int(1, 3), d.int(1, 3), d.int(1, 3)
    inputs = {"a": d.floats(lead + (i,)), "b": d.floats(lead + (j,)), "weight": d.floats((o, i, j))}
    if d.bool():
        inputs["bias"] = d.floats((o,))
    return Sample(inputs)


entry("bilinear", _bilinear, ops.bilinear, "torch.nn.functional.bilinear", primitive=False, grad=("a", "b", "weight"))
entry(
    "rrelu",
    lambda d: Sample({"x": d.floats(d.shape())}, {"lower": 0.1, "upper": 0.3}),
    ops.rrelu,
    "torch.nn.functional.rrelu",
    primitive=False,
    grad=("x",),
)


def _sampler(d):
    return Sample({"seed": d.ints((2,), 0, 1000)}, {"shape": d.shape(min_rank=1)})


for _name in ("normal", "exponential", "uniform"):
    entry(_name, _sampler, getattr(ops, _name), None, primitive=False)
entry(
    "randperm",
    lambda d: Sample({"seed": d.ints((2,), 0, 1000)}, {"n": d.int(1, 6)}),
    ops.randperm,
    None,
    primitive=False,
)


def _ctc(d):
    steps, n, classes = d.int(2, 5), d.int(1, 2), d.int(2, 4)
    s = d.int(1, 2)
    target_lengths = d.ints((n,), 1, s + 1)
    log_probs = np.log(np.asarray(d.rng.dirichlet(np.ones(classes), (steps, n)), np.float32))
    inputs = {
        "log_probs": log_probs,
        "targets": d.ints((n, s), 1, classes),
        "input_lengths": d.ints((n,), steps - 1, steps + 1),
        "target_lengths": target_lengths,
    }
    return Sample(inputs, {"reduction": d.choice(["mean", "sum", "none"]), "zero_infinity": True})


entry(
    "ctc_loss",
    _ctc,
    ops.ctc_loss,
    "torch.nn.functional.ctc_loss",
    primitive=False,
    grad=("log_probs",),
    rtol=1e-4,
    atol=1e-5,
)
