"""Poplar's vocabulary: tensors with tile mappings, compute sets of vertices, exchanges and programs.

A vertex is one codelet instance on one tile; each of its fields is a ``Region`` (a contiguous element
range of a tensor) that must lie in that tile's memory. A compute set holds its vertices as ``Vertices``
batches (one codelet, one array entry per vertex), built whole by ``add_vertices`` or one at a time by
``add_vertex``. A field reaching another tile is rejected here, when the vertex is added, with a
``popsim.Error``. ``Copy`` is an exchange: element i of ``dst``
takes element ``index[i]`` of the concatenated sources, whatever tiles they live on.

A program is a step or a list of steps (a list is a ``Sequence``). Steps: ``ComputeSet`` (or
``Execute(compute_set)``), ``Copy``, ``Sequence``, ``Repeat``, ``If``, ``Sync`` and ``StreamCopy`` (host
streams inside the program). ``Executable.run`` also streams a compiled graph's inputs in before its program
and its outputs out after it.
"""

from dataclasses import dataclass, field

import numpy as np

from popir import DType
from popsim import _opcodes as oc
from popsim.errors import Error
from popsim.mapping import TileMapping
from popsim.validate import check_vertices, kind_code, sub_code


class Tensor:
    """A device tensor: shape, dtype (a popir DType) and tile mapping. Aliases share a ``storage``."""

    __slots__ = ("id", "name", "shape", "dtype", "mapping", "storage", "category", "value", "origin")

    def __init__(self, id_, name, shape, dtype, mapping, category, storage=None, value=None):
        self.id = id_
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.mapping = mapping
        self.storage = storage if storage is not None else self
        self.category = category
        self.value = value
        self.origin = None  # the popir node being lowered when the tensor was made (see DeviceGraph.origin)

    @property
    def size(self):
        return self.mapping.size

    @property
    def itemsize(self):
        return self.dtype.itemsize

    def region(self, start, stop):
        """Elements ``start..stop-1`` of the flattened tensor."""
        return Region(self, int(start), int(stop))

    def regions(self, starts, stops):
        """Elements ``starts[i]..stops[i]-1`` for each i: the field of a batch of vertices (``add_vertices``)."""
        return Regions(self, np.asarray(starts), np.asarray(stops))

    def __repr__(self):
        return f"<Tensor {self.name}: {self.dtype}{list(self.shape)}>"


@dataclass(frozen=True)
class Region:
    tensor: Tensor
    start: int
    stop: int


@dataclass(frozen=True)
class Regions:
    """One element range of ``tensor`` per vertex of a batch: ``starts[i]..stops[i]-1``."""

    tensor: Tensor
    starts: np.ndarray
    stops: np.ndarray


@dataclass
class Vertices:
    """Vertices of one codelet in one compute set, as arrays with one entry per vertex: vertex i runs on tile
    ``tiles[i]`` over ``n[i]`` elements, its field f is range i of ``fields[f]`` (a Regions), its parameter p
    is ``params[p][i]`` (``_opcodes.VERTEX_PARAMS``) and ``cycles[i]`` its estimate. ``kind``/``sub`` select
    the codelet (see _opcodes); ``blocks[f]`` is the tile-mapping block holding each range of field f."""

    kind: int
    sub: int
    tiles: np.ndarray
    n: np.ndarray
    fields: dict
    cycles: np.ndarray
    params: dict
    blocks: dict
    fparam: float = 0.0  # a FILL vertex's value
    program: object = None  # an EXPR vertex's program rows (see Lowerer.expression)

    def __len__(self):
        return len(self.tiles)


@dataclass
class ComputeSet:
    name: str
    batches: list = field(default_factory=list)
    origin: object = None  # the popir node it was lowered from (see DeviceGraph.origin)
    fused: tuple = ()  # the popir nodes computed in its fused vertices, the reader last (see DeviceGraph.fused)

    @property
    def num_vertices(self):
        return sum(len(b) for b in self.batches)


