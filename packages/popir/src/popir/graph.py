"""The flat IR: a Graph of Values and Nodes in topological order."""

import hashlib
from typing import NamedTuple

import numpy as np

from popir.dtypes import DType, as_dtype
from popir.errors import IRError
from popir.registry import get_op

INPUT_KINDS = ("input", "parameter", "buffer", "optimizer_state")
# Where a node came from, for errors and profiles: the user's source line, the module path
# (``layer1.0.conv2``, NameScopes included), the frontend op (``aten.convolution.default``) and its role
# (forward, backward or optimizer). Passes and autodiff carry them over to the nodes they emit.
ANNOTATIONS = (
    "source",
    "module",
    "aten",
    "role",
    "placement",
    "checkpoint",
    "available_memory",
    "conv_dithering",
    "partials_type",
)
ROLES = ("forward", "backward", "optimizer")


class TensorType(NamedTuple):
    """Shape and element type of a value."""

    shape: tuple
    dtype: DType

    @staticmethod
    def of(shape, dtype):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise IRError(f"shape {list(shape)} has a negative dimension")
        return TensorType(shape, as_dtype(dtype))

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    def __str__(self):
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


class Value:
    """An SSA value: a graph input, a constant or a node output."""

    __slots__ = ("graph", "id", "type", "name", "producer", "kind")

    def __init__(self, graph, id_, type_, name=None, producer=None, kind=None):
        self.graph = graph
        self.id = id_
        self.type = type_
        self.name = name
        self.producer = producer
        self.kind = kind

    shape = property(lambda self: self.type.shape)
    dtype = property(lambda self: self.type.dtype)
    ndim = property(lambda self: len(self.type.shape))

    def __repr__(self):
        label = f"%{self.id}" + (f" ({self.name})" if self.name else "")
        return f"<Value {label}: {self.type}>"

    # Operator sugar, so VJP rules read like math. Each resolves the primitive by name at call time.
    def _binary(self, op, other, reverse=False):
        other = self.graph.lift(other, self.dtype)
        a, b = (other, self) if reverse else (self, other)
        return self.graph.apply(op, (a, b), {})[0]

    def __add__(self, other):
        return self._binary("add", other)

    def __radd__(self, other):
        return self._binary("add", other, True)

    def __sub__(self, other):
        return self._binary("sub", other)

    def __rsub__(self, other):
        return self._binary("sub", other, True)

    def __mul__(self, other):
        return self._binary("mul", other)

    def __rmul__(self, other):
        return self._binary("mul", other, True)

    def __truediv__(self, other):
        return self._binary("div", other)

    def __rtruediv__(self, other):
        return self._binary("div", other, True)

    def __matmul__(self, other):
        return self._binary("matmul", other)

    def __neg__(self):
        return self.graph.apply("neg", (self,), {})[0]


class Node:
    """One application of a primitive, annotated with where it came from (see ``ANNOTATIONS``; None when
    unknown)."""

    __slots__ = ("op", "inputs", "attrs", "outputs", *ANNOTATIONS)

    def __init__(
        self,
        op,
        inputs,
        attrs,
        outputs,
        source=None,
        module=None,
        aten=None,
        role=None,
        placement=None,
        checkpoint=None,
        available_memory=None,
        conv_dithering=None,
        partials_type=None,
    ):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.outputs = outputs
        self.source = source
        self.module = module
        self.aten = aten
        self.role = role
        self.placement = placement  # (pipeline stage, IPU) in a multi-IPU model; None runs on IPU 0
        self.checkpoint = checkpoint  # True: recomputation keeps its outputs for the backward pass
        self.available_memory = available_memory  # proportion of a tile its matmul/conv plan may use
        self.conv_dithering = conv_dithering  # a convolution's own enableConvDithering (None: the model's)
        self.partials_type = partials_type  # a convolution's own float16 partials dtype name (None: the model's)

    def annotations(self):
        """{annotation: value} of this node (see ``ANNOTATIONS``)."""
        return {name: getattr(self, name) for name in ANNOTATIONS}

    def describe(self):
        args = ", ".join(f"%{v.id}: {v.type}" for v in self.inputs)
        attrs = "".join(f", {k}={_short(v)}" for k, v in sorted(self.attrs.items()))
        where = f" at {self.source}" if self.source else ""
        return f"{self.op}({args}{attrs}){where}"


