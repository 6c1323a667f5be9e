"""The table from popir op names to planners: each entry lowers one node onto tiles.

``register_lowering`` is the public way to add an entry (popsim's own ops use it too); see the frontend
guide in docs/ for the planner helpers a lowering calls.
"""

import numpy as np

from popir import DType, IRError, get_op
from popsim import _opcodes as oc
from popsim import conv_plan, cost, remote, window
from popsim.device_graph import HostCall
from popsim.errors import Error
from popsim.mapping import TileMapping
from popsim.timeline import inter_ipu_copy_name

LOWERINGS = {}


def register_lowering(*names, replace=False):
    """Decorator registering ``fn(lw, node, *inputs, **attrs)`` as the lowering of the popir ops ``names``.

    ``lw`` is the ``popsim.Lowerer`` building the device graph, ``node`` the popir node (its ``outputs``
    give the result types), ``inputs`` the device Tensors of the node's inputs and ``attrs`` its attributes.
    The function builds the result with the Lowerer's planner helpers and returns one device Tensor per
    output (a list or tuple for several), each of the output's shape and dtype. Each name must be a popir
    op (``popir.defop`` it first); an op that already has a lowering is refused unless ``replace=True``.
    """
    for name in names:
        try:
            get_op(name)
        except IRError:
            raise Error(f"register_lowering: popir has no op {name!r}; define it with popir.defop first") from None
        if name in LOWERINGS and not replace:
            raise Error(f"register_lowering: op {name!r} already has a lowering; pass replace=True to override it")

    def register(fn):
        for name in names:
            LOWERINGS[name] = fn
        return fn

    return register


lowering = register_lowering  # the spelling popsim's own table below uses


def _norm_axes(axes, ndim):
    if axes is None:
        return tuple(range(ndim))
    axes = (axes,) if isinstance(axes, int) else axes
    return tuple(sorted(a % ndim for a in axes)) if ndim else ()


def lower_graph(lw, graph, variables, placement=None, name=None, spill=None, remote_loads="phase"):
    """Lower every node of ``graph``; returns ({feed name: tensor}, {output name: tensor}).

    On a multi-IPU target, ``placement`` (a ``popsim.placement.Placement``) confines each node's tensors and
    vertices to its IPU's tiles; an operand that lives on another IPU first crosses by an inter-IPU copy.
    ``spill`` ("backward" or "phase") moves activations to streaming memory between passes or phases (see
    ``remote.Spiller``). ``remote_loads`` (one of ``remote.LOAD_MODES``) says whether a remote variable is
    loaded once per phase for its readers there, or for each reader (see ``remote.Loads``).
    """
    env, inputs = {}, {}
    deferred, at = _fusion(graph)
    row_indices = _row_scatter_indices(graph)
    ipus = placement is not None and lw.target.num_ipus > 1
    views = {} if ipus or spill or lw.dg.remote else _matmul_views(graph, at)
    lw.in_place = {
        value: variables[name]
        for value, name in _in_place_updates(graph, at).items()
        if variables[name] not in lw.dg.remote  # a streamed variable is updated by a store, never in place
    }
    # A slice's buffer that its only reader's vertex may overwrite with its result (elementwise, in place).
    reused = {} if spill or lw.dg.remote else _slice_buffers_reused(graph, at, lw.in_place, placement if ipus else None)
    device_target = lw.target
    for v in graph.inputs:
        if v.kind == "input":
            where = device_target.ipu_view(placement.input_ipu.get((name, v.name), 0)) if ipus else device_target
            mapping = TileMapping.linear(v.type.size, v.dtype.itemsize, where)
            env[v.id] = inputs[v.name] = lw.dg.add_tensor(v.shape, v.dtype, mapping, v.name, "input")
        else:
            env[v.id] = variables[v.name]
    crossings = {}
    fills = {}  # value id -> (node, operands) of a fill written into one variable, to repeat for the others
    stores = remote.store_points(graph, {n for n, t in variables.items() if t in lw.dg.remote})
    stored = set()
    spiller = remote.Spiller(lw.dg, graph, spill)
    loads = remote.Loads(lw.dg, graph, remote_loads)
    for index, node in enumerate(graph.nodes):
        spiller.store_due(index - 1, env)
        args = [env[v.id] for v in node.inputs]
        if lw.dg.remote:
            lw.dg.origin = node
            where = device_target.ipu_view(placement.ipu_of(node)) if ipus else device_target
            args = loads.operands(node, spiller.operands(node, args, where), where)
            lw.dg.origin = None
        if node.outputs[0].id in deferred:
            env[node.outputs[0].id] = _Deferred(node, args)
            continue
        if node.outputs[0].id in row_indices:
            env[node.outputs[0].id] = args[0]  # the row scatter reading it takes one index per row
            continue
        if node.outputs[0].id in views:
            env[node.outputs[0].id] = views[node.outputs[0].id](lw, node, args)
            continue
        lw.dg.origin = node
        lw.budget_node(node, placement.ipu_of(node) if placement is not None else 0)
        if ipus:
            ipu = placement.ipu_of(node)
            lw.target = device_target.ipu_view(ipu)
            args = [_onto_ipu(lw, a, ipu, crossings) for a in args]
        try:
            result = LOWERINGS[node.op](lw, node, *args, **node.attrs)
        except Error as exc:
            raise type(exc)(f"lowering {node.describe()}: {exc}") from None
        finally:
            lw.dg.origin = None
            lw.target = device_target
        results = result if isinstance(result, (list, tuple)) else [result]
        for value, t in zip(node.outputs, results):
            if t.shape != value.shape or t.dtype != value.dtype:
                raise Error(f"lowering of {node.op} produced {t.dtype}{list(t.shape)}, expected {value.type}")
            env[value.id] = t
            lw.dg.node_outputs.add(t.storage.id)
            if value.id in reused and t.storage is t:  # a buffer of its own, not a view of another tensor
                lw.in_place[reused[value.id]] = t
            if lw.in_place.get(value.id) is t and node.op in FILL_OPS:
                fills[value.id] = (node, args)
        for state, value in stores.get(index, ()):
            lw.dg.origin = node
            remote.store(lw.dg, variables[state.name], env[value.id])
            loads.stored(variables[state.name])
            lw.dg.origin = None
            stored.add(state.name)
    spiller.store_due(len(graph.nodes) - 1, env)
    outputs = {}
    for name, v in graph.outputs.items():
        t = env[v.id]
        if remote.is_remote(lw.dg, t):
            t = remote.load_operands(lw.dg, [t], device_target)[0]
        # Outputs of device variables are read after the updates: snapshot them first (on their IPU).
        if t.storage.category in ("variable", "input"):
            t = lw.gather(t.shape, t.dtype, [t], np.arange(t.size), _beside(lw, t), name=f"output {name}")
        outputs[name] = t
    staged, refills = {}, {}
    for state, v in graph.updates.items():
        t = env[v.id]
        if state.name in stored or t.storage is variables[state.name].storage:
            continue
        if v.id in fills and variables[state.name] not in lw.dg.remote:
            refills[state.name] = fills[v.id]  # filled like the first, once every update has read its value
            continue
        if remote.is_remote(lw.dg, t):
            t = remote.load_operands(lw.dg, [t], device_target)[0]
        if t.storage.category in ("variable", "input"):
            t = lw.gather(t.shape, t.dtype, [t], np.arange(t.size), _beside(lw, t), name=f"stage {state.name}")
        staged[state.name] = t
    for name, t in staged.items():
        var = variables[name]
        if var in lw.dg.remote:
            remote.store(lw.dg, var, t)
            continue
        lw.move(var, [t], np.arange(t.size), name=f"update {name}")
    for name, (node, args) in refills.items():
        lw.dg.origin = node
        lw.target = device_target.ipu_view(_ipu_of_tensor(device_target, variables[name])) if ipus else device_target
        _fill(lw, node, args, variables[name])  # a constant's scalar made on the variable's IPU
        lw.dg.origin = None
        lw.target = device_target
    return inputs, outputs