@dataclass
class Copy:
    """An exchange program: ``dst`` element i takes element ``index[i]`` of the concatenated ``srcs``; with
    ``dst_elements``, only those elements of ``dst`` are written (element ``dst_elements[i]`` takes
    ``index[i]``) and the rest keep their values, as a copy into a slice of a Poplar tensor."""

    name: str
    dst: Tensor
    srcs: list
    index: np.ndarray
    origin: object = None  # the popir node it was lowered from (see DeviceGraph.origin)
    dst_elements: np.ndarray = field(default=None, kw_only=True)

    def __post_init__(self):
        self.srcs = list(self.srcs)
        self.index = np.asarray(self.index, np.int64).reshape(-1)
        total = sum(s.size for s in self.srcs)
        written = self.dst.size
        if self.dst_elements is not None:
            self.dst_elements = np.asarray(self.dst_elements, np.int64).reshape(-1)
            written = self.dst_elements.size
            if written and (self.dst_elements.min() < 0 or self.dst_elements.max() >= self.dst.size):
                raise Error(f"copy {self.name!r}: destination elements outside its {self.dst.size} elements")
        if self.index.size != written:
            raise Error(f"copy {self.name!r}: index map of {self.index.size} elements for a destination of {written}")
        if self.index.size and (self.index.min() < 0 or self.index.max() >= total):
            raise Error(f"copy {self.name!r}: index map reaches outside its {total} source elements")
        if any(s.dtype != self.dst.dtype for s in self.srcs):
            raise Error(f"copy {self.name!r}: sources and destination must share a dtype")