def _short(value):
    if isinstance(value, np.ndarray):
        if value.size <= 4:
            return np.array2string(value.ravel(), separator=",")
        return f"<{value.dtype}{list(value.shape)}>"
    return repr(value)


def normalize_attr(value):
    """Attributes are ints, floats, bools, strings, None, tuples of those, or ndarrays (constants).

    A DType is stored as its name, so listings and serialized graphs show it the same way.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    # Before str: DType is a str subclass.
    if isinstance(value, DType):
        return value.value
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(normalize_attr(v) for v in value)
    if isinstance(value, np.ndarray):
        return value
    raise IRError(f"attribute value {value!r} of type {type(value).__name__} is not supported")


class _AnnotationScope:
    """The context manager of ``Graph.annotate`` (defined once: capture and autodiff enter one per node)."""

    __slots__ = ("graph", "changes", "previous")

    def __init__(self, graph, changes):
        unknown = set(changes) - set(ANNOTATIONS)
        if unknown:
            raise IRError(f"unknown node annotation(s) {sorted(unknown)}; known: {', '.join(ANNOTATIONS)}")
        if changes.get("role") not in (None, *ROLES):
            raise IRError(f"node role must be one of {ROLES}, got {changes['role']!r}")
        self.graph, self.changes = graph, changes

    def __enter__(self):
        self.previous = self.graph._annotations
        self.graph._annotations = {**self.previous, **self.changes}

    def __exit__(self, *exc):
        self.graph._annotations = self.previous


def graph_of(values):
    """The one graph that all Values in ``values`` belong to."""
    graphs = {id(v.graph): v.graph for v in values if isinstance(v, Value)}
    if len(graphs) != 1:
        raise IRError("an op needs Values of exactly one graph" if graphs else "an op needs a Value input")
    return next(iter(graphs.values()))


class Graph:
    """Values and nodes in topological order, named inputs, named outputs and state updates.

    ``updates`` maps a non-``input`` graph input (parameter, buffer, optimizer state) to the Value that
    replaces it after a run: that is how a training step writes its new weights.
    """

    def __init__(self, name="graph"):
        self.name = name
        self.inputs = []
        self.nodes = []
        self.outputs = {}
        self.updates = {}
        self._next_id = 0
        self._annotations = {}

    # -- building -------------------------------------------------------------------------------
    def _new_value(self, type_, name=None, producer=None, kind=None):
        value = Value(self, self._next_id, type_, name, producer, kind)
        self._next_id += 1
        return value

    def add_input(self, name, shape, dtype, kind="input"):
        """A named graph input; ``kind`` is one of input, parameter, buffer, optimizer_state."""
        if kind not in INPUT_KINDS:
            raise IRError(f"input kind must be one of {INPUT_KINDS}, got {kind!r}")
        if any(v.name == name for v in self.inputs):
            raise IRError(f"graph input {name!r} is defined twice")
        value = self._new_value(TensorType.of(shape, dtype), name=name, kind=kind)
        self.inputs.append(value)
        return value

    def constant(self, array, dtype=None):
        """A constant Value holding ``array`` (narrowed to a device dtype)."""
        source = np.asarray(array)
        dt = as_dtype(dtype if dtype is not None else source.dtype)
        if dt == DType.int32 and source.dtype.kind in "iu" and source.size:
            info = np.iinfo(np.int32)
            if source.min() < info.min or source.max() > info.max:
                raise IRError(
                    f"constant values [{source.min()}, {source.max()}] do not fit int32, the device's integer type "
                    "(int64 is narrowed to int32); use smaller values or a float constant"
                )
        array = np.array(source, dtype=dt.numpy, order="C")
        return self.apply("constant", (), {"value": array})[0]

    def lift(self, x, dtype):
        """``x`` itself if it is a Value, else a constant of ``dtype``."""
        return x if isinstance(x, Value) else self.constant(np.asarray(x), dtype)

    def source_line(self, source):
        """Context manager: nodes created inside it record ``source`` (the user's line) for errors."""
        return _AnnotationScope(self, {"source": source})

    def annotate(self, **annotations):
        """Context manager: nodes created inside it carry ``annotations`` (names from ``ANNOTATIONS``), on
        top of those of any enclosing scope."""
        return _AnnotationScope(self, annotations)

    def placed(self, placement):
        """Context manager: nodes created inside it run on ``placement``, a (pipeline stage, IPU) pair (None:
        unplaced, which popsim puts on IPU 0)."""
        return self.annotate(placement=None if placement is None else tuple(int(p) for p in placement))

    def apply(self, op, inputs, attrs):
        """Append a node applying primitive ``op``; returns its output Values (a list)."""
        opdef = get_op(op)
        for v in inputs:
            if not isinstance(v, Value) or v.graph is not self:
                raise IRError(f"{op}: input {v!r} is not a Value of this graph")
        attrs = {k: normalize_attr(v) for k, v in attrs.items()}
        try:
            result = opdef.infer(*[v.type for v in inputs], **attrs)
        except IRError as exc:
            raise IRError(f"{_describe_call(op, inputs, attrs, self._annotations.get('source'))}: {exc}") from None
        except TypeError as exc:
            where = self._annotations.get("source")
            raise IRError(f"{_describe_call(op, inputs, attrs, where)}: bad attributes: {exc}") from None
        types = [result] if isinstance(result, TensorType) else list(result)
        node = Node(op, list(inputs), attrs, [], **self._annotations)
        node.outputs = [self._new_value(TensorType.of(*t), producer=node) for t in types]
        self.nodes.append(node)
        return node.outputs

    def output(self, name, value):
        """Mark ``value`` as the graph output ``name``."""
        if not isinstance(value, Value) or value.graph is not self:
            raise IRError(f"output {name!r} must be a Value of this graph")
        self.outputs[name] = value
        return value

    def update(self, state, value):
        """After each run, the device-resident input ``state`` takes ``value``."""
        if state not in self.inputs or state.kind == "input":
            raise IRError(f"only parameters, buffers and optimizer state can be updated, not {state!r}")
        if state.type != value.type:
            raise IRError(f"update of {state.name!r}: {state.type} cannot take {value.type}")
        self.updates[state] = value

    # -- inspecting -----------------------------------------------------------------------------
    def input(self, name):
        """The graph input called ``name``."""
        for v in self.inputs:
            if v.name == name:
                return v
        raise IRError(f"graph {self.name!r} has no input {name!r}")

    def values(self):
        """Every Value: inputs first, then node outputs in order."""
        yield from self.inputs
        for node in self.nodes:
            yield from node.outputs

    def verify(self):
        """Check topological order, single definitions and that every rule still holds."""
        from popir.verify import verify

        verify(self)
        return self

    def to_text(self):
        """A readable listing of the graph."""
        lines = [f"graph {self.name}("]
        lines += [f"  %{v.id}: {v.type}  # {v.kind} {v.name}" for v in self.inputs]
        lines.append(") {")
        for node in self.nodes:
            outs = ", ".join(f"%{v.id}: {v.type}" for v in node.outputs)
            args = ", ".join(f"%{v.id}" for v in node.inputs)
            attrs = ", ".join(f"{k}={_short(v)}" for k, v in sorted(node.attrs.items()))
            sep = ", " if args and attrs else ""
            where = f"  # {node.source}" if node.source else ""
            if node.placement is not None:
                where += f"  [stage {node.placement[0]}, IPU {node.placement[1]}]"
            lines.append(f"  {outs} = {node.op}({args}{sep}{attrs}){where}")
        for name, v in self.outputs.items():
            lines.append(f"  output {name} = %{v.id}")
        for state, v in self.updates.items():
            lines.append(f"  update {state.name} <- %{v.id}")
        lines.append("}")
        return "\n".join(lines)

    def to_bytes(self):
        """Deterministic serialization (same graph, same bytes)."""
        from popir.serialize import to_bytes

        return to_bytes(self)

    @staticmethod
    def from_bytes(data):
        """The graph serialized by ``to_bytes``; raises IRError on corrupt bytes."""
        from popir.serialize import from_bytes

        return from_bytes(data)

    def hash(self):
        """A stable hex digest of the serialized graph; it keys executable caches."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def __eq__(self, other):
        return isinstance(other, Graph) and self.to_bytes() == other.to_bytes()

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes>"


def _describe_call(op, inputs, attrs, source):
    args = ", ".join(f"%{v.id}: {v.type}" for v in inputs)
    shown = "".join(f", {k}={_short(v)}" for k, v in sorted(attrs.items()))
    where = f" at {source}" if source else ""
    return f"{op}({args}{shown}){where}"