def _ipu_of_tensor(target, t):
    """The IPU holding the first element of device tensor ``t``."""
    return int(t.mapping.tiles[0]) // target.tiles_per_ipu if t.size else 0


def _beside(lw, t):
    """A linear mapping for a copy of ``t`` on the IPU that holds ``t``."""
    return TileMapping.linear(t.size, t.itemsize, lw.target.ipu_view(_ipu_of_tensor(lw.target, t)))


def _onto_ipu(lw, t, ipu, crossings):
    """``t`` on IPU ``ipu``: itself when it lives there, else (once per tensor and IPU) an explicit
    inter-IPU copy, the activation crossing the IPU-Links."""
    if isinstance(t, _Deferred) or not t.size:
        return t
    view = lw.target
    tiles = t.mapping.tiles
    if tiles.min() >= view.first_tile and tiles.max() < view.first_tile + view.num_tiles:
        return t
    if t.size == 1 and t.storage in lw.dg.host_written:  # the host writes a copy to this IPU too: no crossing
        copy = lw.host_copy(t, ("ipu", ipu), TileMapping.linear(1, t.itemsize, view), f"{t.storage.name} on IPU {ipu}")
        return lw.reshape(copy, t.shape)
    key = (id(t), ipu)
    if key not in crossings:
        mapping = TileMapping.linear(t.size, t.itemsize, view)
        crossings[key] = (
            t,
            lw.gather(t.shape, t.dtype, [t], np.arange(t.size), mapping, name=inter_ipu_copy_name(ipu)),
        )
    return crossings[key][1]