class DeviceGraph:
    """Tensors, compute sets and the program (a list of steps, run in order) being built for one target.

    Provenance for profiles: tensors, compute sets and copies made while ``origin`` is set record it (the
    popir node being lowered) and compute sets record ``fused``, the popir nodes fused into one expression while
    it is lowered; ``node_outputs`` holds the ids of storages that hold a popir value (the
    rest are planner temporaries); ``state_kinds`` maps variable names to their popir input kind."""

    def __init__(self, target):
        self.target = target
        self.tensors = []
        self.program = []
        self.origin = None
        self.fused = ()
        self.node_outputs = set()
        self.state_kinds = {}
        self.remote = set()  # variable storages kept in streaming memory (see popsim.remote)
        self.remote_shards = {}  # remote storage -> replicas it is sharded over (replicated tensor sharding)
        # Variables no program updates (only the host writes them, e.g. an optimizer hyper-parameter), and the
        # copies on tiles of those that are scalars: placed at load and rewritten on each host write.
        self.host_written = set()
        self.loaded_copies = {}  # variable storage -> {key: a copy of it (see Lowerer.host_copy)}
        self.host_copy_of = {}  # such a copy -> its variable

    def add_tensor(self, shape, dtype, mapping=None, name=None, category="temporary", value=None):
        """A new tensor of ``dtype`` (a popir DType); ``mapping`` defaults to the linear mapping for the target."""
        if not isinstance(dtype, DType) or dtype.value not in oc.DTYPE_CODES:
            raise Error(
                f"tensor {name or ''!r}: dtype must be a popir DType ({', '.join(oc.DTYPE_CODES)}), got {dtype!r}; "
                "pass popir.DType.float32 or popir.as_dtype('float32')"
            )
        if not all(isinstance(d, int | np.integer) and d >= 0 for d in tuple(shape)):
            raise Error(f"tensor {name or ''!r}: shape must be non-negative integers, got {shape!r}")
        size = int(np.prod(shape, dtype=np.int64))
        mapping = mapping if mapping is not None else TileMapping.linear(size, dtype.itemsize, self.target)
        if mapping.size != size:
            raise Error(f"mapping of {mapping.size} elements given for a tensor of {size}")
        if mapping.size and (mapping.tiles.min() < 0 or mapping.tiles.max() >= self.target.num_tiles):
            raise Error(f"mapping of {name or 'tensor'} names tiles outside 0..{self.target.num_tiles - 1}")
        t = Tensor(len(self.tensors), name or f"t{len(self.tensors)}", shape, dtype, mapping, category, value=value)
        t.origin = self.origin
        self.tensors.append(t)
        return t

    def alias(self, tensor, shape, name=None):
        """A reshaped view of ``tensor`` sharing its memory (no copy)."""
        t = Tensor(
            len(self.tensors),
            name or f"t{len(self.tensors)}",
            shape,
            tensor.dtype,
            tensor.mapping,
            tensor.category,
            storage=tensor.storage,
            value=None,
        )
        t.origin = self.origin
        self.tensors.append(t)
        return t

    def add_compute_set(self, name):
        """A new compute set appended to the program (an Execute step)."""
        cs = ComputeSet(name, origin=self.origin, fused=self.fused)
        self.program.append(cs)
        return cs

    def add_vertex(
        self, cs, kind, sub, tile, n, fields, cycles, p0=None, p1=None, p2=None, fparam=0.0, program=None, **params
    ):
        """Add a vertex of ``kind`` (a number or name, see ``_opcodes.KINDS``) and sub-op ``sub`` (a number or
        name such as "add") on ``tile``, running over ``n`` elements. ``fields`` maps the kind's field names
        to Regions, which must lie in that tile's memory; ``params`` are the kind's named integer parameters
        (``_opcodes.VERTEX_PARAMS``: ``rows``/``group`` of a REDUCE, ``m``/``k`` of a MATMUL, ...), which
        ``p0``/``p1``/``p2`` may give by row column instead. Everything is checked here (see
        ``validate.check_vertices``): a vertex that could touch memory outside its fields is a popsim.Error.
        Returns the batch of one vertex it added."""
        if not isinstance(tile, int | np.integer):
            raise Error(f"vertex tile {tile!r} is not a tile of the target (0..{self.target.num_tiles - 1})")
        if not isinstance(fields, dict) or not all(isinstance(r, Region) for r in fields.values()):
            raise Error("vertex fields must be a dict of field name -> Region (tensor.region(start, stop))")
        for name, value in params.items():
            if not isinstance(value, int | np.integer):
                raise Error(f"vertex parameter {name!r} must be an integer, got {value!r}")
        batch = {name: Regions(r.tensor, np.array([r.start]), np.array([r.stop])) for name, r in fields.items()}
        return self.add_vertices(
            cs, kind, sub, [tile], [n], batch, [cycles], p0, p1, p2, fparam=fparam, program=program, **params
        )

    def add_vertices(
        self, cs, kind, sub, tiles, n, fields, cycles, p0=None, p1=None, p2=None, fparam=0.0, program=None, **params
    ):
        """Add ``len(tiles)`` vertices of one codelet to ``cs`` at once, as ``add_vertex`` adds one: vertex i on
        ``tiles[i]`` over ``n[i]`` elements, its fields range i of each Regions in ``fields``
        (``tensor.regions(starts, stops)``), its parameters entry i of each array (or the one integer) given.
        The batch is checked as strictly as ``add_vertex`` checks a vertex, with array operations; the first
        failing vertex is named in the popsim.Error. Returns the Vertices added."""
        kind = kind_code(kind)
        sub = sub_code(kind, sub)
        if not isinstance(cs, ComputeSet):
            raise Error(f"add_vertices needs a ComputeSet, got {cs!r}")
        tiles = _integers(tiles, None, "vertex tiles")
        count = len(tiles)
        if count and (tiles.min() < 0 or tiles.max() >= self.target.num_tiles):
            bad = tiles[(tiles < 0) | (tiles >= self.target.num_tiles)][0]
            raise Error(f"vertex tile {bad} is not a tile of the target (0..{self.target.num_tiles - 1})")
        if not isinstance(fields, dict) or not all(isinstance(r, Regions) for r in fields.values()):
            raise Error("vertices' fields must be a dict of field name -> Regions (tensor.regions(starts, stops))")
        for column, value in (("p0", p0), ("p1", p1), ("p2", p2)):
            if value is None:
                continue
            names = [name for name, col in oc.VERTEX_PARAMS[kind].items() if col == column]
            if not names:
                raise Error(f"{oc.KIND_NAMES[kind - 1]} vertex: takes no parameter in column {column}")
            params.setdefault(names[0], value)
        params = {name: _integers(v, count, f"vertex parameter {name!r}") for name, v in params.items()}
        blocks = {name: self._field_blocks(cs, name, regions, tiles) for name, regions in fields.items()}
        n = _integers(n, count, "vertex n")
        check_vertices(kind, n, fields, params, fparam, program)
        cycles = _integers(cycles, count, "cycles")
        batch = Vertices(kind, sub, tiles, n, fields, cycles, params, blocks, float(fparam), program)
        if count:
            cs.batches.append(batch)
        return batch

    def _field_blocks(self, cs, name, regions, tiles):
        """The mapping block of each range of field ``name``; a popsim.Error unless every range is non-empty,
        inside its tensor and wholly on the tile of its vertex."""
        t = regions.tensor
        if not (isinstance(t, Tensor) and t.id < len(self.tensors) and self.tensors[t.id] is t):
            self.check_own(t, f"vertex field {name!r}")
        starts = _integers(regions.starts, len(tiles), f"field {name!r} starts")
        stops = _integers(regions.stops, len(tiles), f"field {name!r} stops")
        m = t.mapping
        bad = np.flatnonzero((starts < 0) | (stops > m.size) | (stops <= starts))
        if bad.size:
            raise Error(f"region [{starts[bad[0]]}, {stops[bad[0]]}) is outside {t!r}")
        block = m.block_of(starts)
        bad = np.flatnonzero(stops > m.stops[block])
        if bad.size:
            i = bad[0]
            spanned = sorted(set(m.tiles[block[i] : m.block_of(stops[i] - 1) + 1].tolist()))
            raise Error(f"elements [{starts[i]}, {stops[i]}) of {t!r} span tiles {spanned}")
        bad = np.flatnonzero(m.tiles[block] != tiles)
        if bad.size:
            i = bad[0]
            raise Error(
                f"vertex in compute set {cs.name!r} on tile {tiles[i]}: field {name!r} (elements "
                f"[{starts[i]}, {stops[i]}) of {t!r}) lives on tile {m.tiles[block[i]]}; a vertex "
                "may only touch its own tile's memory"
            )
        return block

    def add_copy(self, name, dst, srcs, index, dst_elements=None):
        """Append an exchange filling ``dst`` (only its ``dst_elements`` when given) from ``srcs`` by a flat
        index map."""
        for t in [dst, *srcs]:
            self.check_own(t, f"copy {name!r}")
        self.program.append(Copy(name, dst, srcs, index, self.origin, dst_elements=dst_elements))

    def check_own(self, tensor, what):
        """Raise a popsim.Error unless ``tensor`` is a Tensor of this DeviceGraph (another graph's tensors have
        no memory in this one's programs); ``what`` names the use."""
        if not isinstance(tensor, Tensor) or tensor.id >= len(self.tensors) or self.tensors[tensor.id] is not tensor:
            raise Error(f"{what}: {tensor!r} is not a tensor of this DeviceGraph")


@dataclass
class Execute:
    """Run ``compute_set`` (a ComputeSet placed in a program runs itself; this is Poplar's spelling)."""

    compute_set: ComputeSet


@dataclass
class Sequence:
    """Run ``steps`` in order."""

    steps: list


@dataclass
class Repeat:
    """Run ``body`` (a step or a list of steps) ``count`` times."""

    count: int
    body: object

    def __post_init__(self):
        if int(self.count) != self.count or self.count < 0:
            raise Error(f"Repeat count must be a non-negative integer, got {self.count!r}")
        self.count = int(self.count)


@dataclass
class If:
    """Run ``then_body`` when the one-element bool or int32 ``condition`` (a Tensor or Region) read on the
    device is non-zero, else ``else_body`` (a step, a list of steps, or None for nothing)."""

    condition: object
    then_body: object
    else_body: object = None

    def __post_init__(self):
        if isinstance(self.condition, Tensor):
            self.condition = self.condition.region(0, self.condition.size)
        c = self.condition
        if not isinstance(c, Region) or c.stop - c.start != 1 or str(c.tensor.dtype) not in ("bool", "int32"):
            raise Error(f"If condition must be one bool or int32 element of a device tensor, got {c!r}")


@dataclass
class Sync:
    """An explicit BSP sync of all tiles: no data moves, it costs the target's sync cycles."""