def _in_place_updates(graph, at):
    """{value id: state name} for state updates an elementwise node can write straight into the variable, as
    an optimizer's in-place update on the IPU: nothing reads the old value after that node, and the old
    value is neither an output nor another state's new value (both are read after every node has run).
    ``at[i]`` is where node i is computed (a fused node reads its inputs where its reader runs)."""
    producer = {v.id: (i, node) for i, node in enumerate(graph.nodes) for v in node.outputs}
    aliases = _possible_aliases(graph)
    last_read = {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            for root in aliases.get(v.id, (v.id,)):
                last_read[root] = max(last_read.get(root, -1), at[i])
    ends = [*graph.outputs.values(), *graph.updates.values()]
    read_at_end = {root for v in ends for root in aliases.get(v.id, (v.id,))}
    found = {}
    for state, value in graph.updates.items():
        if value.id not in producer or value.id in found:
            continue
        i, node = producer[value.id]
        if LOWERINGS.get(node.op) is _elementwise:
            if state.id not in read_at_end and last_read.get(state.id, -1) <= i:
                found[value.id] = state.name
        elif node.op == "broadcast_to" or (node.op == "constant" and _repeats_one_value(node.attrs["value"])):
            # Its elements move about (or come from nowhere): only once nothing reads the old value.
            if state.id not in read_at_end and last_read.get(state.id, -1) < i:
                found[value.id] = state.name
        elif (written := _slice_written_in_place(graph, state, value, producer, aliases, at)) is not None:
            found[written] = state.name
    return found


def _slice_written_in_place(graph, state, value, producer, aliases, at):
    """The id of the slice_update that makes ``state``'s new ``value`` (through reshapes) and can copy its
    slice straight into the variable: it updates the variable's own value, its slice does not share the
    variable's memory, and nothing but the reshapes reads the variable or the result after it (or at the end)."""
    i, node = producer[value.id]
    chain = {i}
    while node.op == "reshape" and node.inputs[0].id in producer:
        i, node = producer[node.inputs[0].id]
        chain.add(i)
    shares = lambda v: state.id in aliases.get(v.id, (v.id,))  # noqa: E731
    if node.op != "slice_update" or not shares(node.inputs[0]) or shares(node.inputs[1]):
        return None
    ends = [*graph.outputs.values(), *(v for other, v in graph.updates.items() if other is not state)]
    later = (n for j, n in enumerate(graph.nodes) if at[j] > i and j not in chain)
    if any(shares(v) for v in ends) or any(shares(v) for n in later for v in n.inputs):
        return None
    return node.outputs[0].id


def _readers(graph):
    """({value id: indices of the nodes reading it, in order, once per input read}, ids of the values the
    graph keeps: its outputs and its states' new values)."""
    readers = {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            readers.setdefault(v.id, []).append(i)
    return readers, {v.id for v in graph.outputs.values()} | {v.id for v in graph.updates.values()}


def _slice_buffers_reused(graph, at, in_place, placement=None):
    """{slice value id: id of the elementwise result written into the slice's buffer}, as PopART computes an
    op in place on an operand nothing reads afterwards: a slice read once, by an elementwise node whose vertex
    (``at``: its own, or the fused reader's) makes a temporary of the slice's shape and dtype, on the slice's
    IPU (``placement``, on several). An optimizer's step on a replica's shard of a weight so updates the shard
    it sliced out, rather than a second buffer."""
    readers, kept = _readers(graph)
    reused = {}
    for node in graph.nodes:
        value = node.outputs[0]
        uses = readers.get(value.id, [])
        if node.op != "slice" or value.id in kept or len(set(uses)) != 1:
            continue
        reader, root = graph.nodes[uses[0]], graph.nodes[at[uses[0]]]
        result = root.outputs[0]
        same = result.shape == value.shape and result.dtype == value.dtype
        if placement is not None and placement.ipu_of(root) != placement.ipu_of(node):
            continue
        if LOWERINGS.get(reader.op) is _elementwise and same and result.id not in kept | set(in_place):
            reused.setdefault(value.id, result.id)
    return {value: result for value, result in reused.items() if list(reused.values()).count(result) == 1}


def _possible_aliases(graph):
    """{value id: ids of the values whose memory it may share}. An elementwise lowering always makes a new
    tensor (or writes a state in place); any other may hand back an input, or a view of it, of the output's
    size and dtype (reshape, stop_gradient, a relayout that changes nothing, an empty scatter), so reading
    such a value reads its input's memory."""
    aliases = {}
    for node in graph.nodes:
        if LOWERINGS.get(node.op) is _elementwise:
            continue
        for out in node.outputs:
            same = [v for v in node.inputs if v.type.size == out.type.size and v.dtype == out.dtype]
            if same:
                aliases[out.id] = {out.id}.union(*(aliases.get(v.id, {v.id}) for v in same))
    return aliases


def _row_scatter_indices(graph):
    """Ids of the row indices a scatter_add along axis 0 reads broadcast over whole rows (the embedding
    backward, as popir differentiates a lookup) and nothing else reads: they are never widened, and the
    scatter gets the [n, 1, ...] indices to add whole rows, as Poplar's multiUpdateAdd takes [n] indices."""
    uses, kept = _readers(graph)
    rows = set()
    for i, node in enumerate(graph.nodes):
        if node.op != "scatter_add" or node.attrs["axis"] % len(node.inputs[0].shape):
            continue
        indices = node.inputs[1]
        source = indices.producer
        if source is None or source.op != "broadcast_to" or indices.id in kept or uses[indices.id] != [i]:
            continue
        shape = source.inputs[0].shape
        if len(shape) == len(indices.shape) and shape[0] == indices.shape[0] and all(d == 1 for d in shape[1:]):
            rows.add(indices.id)
    return rows


# -- fusion: chains of elementwise nodes run as one vertex per block (popops map expressions) --------
class _Deferred:
    """An elementwise node computed inside its reader's fused vertex; ``args`` are its lowered inputs."""

    __slots__ = ("node", "args")

    def __init__(self, node, args):
        self.node, self.args = node, args


def _fusion(graph):
    """(ids of values computed inside their reader's vertex, for each node the index of the node whose vertex
    computes it). A value fuses when an elementwise node makes it, its only use is one input of another
    elementwise node of the same shape, and it is neither an output nor a state's new value."""
    uses, kept = _readers(graph)
    reader = {}
    for i, node in enumerate(graph.nodes):
        out = node.outputs[0]
        readers = uses.get(out.id, [])
        if LOWERINGS.get(node.op) is not _elementwise or out.id in kept or len(readers) != 1:
            continue
        consumer = graph.nodes[readers[0]]
        same_place = consumer.placement == node.placement  # never fuse across IPUs or pipeline stages
        if LOWERINGS.get(consumer.op) is _elementwise and consumer.outputs[0].shape == out.shape and same_place:
            reader[i] = readers[0]
    at = list(range(len(graph.nodes)))
    for i in reversed(range(len(graph.nodes))):
        if i in reader:
            at[i] = at[reader[i]]
    return {graph.nodes[i].outputs[0].id for i in reader}, at


def _fused(lw, node, args):
    """Lower ``node`` with the deferred nodes among its inputs (recursively) as one fused vertex; when that
    would need more leaves or ops than a fused vertex holds, the deferred inputs are lowered first."""
    leaves, steps, nodes = [], [], []

    def visit(node, args):
        regs = [visit(a.node, a.args) if isinstance(a, _Deferred) else _leaf(leaves, a) for a in args]
        steps.append((node.op, regs, node.outputs[0].dtype, node.inputs[-1].dtype))
        nodes.append(node)
        return -len(steps)

    visit(node, args)
    if len(leaves) > len(oc.EXPR_FIELDS) or len(steps) > oc.EXPR_MAX_OPS:
        return _elementwise(lw, node, *[_lower_deferred(lw, a) if isinstance(a, _Deferred) else a for a in args])
    # Registers: the leaves, then one per step (a step's result was numbered -1, -2, ... as it was added).
    steps = [(op, [r if r >= 0 else len(leaves) - r - 1 for r in regs], dt, operand) for op, regs, dt, operand in steps]
    result = node.outputs[0]
    lw.dg.fused = tuple(nodes)  # the profile credits the fused compute set to every node it computes
    try:
        return lw.expression(steps, leaves, result.shape, result.dtype, out=lw.in_place.get(result.id))
    finally:
        lw.dg.fused = ()


def _lower_deferred(lw, deferred):
    """Lower a deferred node before its reader (its work then credited to it, not to the reader)."""
    reader, lw.dg.origin = lw.dg.origin, deferred.node
    try:
        return _elementwise(lw, deferred.node, *deferred.args)
    finally:
        lw.dg.origin = reader


def _leaf(leaves, tensor):
    for i, t in enumerate(leaves):
        if t is tensor:
            return i
    leaves.append(tensor)
    return len(leaves) - 1


# -- constants, elementwise ------------------------------------------------------------------------
@lowering("constant")
def _constant(lw, node, value):
    out = lw.in_place.get(node.outputs[0].id)
    if out is not None:  # a state reset to one repeated value: moved from a scalar, no constant tensor
        return _fill(lw, node, [], out)
    return lw.constant(value, node.outputs[0].dtype)


def _fill(lw, node, args, variable):
    """Write the value of ``node`` (a broadcast_to of ``args[0]``, or a constant of one repeated value)
    straight into ``variable``: an exchange from its few source elements, with no buffer of its own."""
    if node.op == "constant":
        scalar = lw.constant(np.asarray(node.attrs["value"]).reshape(-1)[:1], variable.dtype)
        lw.move(variable, [scalar], np.zeros(variable.size), name="fill")
    else:
        (x,) = args
        lw.move(variable, [x], np.broadcast_to(np.arange(x.size).reshape(x.shape), variable.shape), name="broadcast")
    return variable


def _repeats_one_value(value):
    """Whether constant ``value`` holds one value (bit for bit: -0.0 is not 0.0) in every element."""
    array = np.asarray(value)
    return array.size > 0 and array.tobytes() == array.reshape(-1)[:1].tobytes() * array.size


# Ops whose value a state update can take straight into its variable from a few source elements (``_fill``).
FILL_OPS = ("constant", "broadcast_to")
UNARY = tuple(op for op in oc.UNARY_OPS if op not in ("copy", "cast", "bitwise_not"))
BINARY = tuple(oc.BINARY_OPS)


@lowering(*UNARY, *BINARY, "where", "cast")
def _elementwise(lw, node, *args, **attrs):
    if any(isinstance(a, _Deferred) for a in args):
        return _fused(lw, node, args)
    out = node.outputs[0]
    return lw.elementwise(node.op, args, out.shape, out.dtype, out=lw.in_place.get(out.id))


@lowering("stop_gradient")
def _stop_gradient(lw, node, x):
    # Only autodiff sees the op; on the device its output is its input, with no copy.
    return x


# -- movement: index maps --------------------------------------------------------------------------
@lowering("host_call")
def _host_call(lw, node, *inputs, callback, out_types):
    # The results land in new tensors spread over the tiles; the first one's id names the call's streams.
    outs = [lw.new(v.shape, v.dtype, name=f"{callback} result {i}") for i, v in enumerate(node.outputs)]
    lw.dg.program.append(HostCall(f"host_call {callback} #{outs[0].id}", callback, list(inputs), outs, lw.dg.origin))
    return outs


@lowering("reshape")
def _reshape(lw, node, x, shape):
    return lw.reshape(x, shape)


@lowering("broadcast_to")
def _broadcast_to(lw, node, x, shape):
    out = lw.in_place.get(node.outputs[0].id)
    if out is not None:  # a state reset to a broadcast value: the exchange writes the variable, no buffer
        return _fill(lw, node, [x], out)
    return lw.broadcast_like(
        x, tuple(shape), TileMapping.linear(int(np.prod(shape, dtype=np.int64)), x.itemsize, lw.target)
    )


@lowering("transpose", "slice", "concat", "flip")
def _movement(lw, node, *xs, **attrs):
    """Apply the op's NumPy reference to index arrays: the result says where each element comes from."""
    offsets = np.cumsum([0] + [x.size for x in xs])
    index = get_op(node.op).ref(*[np.arange(x.size).reshape(x.shape) + o for x, o in zip(xs, offsets)], **attrs)
    out = node.outputs[0]
    return lw.gather(out.shape, out.dtype, xs, index, name=node.op)


@lowering("slice_update")
def _slice_update(lw, node, x, update, **attrs):
    """``x`` with a slice replaced. Updating a variable in place (``_in_place_updates``), an exchange writes
    the slice's elements only, on the tiles holding them; else a new tensor takes every element of ``x`` or
    ``update``."""
    index = np.arange(x.size).reshape(x.shape)
    positions = get_op("slice").ref(index, **attrs).reshape(-1)
    variable = lw.in_place.get(node.outputs[0].id)
    if variable is not None and variable.storage is x.storage:
        lw.dg.add_copy("slice_update", variable, [update], np.arange(update.size), dst_elements=positions)
        return x
    index = index.reshape(-1)
    index[positions] = x.size + np.arange(update.size)
    return lw.gather(x.shape, x.dtype, [x, update], index, name="slice_update")


@lowering("pad")
def _pad(lw, node, x, pads, value=0.0):
    """As popops' pad: the border written by Fill vertices on the tiles holding it (no constant exchanged),
    the interior copied from ``x``."""
    index = np.pad(np.arange(x.size).reshape(x.shape), pads, constant_values=-1)
    out = lw.new(index.shape, x.dtype)
    flat = index.reshape(-1)
    border = flat < 0
    lw.fill_elements(out, np.flatnonzero(border), value)
    interior = np.flatnonzero(~border)
    lw.dg.add_copy("pad", out, [x], flat[interior], dst_elements=interior)
    return out


# -- reductions ------------------------------------------------------------------------------------
@lowering("bitwise_not")
def _bitwise_not(lw, node, x):
    out = node.outputs[0]
    return lw.elementwise("logical_not" if x.dtype == DType.bool else "bitwise_not", [x], out.shape, out.dtype)


@lowering("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
def _reduce(lw, node, x, axes, keepdims):
    if isinstance(x, _Product):
        return _summed_product(lw, node, x, _norm_axes(axes, len(x.shape)))
    return lw.reduce_axes(node.op[len("reduce_") :], x, _norm_axes(axes, len(x.shape)), keepdims)


@lowering("argmax", "argmin")
def _arg(lw, node, x, axis, keepdims):
    """First index of the extremum: reduce, compare, then the minimum index among the hits."""
    shape = x.shape
    if axis is None:
        x = lw.reshape(x, (x.size,))
        axis = 0
    axis %= len(x.shape)
    op = "max" if node.op == "argmax" else "min"
    extremum = lw.reduce_axes(op, x, (axis,), True)
    hits = lw.elementwise("eq", [x, extremum], x.shape, DType.bool)
    iota = np.arange(x.shape[axis], dtype=np.int32).reshape([-1 if i == axis else 1 for i in range(len(x.shape))])
    iota = lw.constant(iota, DType.int32)
    big = lw.constant(np.array(x.shape[axis], np.int32), DType.int32)
    candidates = lw.elementwise("where", [hits, iota, big], x.shape, DType.int32)
    result = lw.reduce_axes("min", candidates, (axis,), True)
    return lw.reshape(result, node.outputs[0].shape if node.outputs[0].shape != shape else shape)


# -- matmul ----------------------------------------------------------------------------------------
# A matmul gathers its operand blocks onto its tiles by index maps, so the movement nodes between an operand
# and the matmuls reading it (transposes, reshapes, broadcasts) are views, as Poplar's tensor views: their
# index maps compose into the matmul's, and the operand's elements are exchanged once, straight from where
# they live. A weight broadcast over the batch folds the batch into M (the weight is read once, not once per
# batch), and a batched product summed over batch axes (a broadcast weight's gradient) folds them into K.
VIEW_OPS = ("transpose", "reshape", "broadcast_to")


class _View:
    """A movement node's result read only by matmuls: element i (flat) is element ``index[i]`` of ``base``."""

    __slots__ = ("base", "index", "shape", "dtype")

    def __init__(self, base, index, dtype):
        self.base, self.index, self.shape, self.dtype = base, index, index.shape, dtype


class _Product:
    """A matmul whose only reader sums it over batch axes: its operands, as ``_operands`` gives them."""

    __slots__ = ("node", "operands", "shape")

    def __init__(self, node, operands):
        self.node, self.operands, self.shape = node, operands, node.outputs[0].shape


def _view(lw, node, args):
    """The ``_View`` of movement ``node`` over its lowered input (a tensor or another view); or, when the
    view's rows are not runs of consecutive elements (a transpose of the last axis, which a matmul would
    read element by element), the view gathered into a new tensor, as the movement's own lowering does."""
    (x,) = args
    base, index = (x.base, x.index) if isinstance(x, _View) else (x, np.arange(x.size).reshape(x.shape))
    index = np.asarray(get_op(node.op).ref(index, **node.attrs))
    if index.ndim and not (np.diff(index, axis=-1) == 1).all():
        lw.dg.origin = node
        try:
            return lw.gather(index.shape, x.dtype, [base], index, name=node.op)
        finally:
            lw.dg.origin = None
    return _View(base, index, x.dtype)


def _batch_summed(node, readers):
    """Whether matmul ``node``'s only reader is a reduce_sum over batch axes of it alone (not M or N)."""
    if len(readers) != 1 or readers[0].op != "reduce_sum" or min(len(v.shape) for v in node.inputs) < 2:
        return False
    ndim = len(node.outputs[0].shape)
    axes = _norm_axes(readers[0].attrs["axes"], ndim)
    return bool(axes) and max(axes) < ndim - 2


def _matmul_views(graph, at):
    """{value id: fn(lowerer, node, lowered args) -> its deferred value} of the values a matmul reads through views:
    the movement nodes whose every reader is a matmul or such a movement node, and the matmuls whose only
    reader sums them over batch axes. Outputs and state updates are never deferred. A deferred node reads
    its inputs where its last reader runs: ``at`` (where each node reads, as ``_fusion`` gives it) is
    updated so, so that no in-place update overwrites what a view still reads."""
    uses, kept = _readers(graph)
    views = {}
    for i in reversed(range(len(graph.nodes))):
        node, out = graph.nodes[i], graph.nodes[i].outputs[0]
        readers = [graph.nodes[r] for r in uses.get(out.id, [])]
        if out.id in kept or not readers or any(r.placement != node.placement for r in readers):
            continue
        if node.op in VIEW_OPS and all(r.op == "matmul" or r.outputs[0].id in views for r in readers):
            views[out.id] = _view
        elif node.op == "matmul" and _batch_summed(node, readers):
            views[out.id] = lambda lw, node, args: _Product(node, _operands(node, args))
        else:
            continue
        at[i] = max(at[r] for r in uses[out.id])
    return views


def _operands(node, args):
    """(a sources, a index map (*batch, M, K), b sources, b index map (*batch, K, N)) of matmul ``node``
    over its lowered operands (tensors or views), with 1-D operands as a row and a column."""
    maps = []
    for x in args:
        srcs, index = ([x.base], x.index) if isinstance(x, _View) else ([x], np.arange(x.size).reshape(x.shape))
        maps.append((srcs, index))
    (a_srcs, ia), (b_srcs, ib) = maps
    ia = ia[None] if ia.ndim == 1 else ia
    ib = ib[:, None] if ib.ndim == 1 else ib
    batch = np.broadcast_shapes(ia.shape[:-2], ib.shape[:-2])
    ia = np.broadcast_to(ia, batch + ia.shape[-2:])
    ib = np.broadcast_to(ib, batch + ib.shape[-2:])
    return a_srcs, ia, b_srcs, ib


@lowering("matmul")
def _matmul(lw, node, a, b):
    a_srcs, ia, b_srcs, ib = _operands(node, [a, b])
    (m, k), n = ia.shape[-2:], ib.shape[-1]
    nb = int(np.prod(ia.shape[:-2], dtype=np.int64))
    ia, ib = ia.reshape(nb, m, k), ib.reshape(nb, k, n)
    if len(ib) > 1 and (ib == ib[:1]).all():
        ia, ib = ia.reshape(1, -1, k), ib[:1]  # the same B for every batch: one (batch * M) x K product
    dtype = node.outputs[0].dtype
    return lw.reshape(lw.matmul_index(a_srcs, ia, b_srcs, ib, dtype), node.outputs[0].shape)


def _summed_product(lw, node, product, axes):
    """reduce_sum ``node`` of a batched matmul over batch ``axes``: one matmul whose K runs over those axes
    too, for each kept batch index."""
    a_srcs, ia, b_srcs, ib = product.operands
    batch = ia.ndim - 2
    kept = [i for i in range(batch) if i not in axes]
    runs = int(np.prod([ia.shape[i] for i in kept], dtype=np.int64))
    m, n = ia.shape[-2], ib.shape[-1]
    k = int(np.prod([ia.shape[i] for i in axes], dtype=np.int64)) * ia.shape[-1]
    ia = ia.transpose(*kept, batch, *axes, batch + 1).reshape(runs, m, k)
    ib = ib.transpose(*kept, *axes, batch, batch + 1).reshape(runs, k, n)
    dtype = node.outputs[0].dtype
    return lw.reshape(lw.matmul_index(a_srcs, ia, b_srcs, ib, dtype), node.outputs[0].shape)


# -- random numbers --------------------------------------------------------------------------------
@lowering("random_uniform")
def _random_uniform(lw, node, seed, shape, dtype):
    """Each tile hashes the flat indices of its own block; the seed is broadcast to every tile."""
    out_type = node.outputs[0]
    out = lw.new(out_type.shape, out_type.dtype)
    m = out.mapping
    k = len(m.tiles)
    seeds = lw.gather(
        (k, 2), seed.dtype, [seed], np.tile(np.arange(2), k), TileMapping.on_tiles(np.full(k, 2), m.tiles), name="seed"
    )
    cs = lw.dg.add_compute_set("random")
    i, n = np.arange(k), m.stops - m.starts
    seed_words, block = seeds.regions(2 * i, 2 * i + 2), out.regions(m.starts, m.stops)
    cycles = cost.elementwise_cycles(lw.target, n, out.dtype, "random")
    oc.random(lw.dg.add_vertices, cs, m.tiles, n, cycles, seed=seed_words, out=block, first=m.starts)
    return out


# -- dynamic indexing ------------------------------------------------------------------------------
# A runtime-index gather or scatter runs where its table is. A table that fits a quarter of a tile goes
# whole to one tile; a larger one is cut along the indexed axis into slices, one tile each: every slice
# tile receives all the indices, serves those that fall in its slice and contributes zeros for the rest.
def _spread_tile(lw, salt, offset=0):
    """The tile of a dynamic-index piece: a hash of ``salt`` spreads unrelated ops over the IPU, and
    ``offset`` steps to the neighbouring tiles for the further slices of one op."""
    return lw.target.first_tile + (salt * 2654435761 + offset) % lw.target.num_tiles


def _on_one_tile(lw, tensors, salt):
    tile = _spread_tile(lw, salt)
    placed = [lw.relayout(t, t.shape, TileMapping.on_tiles([t.size], [tile])) for t in tensors]
    return tile, placed


def _axis_slices(lw, nbytes, size):
    """[lo, hi) ranges of an indexed axis of ``size`` cutting a ``nbytes`` table into tile-sized slices."""
    count = min(size, max(1, -(-nbytes // (lw.target.tile_bytes // 4))))
    per = -(-size // count)
    return [(lo, min(lo + per, size)) for lo in range(0, size, per)]


def _int_constant(lw, value):
    return lw.constant(np.array(value, np.int32), DType.int32)


def _wrap_negative(lw, indices, size):
    """``indices`` with negative entries counted from the end of an axis of ``size`` (numpy's rule)."""
    neg = lw.elementwise("lt", [indices, _int_constant(lw, 0)], indices.shape, DType.bool)
    wrapped = lw.elementwise("add", [indices, _int_constant(lw, size)], indices.shape, DType.int32)
    return lw.elementwise("where", [neg, wrapped, indices], indices.shape, DType.int32)


def _in_slice(lw, indices, lo, hi, outside=0):
    """(mask of ``indices`` in [lo, hi), indices made slice-local with ``outside`` where outside)."""
    shape = indices.shape
    above = lw.elementwise("ge", [indices, _int_constant(lw, lo)], shape, DType.bool)
    below = lw.elementwise("lt", [indices, _int_constant(lw, hi)], shape, DType.bool)
    inside = lw.elementwise("logical_and", [above, below], shape, DType.bool)
    local = lw.elementwise("sub", [indices, _int_constant(lw, lo)], shape, DType.int32)
    return inside, lw.elementwise("where", [inside, local, _int_constant(lw, outside)], shape, DType.int32)


def _bounds_check(lw, indices, size, salt):
    """A compute set that counts out-of-range ``indices`` into the run's error (see _check_vertex)."""
    tile, (it,) = _on_one_tile(lw, [indices], salt)
    _check_vertex(lw, lw.dg.add_compute_set("bounds-check"), tile, it, size)


def _check_vertex(lw, cs, tile, indices, size, span=None):
    """Count ``indices`` (elements ``span`` = (start, stop), all by default, on ``tile``) outside an axis of
    ``size``, after negative wrap, into the run's error: a GATHER vertex whose slices are zero elements wide
    reads and writes nothing but the check."""
    start, stop = span or (0, indices.size)
    dummy = lw.new((1,), DType.int32, TileMapping.on_tiles([1], [tile]))
    one, idx = dummy.region(0, 1), indices.region(start, stop)
    cycles = cost.gather_cycles(lw.target, 1, stop - start, 0, 4)
    oc.gather(
        lw.dg.add_vertex, cs, tile, stop - start, cycles, table=one, indices=idx, out=one, rows=1, inner=0, size=size
    )


def _flat_indices(lw, x, indices, axis):
    """Flat element indices into ``x`` for take_along_axis-style ``indices`` (computed on the device)."""
    idx = _wrap_negative(lw, indices, x.shape[axis])
    stride = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    base = np.arange(x.size).reshape(x.shape)
    sel = [slice(0, d) for d in indices.shape]
    sel[axis] = slice(0, 1)
    base = np.broadcast_to(base[tuple(sel)], indices.shape).astype(np.int32)
    scaled = lw.elementwise("mul", [idx, _int_constant(lw, stride)], indices.shape, DType.int32)
    return lw.elementwise("add", [scaled, lw.constant(base, DType.int32)], indices.shape, DType.int32)


def _gather_vertex(lw, kind, tile, x, idx, out, rows, inner, size, upd=None, check=None):
    """One GATHER or SCATTER_ADD vertex in a compute set of its own. ``check`` (indices on ``tile``, axis
    size) adds a bounds check of the caller's own indices to the same compute set: flat indices computed
    from them can be in range although an index is not."""
    fields = {"table": x.region(0, max(x.size, 1)), "indices": idx.region(0, idx.size), "out": out.region(0, out.size)}
    if upd is not None:
        fields["updates"] = upd.region(0, upd.size)
    cs = lw.dg.add_compute_set("gather" if kind == oc.GATHER else "scatter_add")
    cycles = cost.gather_cycles(lw.target, rows, idx.size, inner, x.itemsize)
    # With ``check``, the check vertex counts the user's own indices instead of this one.
    sizes = {"rows": rows, "inner": inner, "size": size, "checked_elsewhere": check is not None}
    oc.BUILDERS[kind](lw.dg.add_vertex, cs, tile, idx.size, cycles, **fields, **sizes)
    if check is not None:
        _check_vertex(lw, cs, tile, *check)


def _gather_rows(lw, x, idx, axis, out_shape, salt, check=None):
    """out[..., i, ...] = x[..., idx[i], ...] along ``axis`` (x viewed as rows x size x inner). ``check``:
    (the user's indices, their axis size) when ``idx`` was computed from them."""
    if idx.size == 0 or x.size == 0:
        return lw.fill(out_shape, x.dtype, 0.0)
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    size = x.shape[axis]
    inner = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
    out_size = int(np.prod(out_shape, dtype=np.int64))
    linear = TileMapping.linear(out_size, x.itemsize, lw.target)
    slices = _axis_slices(lw, x.size * x.itemsize, size)
    # A large output of a single-row table is cut into chunks of indices, one tile each.
    chunks = _axis_slices(lw, out_size * x.itemsize, idx.size) if rows == 1 else [(0, idx.size)]
    if len(slices) == 1 and len(chunks) == 1:
        tile, (xt, it, *ct) = _on_one_tile(lw, [x, idx] + ([check[0]] if check else []), salt)
        out = lw.new(out_shape, x.dtype, TileMapping.on_tiles([out_size], [tile]))
        _gather_vertex(lw, oc.GATHER, tile, xt, it, out, rows, inner, size, check=(ct[0], check[1]) if ct else None)
        return lw.relayout(out, out_shape, linear)
    _bounds_check(lw, *(check or (idx, size)), salt)
    wrapped = _wrap_negative(lw, idx, size)
    # The mask of an index, shaped to broadcast over the output's leading and trailing axes.
    mask_shape = (1,) * axis + idx.shape + (1,) * (len(x.shape) - axis - 1)
    table = np.arange(x.size).reshape(rows, size, inner)
    zero = lw.constant(np.array(0, x.dtype.numpy), x.dtype)
    total = None
    for k, (lo, hi) in enumerate(slices):
        tiles = [_spread_tile(lw, salt, k * len(chunks) + c + 1) for c in range(len(chunks))]
        inside, local = _in_slice(lw, wrapped, lo, hi)
        counts = [c1 - c0 for c0, c1 in chunks]
        it = lw.relayout(local, (local.size,), TileMapping.on_tiles(counts, tiles))
        out = lw.new((out_size,), x.dtype, TileMapping.on_tiles([rows * n * inner for n in counts], tiles))
        copies = [
            lw.gather(
                (rows, hi - lo, inner),
                x.dtype,
                [x],
                table[:, lo:hi, :],
                TileMapping.on_tiles([rows * (hi - lo) * inner], [tile]),
                name="gather-slice",
            )
            for tile in tiles
        ]
        cs = lw.dg.add_compute_set("gather")  # after the copies it reads, in program order
        for tile, xs, (c0, c1) in zip(tiles, copies, chunks):
            fields = {
                "table": xs.region(0, xs.size),
                "indices": it.region(c0, c1),
                "out": out.region(rows * c0 * inner, rows * c1 * inner),  # chunks only when rows == 1
            }
            cycles = cost.gather_cycles(lw.target, rows, c1 - c0, inner, x.itemsize)
            oc.gather(lw.dg.add_vertex, cs, tile, c1 - c0, cycles, **fields, rows=rows, inner=inner, size=hi - lo)
        out = lw.relayout(lw.reshape(out, out_shape), out_shape, linear)
        part = lw.elementwise("where", [lw.reshape(inside, mask_shape), out, zero], out_shape, x.dtype)
        total = part if total is None else lw.elementwise("add", [total, part], out_shape, x.dtype)
    return total


@lowering("gather")
def _gather(lw, node, x, indices, axis):
    axis %= len(x.shape)
    return _gather_rows(lw, x, indices, axis, node.outputs[0].shape, x.size + indices.size)


@lowering("take_along_axis")
def _take_along_axis(lw, node, x, indices, axis):
    axis %= len(x.shape)
    flat = _flat_indices(lw, x, indices, axis)
    salt = x.size + 3 * indices.size
    check = (indices, x.shape[axis])
    return _gather_rows(lw, lw.reshape(x, (x.size,)), flat, 0, node.outputs[0].shape, salt, check)


@lowering("scatter_add")
def _scatter_add(lw, node, x, indices, updates, axis):
    axis %= len(x.shape)
    if indices.size == 0 or x.size == 0:
        return lw.relayout(x, x.shape, TileMapping.linear(x.size, x.itemsize, lw.target)) if x.size else x
    salt = x.size + 5 * indices.size
    if indices.shape != tuple(node.inputs[1].shape):  # one index per row: see _row_scatter_indices
        inner = x.size // x.shape[0]
        at = _wrap_negative(lw, lw.reshape(indices, (indices.size,)), x.shape[0])
        return _scatter_add_spread(lw, x, at, updates, (indices, x.shape[0]), salt, inner)
    flat = _flat_indices(lw, x, indices, axis)
    return _scatter_add_spread(lw, x, flat, updates, (indices, x.shape[axis]), salt, 1)


def _scatter_add_spread(lw, x, at, updates, check, salt, inner):
    """``x`` with the rows of ``inner`` elements of ``updates`` added at rows ``at`` of flat ``x`` (wrapped [n]
    indices: whole rows of an embedding backward, single elements otherwise), on one tile when table, indices
    and updates fit, else over tiles (``_scatter_add_tiled``). ``check``: the user's indices and their axis
    size, whose out-of-range entries are counted into the run's error."""
    size = x.size // inner
    slices = _axis_slices(lw, x.size * x.itemsize, size)
    # Indices and updates that would not fit a quarter of a tile together are cut into chunks as well.
    chunks = _axis_slices(lw, at.size * (at.itemsize + inner * updates.itemsize), at.size)
    if len(slices) == 1 and len(chunks) == 1:
        tile, (it, ut, ct) = _on_one_tile(lw, [at, updates, check[0]], salt)
        out = lw.gather(
            x.shape, x.dtype, [x], np.arange(x.size), TileMapping.on_tiles([x.size], [tile]), name="scatter-init"
        )
        _gather_vertex(lw, oc.SCATTER_ADD, tile, out, it, out, 1, inner, size, upd=ut, check=(ct, check[1]))
        return lw.relayout(out, x.shape, TileMapping.linear(x.size, x.itemsize, lw.target))
    parts = _scatter_add_tiled(lw, x, at, updates, check, salt, slices, chunks, inner)
    return lw.gather(x.shape, x.dtype, parts, np.arange(x.size), name="scatter-slices")


def _scatter_add_tiled(lw, x, at, updates, check, salt, slices, chunks, inner):
    """The slices of rows [lo, hi) of flat ``x`` with ``updates`` added at rows ``at``, as Poplar's
    multiUpdateAdd spreads them: slice k's chunk c of indices and updates sits on a tile of its own, and the
    slice's running sum steps from chunk tile to chunk tile, so every update is added in index order as one
    vertex would (the same bits) while no tile holds more than a slice and a chunk. An index outside a slice
    is made out of range there, so that slice's vertex skips its update. ``check``: the user's indices and
    their axis size, range-checked chunk by chunk."""
    counts = [c1 - c0 for c0, c1 in chunks]
    tiles, local, kept = [], [], []
    for k, (lo, hi) in enumerate(slices):
        tiles.append([_spread_tile(lw, salt, 1 + k * len(chunks) + c) for c in range(len(chunks))])
        _, where = _in_slice(lw, at, lo, hi, outside=hi - lo)
        local.append(lw.relayout(where, where.shape, TileMapping.on_tiles(counts, tiles[k])))
        spread = TileMapping.on_tiles([n * inner for n in counts], tiles[k])
        kept.append(lw.relayout(updates, updates.shape, spread))
    # The user's indices are checked on tiles of their own: beside a slice's chunks they would double them.
    checkers = [_spread_tile(lw, salt, 1 + len(slices) * len(chunks) + c) for c in range(len(chunks))]
    user = lw.relayout(check[0], check[0].shape, TileMapping.on_tiles(counts, checkers))
    sums = [x] * len(slices)
    for c, (c0, c1) in enumerate(chunks):
        steps = []
        for k, (lo, hi) in enumerate(slices):
            src = np.arange(lo * inner, hi * inner) if c == 0 else np.arange((hi - lo) * inner)
            place = TileMapping.on_tiles([(hi - lo) * inner], [tiles[k][c]])
            steps.append(lw.gather(((hi - lo) * inner,), x.dtype, [sums[k]], src, place, name="scatter-init"))
        cs = lw.dg.add_compute_set("scatter_add")  # after the copies it reads, in program order
        for k, (lo, hi) in enumerate(slices):
            out, tile = steps[k], tiles[k][c]
            fields = {"table": out.region(0, out.size), "indices": local[k].region(c0, c1)}
            fields.update(updates=kept[k].region(c0 * inner, c1 * inner), out=out.region(0, out.size))
            cycles = cost.gather_cycles(lw.target, 1, c1 - c0, inner, x.itemsize)
            oc.scatter_add(
                lw.dg.add_vertex,
                cs,
                tile,
                c1 - c0,
                cycles,
                **fields,
                rows=1,
                inner=inner,
                size=hi - lo,
                checked_elsewhere=True,
            )
        _check_vertex(lw, cs, checkers[c], user, check[1], span=(c0, c1))
        sums = steps
    return sums


# -- convolution and pooling: index maps feeding the direct-conv, matmul and reduction planners --------
# conv2d runs as CONV vertices over input windows already on their tiles (conv_plan). The gradients that are
# not a plain window over their operands run as (output channels x K) @ (K x positions) matmuls so that
# operand and result runs follow the contiguous spatial axes of NCHW, with kernel taps folded into K.
def _grouped(shape, groups):
    """Flat indices of an (N, G * C, H, W) tensor as (G, N, C, H, W)."""
    n, c, h, w = shape
    return np.arange(n * c * h * w).reshape(n, groups, c // groups, h, w).transpose(1, 0, 2, 3, 4)


def _ungrouped(shape, groups):
    """For each element of an (N, G * C, H, W) tensor, its flat position in the (G, N, C, H, W) layout."""
    n, c, h, w = shape
    return np.arange(n * c * h * w).reshape(groups, n, c // groups, h, w).transpose(1, 0, 2, 3, 4)


def _dithered(forward):
    """Lower a convolution pass inside ``conv_plan.dithered``, keyed by ``forward(*inputs, **attrs)``: the
    forward convolution's groups, batch, weight shape and input field."""

    def wrap(fn):
        def lower(lw, node, *inputs, **attrs):
            groups, batch, (o, cg, *_), field = forward(*inputs, **attrs)
            with conv_plan.dithered(lw, groups, batch, cg, o // groups, tuple(field)):
                return fn(lw, node, *inputs, **attrs)

        return lower

    return wrap


@lowering("conv2d")
@_dithered(lambda x, w, groups, **_: (groups, x.shape[0], w.shape, x.shape[2:]))
def _conv2d(lw, node, x, w, stride, padding, dilation, groups):
    """As poplin's planner: CONV vertices over windows on their tiles, or the kernel folded into the input
    channels (a matmul over im2col columns) when that is estimated faster (few input channels, where each
    AMP weight reload at a kernel position does little work even with the kernel columns folded)."""
    o, cg, kh, kw = w.shape
    out_shape = node.outputs[0].shape
    spec = conv_plan.ConvSpec(
        groups, x.shape[0], cg, o // groups, x.shape[2:], out_shape[2:], (kh, kw), tuple(stride),
        tuple(dilation), (padding[0][0], padding[1][0]),
    )  # fmt: skip
    if not conv_plan.direct_is_faster(lw, spec, x.dtype):
        return _conv2d_im2col(lw, node, x, w, stride, padding, dilation, groups)
    w_index = np.arange(w.size).reshape(groups, o // groups, cg, kh, kw)
    return conv_plan.direct_conv(
        lw, [x], _grouped(x.shape, groups), [w], w_index, spec, x.dtype, out_shape, _ungrouped(out_shape, groups)
    )


def _conv2d_im2col(lw, node, x, w, stride, padding, dilation, groups):
    n = x.shape[0]
    o, cg, kh, kw = w.shape
    g, og = groups, o // groups
    win = window.windows(x.shape, (kh, kw), stride, padding, dilation)
    _, _, oh, ow = win.shape[:4]
    a = np.arange(w.size).reshape(g, og, cg * kh * kw)
    b = win.reshape(n, g, cg, oh, ow, kh, kw).transpose(1, 2, 5, 6, 0, 3, 4).reshape(g, cg * kh * kw, n * oh * ow)
    # The product is (G, Og, N*OH*OW); its partials go straight to the NCHW output.
    order = np.arange(g * og * n * oh * ow).reshape(g, og, n, oh, ow).transpose(2, 0, 1, 3, 4)
    return lw.matmul_index([w], a, [x], b, x.dtype, order=order.reshape(node.outputs[0].shape))


@lowering("conv2d_grad_weight")
@_dithered(lambda x, gy, weight_shape, groups, **_: (groups, x.shape[0], weight_shape, x.shape[2:]))
def _conv2d_grad_weight(lw, node, x, gy, weight_shape, stride, padding, dilation, groups):
    """The weight gradient is a convolution too (as poplin plans it): each input channel's image, its batch
    taken as the channels, convolved with the output gradient as the kernel (the forward's dilation as its
    stride and its stride as its dilation): CONV vertices over input windows on their tiles when estimated
    faster, else a matmul over im2col windows (which sends an input element to a tile once per tap)."""
    o, cg = weight_shape[:2]
    spec = conv_plan.ConvSpec(
        groups, cg, x.shape[0], o // groups, x.shape[2:], tuple(weight_shape[2:]), gy.shape[2:], tuple(dilation),
        tuple(stride), (padding[0][0], padding[1][0]),
    )  # fmt: skip
    if not conv_plan.direct_is_faster(lw, spec, x.dtype):
        return _conv2d_grad_weight_matmul(lw, x, gy, weight_shape, stride, padding, dilation, groups)
    x_index = _grouped(x.shape, groups).transpose(0, 2, 1, 3, 4)  # (G, Cg, N, H, W): channels are the batch
    gy_index = _grouped(gy.shape, groups).transpose(0, 2, 1, 3, 4)  # (G, Og, N, OH, OW)
    order = np.arange(int(np.prod(weight_shape))).reshape(groups, cg, o // groups, *weight_shape[2:])
    return conv_plan.direct_conv(
        lw, [x], x_index, [gy], gy_index, spec, x.dtype, tuple(weight_shape), order.transpose(0, 2, 1, 3, 4)
    )


def _conv2d_grad_weight_matmul(lw, x, gy, weight_shape, stride, padding, dilation, groups):
    n = x.shape[0]
    o, cg, kh, kw = weight_shape
    g, og = groups, o // groups
    _, _, oh, ow = gy.shape
    win = window.windows(x.shape, (kh, kw), stride, padding, dilation)[:, :, :oh, :ow]
    a = win.reshape(n, g, cg, oh, ow, kh, kw).transpose(1, 2, 5, 6, 0, 3, 4).reshape(g, cg * kh * kw, n * oh * ow)
    b = np.arange(gy.size).reshape(n, g, og, oh, ow).transpose(1, 0, 3, 4, 2).reshape(g, n * oh * ow, og)
    # The product is (G, Cg*KH*KW, Og); its partials go straight to the weight's layout.
    order = np.arange(g * cg * kh * kw * og).reshape(g, cg, kh, kw, og).transpose(0, 4, 1, 2, 3)
    return lw.matmul_index([x], a, [gy], b, x.dtype, order=order.reshape(weight_shape))


@lowering("conv2d_grad_input")
@_dithered(lambda gy, w, input_shape, groups, **_: (groups, gy.shape[0], w.shape, input_shape[2:]))
def _conv2d_grad_input(lw, node, gy, w, input_shape, stride, padding, dilation, groups):
    """The input gradient is a convolution of the output gradient, its elements spaced ``stride`` apart,
    with the kernel flipped and its channels swapped: CONV vertices when estimated faster, else a matmul
    over transposed windows."""
    o, cg, kh, kw = w.shape
    (dh, dw), (top, left) = dilation, (padding[0][0], padding[1][0])
    pad = (dh * (kh - 1) - top, dw * (kw - 1) - left)
    spec = conv_plan.ConvSpec(
        groups, gy.shape[0], o // groups, cg, gy.shape[2:], tuple(input_shape[2:]), (kh, kw), (1, 1),
        tuple(dilation), pad, tuple(stride),
    )  # fmt: skip
    if not conv_plan.direct_is_faster(lw, spec, gy.dtype):
        return _conv2d_grad_input_matmul(lw, gy, w, input_shape, stride, padding, dilation, groups)
    flipped = np.arange(w.size).reshape(groups, o // groups, cg, kh, kw)[..., ::-1, ::-1]
    order = _ungrouped(tuple(input_shape), groups)
    return conv_plan.direct_conv(
        lw, [gy], _grouped(gy.shape, groups), [w], flipped.transpose(0, 2, 1, 3, 4), spec, gy.dtype,
        tuple(input_shape), order,
    )  # fmt: skip


def _conv2d_grad_input_matmul(lw, gy, w, input_shape, stride, padding, dilation, groups):
    n, c, h, wd = input_shape
    o, cg, kh, kw = w.shape
    g, og = groups, o // groups
    src = window.transposed_windows(input_shape, gy.shape, (kh, kw), stride, padding, dilation)  # (N,H,W,O,KH,KW)
    a = np.arange(w.size).reshape(g, og, cg, kh, kw).transpose(0, 2, 1, 3, 4).reshape(g, cg, og * kh * kw)
    b = src.reshape(n, h, wd, g, og, kh, kw).transpose(3, 4, 5, 6, 0, 1, 2).reshape(g, og * kh * kw, n * h * wd)
    # The product is (G, Cg, N*H*W); its partials go straight to the NCHW input gradient.
    order = np.arange(g * cg * n * h * wd).reshape(g, cg, n, h, wd).transpose(2, 0, 1, 3, 4)
    return lw.matmul_index([w], a, [gy], b, gy.dtype, order=order.reshape(input_shape))


def _pool_windows(x, kernel, stride, padding, dilation, ceil_mode):
    win = window.windows(x.shape, kernel, stride, padding, dilation, ceil_mode)
    rows = int(np.prod(win.shape[:4]))
    return win.reshape(rows, -1), win.shape[:4]


def _first_argmax(lw, x, win):
    """Per window row, the first tap (int32) holding the window's maximum (padding counts as -inf)."""
    rows, taps = win.shape
    staged = lw.gather((rows, taps), x.dtype, [x], win, fill=-np.inf, name="pool-windows")
    peak = lw.reduce_axes("max", staged, (1,), True)
    hits = lw.elementwise("eq", [staged, peak], (rows, taps), DType.bool)
    iota = lw.constant(np.arange(taps, dtype=np.int32), DType.int32)
    none = lw.constant(np.array(taps, np.int32), DType.int32)
    candidates = lw.elementwise("where", [hits, iota, none], (rows, taps), DType.int32)
    return lw.reduce_axes("min", candidates, (1,), False)


@lowering("max_pool2d")
def _max_pool2d(lw, node, x, kernel, stride, padding, dilation, ceil_mode):
    win, shape = _pool_windows(x, kernel, stride, padding, dilation, ceil_mode)
    return lw.reduce_index("max", [x], win, shape, x.dtype, x.dtype)


@lowering("max_pool2d_grad")
def _max_pool2d_grad(lw, node, x, gy, kernel, stride, padding, dilation, ceil_mode):
    """Each input element sums the cotangents of the windows whose first maximum it is."""
    win, _ = _pool_windows(x, kernel, stride, padding, dilation, ceil_mode)
    taps = win.shape[1]
    arg = _first_argmax(lw, x, win)
    inv = window.inverse(win, x.size)  # (X, width) flat window positions r * taps + k
    rows_of = np.where(inv >= 0, inv // taps, -1)
    taps_of = np.where(inv >= 0, inv % taps, -2).astype(np.int32)
    shape = inv.shape
    winner = lw.gather(shape, DType.int32, [arg], rows_of, fill=-1, name="pool-grad-arg")
    grads = lw.gather(shape, gy.dtype, [gy], rows_of, fill=0.0, name="pool-grad-gy")
    hit = lw.elementwise("eq", [winner, lw.constant(taps_of, DType.int32)], shape, DType.bool)
    zero = lw.constant(np.array(0), gy.dtype)
    picked = lw.elementwise("where", [hit, grads, zero], shape, gy.dtype)
    return lw.reshape(lw.reduce_axes("sum", picked, (1,), False), x.shape)


@lowering("max_pool2d_select")
def _max_pool2d_select(lw, node, x, c, kernel, stride, padding, dilation, ceil_mode):
    """Per window of x, c at the window's first maximum."""
    win, shape = _pool_windows(x, kernel, stride, padding, dilation, ceil_mode)
    rows, taps = win.shape
    arg = lw.reshape(_first_argmax(lw, x, win), (rows, 1))
    values = lw.gather((rows, taps), c.dtype, [c], win, fill=0.0, name="pool-select")
    iota = lw.constant(np.arange(taps, dtype=np.int32), DType.int32)
    hit = lw.elementwise("eq", [iota, arg], (rows, taps), DType.bool)
    picked = lw.elementwise("where", [hit, values, lw.constant(np.array(0), c.dtype)], (rows, taps), c.dtype)
    return lw.reshape(lw.reduce_axes("sum", picked, (1,), False), shape)


# -- scans and sorting as index maps and comparisons -----------------------------------------------
def _axis_last(x, axis):
    """(R, L) index map of ``x`` with ``axis`` moved last, and the inverse map back."""
    perm = [i for i in range(len(x.shape)) if i != axis] + [axis]
    moved = np.arange(x.size).reshape(x.shape).transpose(perm)
    back = np.argsort(moved.reshape(-1))
    return moved.reshape(-1, x.shape[axis]), back


@lowering("cumsum")
def _cumsum(lw, node, x, axis, reverse=False):
    """Each output sums its prefix (or suffix): an (R*L, L) index map reduced on the output's tiles."""
    axis %= len(x.shape)
    rows, back = _axis_last(x, axis)
    length = rows.shape[1]
    j = np.arange(length)
    keep = (j[None, :] >= j[:, None]) if reverse else (j[None, :] <= j[:, None])
    index = np.where(keep[None], rows[:, None, :], -1).reshape(-1, length)
    scanned = lw.reduce_index("sum", [x], index, (x.size,), x.dtype, x.dtype)
    return lw.gather(x.shape, x.dtype, [scanned], back, name="cumsum-out")


@lowering("sort")
def _sort(lw, node, x, axis, descending):
    """Stable sort by ranks: rank_i counts the elements ordered before i; output p takes the i of rank p."""
    axis %= len(x.shape)
    rows, back = _axis_last(x, axis)
    r, n = rows.shape
    xi = lw.gather((r, n, 1), x.dtype, [x], rows[:, :, None], name="sort-keys")
    xj = lw.gather((r, 1, n), x.dtype, [x], rows[:, None, :], name="sort-keys")
    ahead = lw.elementwise("gt" if descending else "lt", [xj, xi], (r, n, n), DType.bool)
    tie = lw.elementwise("eq", [xj, xi], (r, n, n), DType.bool)
    earlier = lw.constant(np.tri(n, k=-1, dtype=bool)[None], DType.bool)
    before = lw.elementwise(
        "logical_or",
        [ahead, lw.elementwise("logical_and", [tie, earlier], (r, n, n), DType.bool)],
        (r, n, n),
        DType.bool,
    )
    counted = lw.elementwise("cast", [before], (r, n, n), DType.int32)
    rank = lw.reshape(lw.reduce_axes("sum", counted, (2,), False), (r, 1, n))
    slot = lw.constant(np.arange(n, dtype=np.int32).reshape(1, n, 1), DType.int32)
    hit = lw.elementwise("eq", [rank, slot], (r, n, n), DType.bool)
    zero = lw.constant(np.array(0), x.dtype)
    values = lw.elementwise("where", [hit, lw.reshape(xi, (r, 1, n)), zero], (r, n, n), x.dtype)
    which = lw.constant(np.arange(n, dtype=np.int32).reshape(1, 1, n), DType.int32)
    picked = lw.elementwise(
        "where", [hit, which, lw.constant(np.array(0, np.int32), DType.int32)], (r, n, n), DType.int32
    )
    sorted_values = lw.reduce_axes("max" if x.dtype == DType.bool else "sum", values, (2,), False)
    indices = lw.reduce_axes("sum", picked, (2,), False)
    return (
        lw.gather(x.shape, x.dtype, [sorted_values], back, name="sort-values"),
        lw.gather(x.shape, DType.int32, [indices], back, name="sort-indices"),
    )