@dataclass
class StreamCopy:
    """Move one slice between host stream ``stream`` and device tensor ``tensor``, as a program step.

    A host-to-device stream (``to_device=True``) is a FIFO fed by the host before the run: each execution
    reads the next ``tensor.size`` elements into ``tensor``, so a StreamCopy inside a Repeat loads a new
    slice every iteration. A device-to-host stream appends ``tensor`` each time it runs."""

    stream: str
    tensor: Tensor
    to_device: bool = True

    def __post_init__(self):
        if not isinstance(self.tensor, Tensor):
            raise Error(f"StreamCopy {self.stream!r} needs a device Tensor, got {self.tensor!r}")


@dataclass
class HostCall:
    """Call host function ``callback`` (a name registered with ``popir.register_host_callback``) in the
    middle of a program: each tensor of ``inputs`` streams to the host, the engine stops while the host
    runs the callback on them, and its results stream back into ``outputs``. The transfers are the
    StreamCopy steps ``sends`` and ``receives`` (host streams named after ``name``), costed as such and
    credited in the profile to ``origin`` (the popir node lowered to the call, if any)."""

    name: str
    callback: str
    inputs: list
    outputs: list
    origin: object = None

    def __post_init__(self):
        for t in [*self.inputs, *self.outputs]:
            if not isinstance(t, Tensor):
                raise Error(f"HostCall {self.name!r} needs device Tensors, got {t!r}")
        self.sends = [StreamCopy(f"{self.name}.in{i}", t, False) for i, t in enumerate(self.inputs)]
        self.receives = [StreamCopy(f"{self.name}.out{i}", t, True) for i, t in enumerate(self.outputs)]
        for copy in [*self.sends, *self.receives]:
            copy.origin = self.origin


def children(step):
    """The sub-programs of a program step, in program order (none for ComputeSet, Copy, Execute, Sync)."""
    if isinstance(step, list):
        return step
    if isinstance(step, Sequence):
        return step.steps
    if isinstance(step, Repeat):
        return [step.body]
    if isinstance(step, If):
        return [step.then_body] + ([step.else_body] if step.else_body is not None else [])
    if isinstance(step, HostCall):
        return [*step.sends, *step.receives]
    if isinstance(step, ComputeSet | Copy | Execute | Sync | StreamCopy):
        return []
    raise Error(f"not a program step: {step!r}")


def leaves(program):
    """The ComputeSet, Copy and StreamCopy steps of ``program`` in program order (each If branch, each loop
    body once)."""
    if isinstance(program, Execute):
        yield program.compute_set
    elif isinstance(program, (ComputeSet, Copy, StreamCopy)):
        yield program
    else:
        for child in children(program):
            yield from leaves(child)


def _integers(values, count, what):
    """``values`` as a 1-D int64 array (of ``count`` entries, a single integer repeated, unless count is None);
    a popsim.Error for anything but integers."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or (array.ndim != 1 if count is None else array.ndim > 1):
        raise Error(f"{what} must be integers (one per vertex), got {values!r}")
    if count is not None and array.shape not in ((), (count,)):
        raise Error(f"{what}: {array.size} values for {count} vertices")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise Error(f"{what}: values beyond int64")
    return np.broadcast_to(array.astype(np.int64), (len(array) if count is None else count,))
