"""compile(): lower popir graphs onto one IPU, allocate tile memory, flatten programs; Executable runs them."""

import os

import numpy as np

import popir
from popsim import _exchange, _executable_format, _kernels, cost, provenance, remote
from popsim import _opcodes as oc
from popsim._arena import TileArena
from popsim.allocate import TileAllocator
from popsim.device_graph import ComputeSet, Copy, DeviceGraph, Execute, If, Repeat, StreamCopy, children, leaves
from popsim.errors import EngineFault, Error, HostCallbackError, IndexRangeError, OutOfMemoryError, UnsupportedOpError
from popsim.loaded_copies import place_on_readers
from popsim.lowerings import LOWERINGS, lower_graph
from popsim.mapping import TileMapping
from popsim.placement import Placement
from popsim.planner import Lowerer
from popsim.profile import Profile
from popsim.program import flatten_program, host_blocks
from popsim.streaming_overlap import overlapped_lifetimes
from popsim.target import Device, Target
from popsim.validate import check_program

# Exchange rows hold 32-bit byte offsets into the arena (see _types.pxd), so the arena must fit below 2 GiB.
MAX_ARENA_BYTES = 2**31 - 1


def supported_ops():
    """popir op names that popsim can lower onto tiles (every name is a popir op: see register_lowering)."""
    return set(LOWERINGS)


def _check_supported(graphs):
    missing = {}
    for name, g in graphs.items():
        for node in g.nodes:
            if node.op not in LOWERINGS:
                missing.setdefault(node.op, []).append(f"{name}: {node.source or node.describe()}")
    if missing:
        lines = [f"  {op}: used at {', '.join(where[:3])}" for op, where in sorted(missing.items())]
        raise UnsupportedOpError(
            f"popsim has no kernel for {len(missing)} op(s):\n" + "\n".join(lines), sorted(missing)
        )


def _check_fits(graphs, target, relax_memory, remote=()):
    """Refuse, from sizes alone and before any planning, a program set whose variables plus one program's
    streamed inputs exceed the tile memory of ``target`` (with ``relax_memory``, what the simulator can
    address); variables named in ``remote`` live in streaming memory and do not count. Both are always resident
    at once; intermediates are not counted (fusion and aliasing may keep
    them off the tiles), so this is a lower bound and the allocator still has the last word."""
    variables = {
        v.name: v.type.nbytes for g in graphs.values() for v in g.inputs if v.kind != "input" and v.name not in remote
    }
    fixed = sum(variables.values())
    streamed = max(sum(v.type.nbytes for v in g.inputs if v.kind == "input") for g in graphs.values())
    capacity = MAX_ARENA_BYTES if relax_memory else target.num_tiles * target.tile_bytes
    if fixed + streamed <= capacity:
        return
    top = sorted(variables.items(), key=lambda kv: -kv[1])[:3]
    biggest = "".join(f", {name} {size:,}" for name, size in top)
    where = (
        f"the {MAX_ARENA_BYTES:,} bytes the simulator addresses"
        if relax_memory
        else f"the {capacity:,} bytes of {target.name}'s {target.num_tiles:,} tiles x {target.tile_bytes:,} bytes"
    )
    raise OutOfMemoryError(
        f"the program set needs at least {fixed + streamed:,} bytes of tile memory ({streamed:,} bytes of inputs "
        f"and {fixed:,} bytes of variables{biggest}), more than {where}. Use smaller inputs or fewer parameters, "
        "or a Device of more IPUs."
    )


def compile(  # noqa: A001
    graphs,
    target="ipu2",
    *,
    relax_memory=False,
    partials_type="float32",
    optimize=True,
    available_memory=None,
    remote=(),
    spill=None,
    shards=None,
    conv_dithering=False,
    remote_loads="phase",
    overlap_streaming=False,
):
    """Compile ``graphs`` (a popir.Graph or {program name: Graph}) for ``target``; returns an Executable.

    ``available_memory`` ({IPU index: proportion from 0 to 1}) bounds the temporary tile memory of each IPU's
    matmul and convolution plans (Poplar's availableMemoryProportion; a node's own ``available_memory``
    annotation takes precedence). A lower proportion gives plans needing less memory and usually more cycles.
    ``conv_dithering`` (Poplar's enableConvDithering) starts each convolution's tiles, forward and gradients
    alike, at a column and in a direction hashed from its shape, so that convolutions of different shapes
    spread over different tiles instead of starting where their task counts put them.

    Inputs of kind parameter/buffer/optimizer_state are device variables shared by name between programs.
    Those named in ``remote`` live in streaming memory, off the tiles: their readers get a tile buffer loaded
    just before them, and each update is stored back (see ``popsim.remote``). ``spill`` ("backward" or
    "phase", or a ``remote.Spill`` that also sets a minimum size) likewise moves activations to streaming
    memory between passes or phases (``remote.Spiller``).
    ``remote_loads`` "phase" loads a remote variable once per phase for all its readers there ("shared_phase":
    the last forward phase and the first backward one are one phase), "reader" afresh for each reader (less
    tile memory, more transfers; ``remote.Loads``).
    ``overlap_streaming`` places the tile memory of phased programs whose streaming-memory loads run during
    the phase before and stores during the phase after (``schedule.place_phases`` with ``overlap``): those
    tile buffers and stored tensors live that much longer (``streaming_overlap.overlapped_lifetimes``).
    ``shards`` ({remote variable name: replicas}) shards those over replicas (replicated tensor sharding):
    a replica holds and moves 1/replicas of each, which divides its streaming-memory bytes and transfer
    cycles (the simulated program still loads and updates the whole tensor on its tiles).
    Each graph first goes through ``popir.passes.optimize`` (constant folding, CSE, dead-code elimination:
    an unused gradient costs nothing); ``optimize=False`` compiles the graphs as given.
    """
    if isinstance(graphs, popir.Graph):
        graphs = {graphs.name: graphs}
    if not graphs:
        raise Error("compile needs at least one graph")
    if optimize:
        graphs = {name: popir.passes.optimize(g) for name, g in graphs.items()}
    target = target.graph_target if isinstance(target, Device) else Target.named(target)
    if str(partials_type) not in ("float32", "float16"):
        raise Error(f"partials_type must be 'float32' or 'float16', got {partials_type!r}")
    _check_available_memory(available_memory, target.num_ipus)
    _check_supported(graphs)
    remote = _check_remote(graphs, remote)
    shards = _check_shards(shards, remote)
    _check_fits(graphs, target, relax_memory, remote)
    placement = Placement(graphs, target.num_ipus)
    dg = DeviceGraph(target)
    variables = {}
    for g in graphs.values():
        g.verify()
        for v in g.inputs:
            if v.kind == "input":
                continue
            if (
                v.name in variables
                and variables[v.name].dtype != v.dtype
                or (v.name in variables and variables[v.name].shape != v.shape)
            ):
                known = variables[v.name]
                raise Error(
                    f"variable {v.name!r} is {known.dtype}{list(known.shape)} in one program and {v.type} in another"
                )
            if v.name not in variables:
                # A variable lives on the IPU of its first reader (IPU 0 of an unannotated graph).
                where = target.ipu_view(placement.variable_ipu.get(v.name, 0))
                mapping = TileMapping.linear(v.type.size, v.dtype.itemsize, where)
                variables[v.name] = dg.add_tensor(v.shape, v.dtype, mapping, v.name, "variable")
                dg.state_kinds[v.name] = v.kind
                if v.name in remote:
                    dg.remote.add(variables[v.name])
                if v.name in shards:
                    dg.remote_shards[variables[v.name]] = shards[v.name]
    updated = {state.name for g in graphs.values() for state in g.updates}
    dg.host_written = {t for name, t in variables.items() if name not in updated and t not in dg.remote}
    lowered = {}
    for name, g in graphs.items():
        dg.program = []
        lw = Lowerer(dg, popir.as_dtype(partials_type), available_memory, conv_dithering)
        inputs, outputs = lower_graph(lw, g, variables, placement, name, spill, remote_loads)
        lowered[name] = (dg.program, inputs, outputs)
    place_on_readers(dg, [program for program, _, _ in lowered.values()])
    return Executable(target, dg, variables, lowered, relax_memory, overlap_streaming)


def _check_shards(shards, remote):
    """``shards`` as {variable name: replicas}, each a remote variable sharded over at least one replica."""
    shards = dict(shards or {})
    for name, replicas in shards.items():
        if name not in remote:
            raise Error(f"shards: {name!r} is not a remote variable (only streaming-memory variables are sharded)")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise Error(f"shards: {name!r} must be sharded over a positive whole number of replicas, got {replicas!r}")
    return shards


def _check_remote(graphs, remote):
    """``remote`` as a set of variable names, each a variable (not a streamed input) of ``graphs``."""
    remote = set(remote)
    variables = {v.name for g in graphs.values() for v in g.inputs if v.kind != "input"}
    unknown = sorted(remote - variables)
    if unknown:
        raise Error(f"remote: {', '.join(map(repr, unknown))} name(s) no variable of these programs")
    return remote


def _check_available_memory(available_memory, num_ipus):
    for ipu, proportion in (available_memory or {}).items():
        if isinstance(ipu, bool) or not isinstance(ipu, int) or not 0 <= ipu < num_ipus:
            raise Error(f"available_memory: IPU {ipu!r} is not an IPU of this {num_ipus}-IPU target")
        _check_proportion(proportion, f"available_memory of IPU {ipu}")


def _check_proportion(proportion, what):
    """Raise unless ``proportion`` is a number from 0 to 1 (an available-memory proportion)."""
    if isinstance(proportion, bool) or not isinstance(proportion, (int, float)) or not 0 <= proportion <= 1:
        raise Error(f"{what} must be a proportion of tile memory from 0 to 1, got {proportion!r}")


def compile_device_graph(dg, inputs=None, outputs=None, name="main", *, relax_memory=False):
    """Compile a hand-built ``dg.program`` (a step or a list of Poplar program steps) as program ``name``.

    ``inputs`` and ``outputs`` map host names to device tensors, streamed in before and out after each run.
    Tensors of category ``"variable"`` are variables by name; ``"constant"`` tensors hold their ``value``.
    """
    inputs, outputs = dict(inputs or {}), dict(outputs or {})
    for role, tensors in (("input", inputs), ("output", outputs)):
        for host_name, t in tensors.items():
            dg.check_own(t, f"{role} {host_name!r}")
    for step in leaves(dg.program):
        for storage in _storages_of(step):
            dg.check_own(storage, f"program step {getattr(step, 'name', step)!r}")
    variables = {t.name: t for t in dg.tensors if t.storage is t and t.category == "variable"}
    lowered = {name: (dg.program, inputs, outputs)}
    return Executable(dg.target, dg, variables, lowered, relax_memory)


def default_threads():
    """Host threads the engine uses: ``POPSIM_NUM_THREADS`` if set, else every core of this machine (at most
    ``_kernels.MAX_THREADS``)."""
    value = os.environ.get("POPSIM_NUM_THREADS")
    if value is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(cores, _kernels.MAX_THREADS))
    if not value.isdigit() or not 1 <= int(value) <= _kernels.MAX_THREADS:
        raise Error(f"POPSIM_NUM_THREADS must be an integer from 1 to {_kernels.MAX_THREADS}, got {value!r}")
    return int(value)


class Executable:
    """A compiled set of programs on one simulated IPU or several (a Device); variables stay in tile memory
    between runs.

    ``num_threads`` host threads share the independent rows of each BSP phase (see ``default_threads``).
    ``host_callbacks`` (callback name -> function) gives this executable's own host-call functions; a name
    not in it runs the function registered with ``popir.ops.register_host_callback``.
    ``to_bytes`` / ``from_bytes`` store it with its programs, tile plans and variable values, so a cache can
    skip compiling.
    """

    def __init__(self, target, dg, variables, lowered, relax_memory, overlap_streaming=False):
        self.target = target
        self.num_threads = default_threads()
        self.host_callbacks = {}
        self._vars = variables
        self.variables = {n: popir.TensorType(t.shape, t.dtype) for n, t in variables.items()}
        overhead = _vertex_memory(target, [program for program, _, _ in lowered.values()])
        budget = {
            t: target.tile_bytes - overhead["vertex_state"][t] - overhead["code"][t] for t in range(target.num_tiles)
        }
        base = TileAllocator(list(budget.values()))
        pinned = [
            t for t in dg.tensors if t.storage is t and t.category in ("variable", "constant") and t not in dg.remote
        ]
        alloc = {}
        for t in pinned:
            alloc[t.id] = base.place(t, *t.mapping.tile_bytes(t.itemsize), -1, np.inf)
        per_program, placed = {}, {}
        for name, (program, inputs, outputs) in lowered.items():
            allocator = base.copy()
            placed[name] = _liveness(program, inputs, outputs)
            if overlap_streaming:
                placed[name] = overlapped_lifetimes(placed[name], provenance.program_points(program), dg.remote)
            blocks = [(s, *s.mapping.tile_bytes(s.itemsize), first, last) for s, first, last in placed[name]]
            for (storage, *_), offsets in zip(blocks, allocator.place_all(blocks)):
                alloc[storage.id] = offsets
            allocator.check(relax_memory, target)
            per_program[name] = allocator
        base.check(relax_memory, target)
        # Each tile's slice of the arena holds only what that program set uses (capacity was checked above):
        # the tiles' data lie densely, so a step touches few host pages.
        peak = max(int(a.peak.max(initial=0)) for a in [base, *per_program.values()])
        tile_size = max(64, -(-peak // 64) * 64)
        # Streaming memory sits beyond the last tile, in whole tile-sized slices of the arena.
        remote_at, remote_bytes = remote.region_bytes(sorted(dg.remote, key=lambda t: t.id))
        arena_tiles = target.num_tiles + -(-remote_bytes // tile_size)
        remote_start = target.num_tiles * tile_size
        if arena_tiles * tile_size > MAX_ARENA_BYTES:
            raise Error(
                f"the simulator addresses at most {MAX_ARENA_BYTES:,} bytes of tile memory, and this program set "
                f"needs {peak:,} bytes on its busiest tile over {target.num_tiles:,} tiles "
                f"({target.num_tiles * tile_size:,} bytes) and {remote_bytes:,} bytes of streaming memory; use fewer "
                "IPUs or less memory per tile"
            )
        self.arena = TileArena(arena_tiles, tile_size)
        self._block_base = {}

        def block_base(storage):
            if storage.id not in self._block_base and storage in remote_at:
                self._block_base[storage.id] = remote.block_base(storage, remote_start + remote_at[storage])
            if storage.id not in self._block_base:
                m = storage.mapping
                tile_off = alloc[storage.id][m.tiles]
                self._block_base[storage.id] = m.tiles * tile_size + tile_off + m.offsets_in_tile() * storage.itemsize
            return self._block_base[storage.id]

        self._streams = _host_streams(lowered)
        slots = {name: slot for slot, name in enumerate(self._streams)}
        self._programs = {}
        self.profile = Profile(target)
        for name, (program, inputs, outputs) in lowered.items():
            flat = flatten_program(target, program, block_base, slots)
            flat.stream_uses = _stream_executions(program)
            feeds = {n: host_blocks(t, block_base) for n, t in inputs.items()}
            outs = {n: host_blocks(t, block_base) for n, t in outputs.items()}
            host_bytes = sum(t.size * t.itemsize for t in list(inputs.values()) + list(outputs.values()))
            host = cost.host_cycles(target, host_bytes)
            memory = {
                "tensors": per_program[name].peak.tolist(),
                "vertex_state": overhead["vertex_state"],
                "code": overhead["code"],
            }
            self.profile.add_program(
                name,
                flat.steps,
                flat.totals,
                host + flat.totals["host"],
                memory,
                flat.tile_compute,
                flat.tile_exchange,
                flat.flops,
                budget,
                relax_memory,
                *provenance.memory_map(dg, [(t, -1, None) for t in pinned] + placed[name], program, target.num_tiles),
            )
            # Bytes of the program set's variables and activations in streaming memory (popsim.remote).
            # One replica's bytes: a storage sharded over replicas counts its shard only.
            self.profile.programs[name]["streaming_memory_bytes"] = remote.replica_bytes(dg.remote, dg.remote_shards)
            self._programs[name] = (flat, feeds, outs, dict(inputs), outputs)
        self._var_blocks = {n: host_blocks(t, block_base) for n, t in variables.items()}
        self._var_copies = {
            var.name: _copy_blocks(list(copies.values()), block_base) for var, copies in dg.loaded_copies.items()
        }
        self._constants = [(t, host_blocks(t, block_base)) for t in pinned if t.category == "constant"]
        self._write_constants()
        self.last_run_cycles = 0
        self.last_write_cycles = 0  # of the latest write_variable (see write_cycles)

    def _write_constants(self):
        for t, blocks in self._constants:
            self._write(t, blocks, t.value)

    def to_bytes(self):
        """The executable as bytes: its programs, tile plans, profile and current variable values, checksummed.

        The format holds only JSON and NumPy arrays (see _executable_format), so reading it cannot run code."""
        return _executable_format.to_bytes(self)

    @classmethod
    def from_bytes(cls, data):
        """An Executable from ``to_bytes`` output; a popsim.Error when ``data`` is damaged or not one."""
        return _executable_format.from_bytes(cls, data, default_threads(), MAX_ARENA_BYTES)

    def __reduce__(self):
        raise TypeError("a popsim Executable does not pickle; use Executable.to_bytes() and Executable.from_bytes()")

    def validate(self):
        """Raise a popsim.Error unless every compiled program stays inside this executable's tile memory (see
        ``validate.check_program``); for an executable that did not come from ``compile`` in this process."""
        for name, (flat, *_) in self._programs.items():
            try:
                check_program(flat, self.arena.num_tiles, self.arena.tile_bytes, len(self._streams))
            except Error as exc:
                raise Error(f"program {name!r}: {exc}") from None

    @property
    def programs(self):
        """Names of the compiled programs."""
        return list(self._programs)

    def _write(self, tensor, blocks, array):
        host = np.asarray(array, dtype=tensor.dtype.numpy, order="C").reshape(tensor.shape)  # copied just below
        _exchange.host_write(self.arena, host.reshape(-1).view(np.uint8), *blocks)

    def _read(self, tensor, blocks):
        out = np.empty(tensor.shape, tensor.dtype.numpy)
        _exchange.host_read(self.arena, out.reshape(-1).view(np.uint8), *blocks)
        return out

    def run(self, feeds=None, program=None):
        """Run one program: stream ``feeds`` in, execute, stream outputs out, apply state updates.

        A host-to-device stream of the program is fed like an input, with its slices stacked on a leading
        axis; each device-to-host stream comes back the same way, one slice per StreamCopy that ran."""
        if program is None:
            if len(self._programs) != 1:
                raise Error(f"several programs are compiled ({', '.join(self._programs)}); name one")
            program = next(iter(self._programs))
        if program not in self._programs:
            raise Error(f"no program {program!r}; compiled programs: {', '.join(self._programs)}")
        flat, feed_blocks, out_blocks, inputs, outputs = self._programs[program]
        if not isinstance(self.num_threads, int) or not 1 <= self.num_threads <= _kernels.MAX_THREADS:
            raise Error(f"num_threads must be an integer from 1 to {_kernels.MAX_THREADS}, got {self.num_threads!r}")
        feeds = dict(feeds or {})
        called = _host_call_streams(flat)
        fed_calls = sorted(called & set(feeds))
        if fed_calls:
            raise Error(f"program {program!r} feeds: {fed_calls} are host-call streams (the run feeds them)")
        feeds.update(self._host_call_feeds(flat, called))
        stream_feeds = {n for n in flat.stream_uses if self._streams[n].to_device} - called
        unknown = set(feeds) - set(inputs) - stream_feeds - called
        missing = (set(inputs) | stream_feeds) - set(feeds)
        if unknown or missing:
            raise Error(f"program {program!r} feeds: missing {sorted(missing)}, unknown {sorted(unknown)}")
        for name, tensor in inputs.items():
            array = _numeric(feeds[name], f"feed {name!r}")
            if array.shape != tensor.shape:
                raise Error(f"feed {name!r}: expected shape {tensor.shape}, got {array.shape}")
            self._write(tensor, feed_blocks[name], array)
        table, host = self._stream_buffers(flat.stream_uses, feeds)
        bad, cycles, dry, trap = self._run_phases(flat, table, host)
        # The phases actually run: a Repeat counts every iteration, an If only the branch taken.
        self.last_run_cycles = cycles + self.profile.programs[program]["host_cycles"] - flat.totals["host"]
        if trap >= 0:
            kind, sub = flat.instructions[trap, :2]
            raise EngineFault(
                f"program {program!r}: the engine trapped instruction row {trap} (kind {kind}, sub-op {sub}), which no "
                "codelet implements; the results of this run are invalid"
            )
        if dry >= 0:
            name = list(self._streams)[dry]
            raise Error(
                f"program {program!r}: host stream {name!r} ran dry after {table[dry, 3] // table[dry, 4]} "
                "slice(s); feed one slice for every StreamCopy the program runs"
            )
        if bad:
            raise IndexRangeError(
                f"program {program!r}: {bad} gather/scatter index(es) out of range (an input index or class label "
                "beyond its dimension); the results of this run are invalid",
                count=bad,
            )
        results = {name: self._read(t, out_blocks[name]) for name, t in outputs.items()}
        for slot, (name, stream) in enumerate(self._streams.items()):
            if name in flat.stream_uses and not stream.to_device and name not in called:
                start, done = table[slot, 1], table[slot, 3]
                t = stream.tensor
                results[name] = host[start : start + done].view(t.dtype.numpy).reshape((-1, *t.shape)).copy()
        return results

    def _run_phases(self, flat, table, host):
        """Run the engine over ``flat``'s phases; at each host call it pauses, the host runs the callback on
        the slices just streamed out and puts its results where the next stream-ins read, and the engine
        resumes. Returns (bad indices, cycles, dry stream, trapped row) as ``_kernels.run_program``."""
        counters = np.zeros(flat.num_counters, np.int64)
        start, bad, cycles = 0, 0, 0
        while True:
            run = _kernels.run_program(
                self.arena,
                flat.phases,
                flat.phase_cycles,
                flat.instructions,
                flat.fparams,
                flat.copies,
                counters,
                flat.stream_rows,
                table,
                host,
                self.num_threads,
                start,
                flat.runs,
            )
            bad, cycles = bad + run[0], cycles + run[1]
            dry, trap, start = run[2:]
            if start < 0 or dry >= 0 or trap >= 0:
                return bad, cycles, dry, trap
            self._host_call(flat.host_calls[flat.phases[start - 1, oc.PHASE_COL["a"]]], table, host)

    def _host_call(self, call, table, host):
        """Run one host call between engine phases: its inputs are each send stream's last slice, its results
        go into each receive stream's next slice."""
        slots = {name: slot for slot, name in enumerate(self._streams)}

        def slice_of(name, ahead):
            slot, t = slots[name], self._streams[name].tensor
            at = table[slot, 1] + table[slot, 3] - (0 if ahead else table[slot, 4])
            return host[at : at + table[slot, 4]].view(t.dtype.numpy).reshape(t.shape), t

        arrays = [slice_of(name, ahead=False)[0].copy() for name in call["sends"]]
        receives = [slice_of(name, ahead=True) for name in call["receives"]]
        out_types = [(t.shape, str(t.dtype)) for _, t in receives]
        try:
            own = getattr(self, "host_callbacks", {}).get(call["callback"])
            results = popir.ops.run_host_callback(call["callback"], arrays, out_types, own)
        except popir.IRError as exc:
            raise Error(str(exc)) from None
        except Exception as exc:
            raise HostCallbackError(f"host callback {call['callback']!r} raised {type(exc).__name__}: {exc}") from exc
        for (buffer, _), result in zip(receives, results):
            buffer[...] = result

    def _host_call_feeds(self, flat, called):
        """Zero slices for the streams that carry host-call results (the callbacks fill them during the run)."""
        return {
            n: np.zeros((flat.stream_uses[n], *self._streams[n].tensor.shape), self._streams[n].tensor.dtype.numpy)
            for n in called
            if self._streams[n].to_device and n in flat.stream_uses
        }

    def _stream_buffers(self, uses, feeds):
        """The engine's stream table (to_device, host offset, capacity, cursor, slice bytes) and one host
        buffer holding every stream of a run: fed slices in, room for the most slices a stream can send out."""
        table = np.zeros((max(len(self._streams), 1), 5), np.int64)
        parts, at = [], 0
        for slot, (name, stream) in enumerate(self._streams.items()):
            if name not in uses:
                continue
            t = stream.tensor
            slice_bytes = t.size * t.itemsize
            if stream.to_device:
                array = np.asarray(feeds[name])
                if array.shape[1:] != t.shape or array.ndim == len(t.shape):
                    raise Error(
                        f"stream {name!r}: expected slices of shape {t.shape} stacked on a leading axis, "
                        f"got {array.shape}"
                    )
                data = np.ascontiguousarray(array, t.dtype.numpy).reshape(-1).view(np.uint8)
            else:
                data = np.zeros(uses[name] * slice_bytes, np.uint8)
            table[slot] = (stream.to_device, at, data.size, 0, slice_bytes)
            parts.append(data)
            at += data.size
        host = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
        return table, host

    def read_variable(self, name):
        """A host copy of variable ``name``, gathered from its tiles."""
        if name not in self._vars:
            raise Error(f"no variable {name!r}; variables: {', '.join(self._vars)}")
        return self._read(self._vars[name], self._var_blocks[name])

    def write_variable(self, name, array):
        """Overwrite variable ``name`` on its tiles with ``array`` (shape must match)."""
        if name not in self._vars:
            raise Error(f"no variable {name!r}; variables: {', '.join(self._vars)}")
        t = self._vars[name]
        array = _numeric(array, f"variable {name!r}")
        if array.shape != t.shape:
            raise Error(f"variable {name!r} has shape {t.shape}, got {array.shape}")
        self._write(t, self._var_blocks[name], array)
        if name in self._var_copies:  # its copies on the tiles that read it (see Lowerer._scalar_loaded)
            self._write(t, self._var_copies[name], array)
        self.last_write_cycles = self.write_cycles(name)

    def write_cycles(self, name):
        """Cycles of one host write of variable ``name`` (``write_variable``, as PopTorch's setOptimizer writes
        a hyper-parameter): a host-to-device transfer of its bytes and of one element to each tile holding a
        copy of it (a host-written scalar's copies sit on the tiles that read it, see ``loaded_copies``)."""
        if name not in self._vars:
            raise Error(f"no variable {name!r}; variables: {', '.join(self._vars)}")
        t = self._vars[name]
        copies = int(self._var_copies[name][2].sum()) if name in self._var_copies else 0
        return cost.host_cycles(self.target, t.size * t.itemsize + copies)


def _copy_blocks(copies, block_base):
    """Host blocks writing a scalar variable's value into every element of its ``copies``: each block reads
    the host's one element."""
    host, arena, nbytes = (np.concatenate(part) for part in zip(*(host_blocks(c, block_base) for c in copies)))
    return np.zeros_like(host), arena, nbytes


def _numeric(value, what):
    """``value`` as a NumPy array of numbers or bools; anything else (strings, objects, None) is an Error."""
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise Error(f"{what}: expected an array of numbers, got {type(value).__name__} of dtype {array.dtype}")
    return array


def _host_streams(lowered):
    """name -> the StreamCopy that defines each host stream of the programs; one direction and one slice
    type per name, distinct from every input and output name."""
    streams = {}
    for name, (program, inputs, outputs) in lowered.items():
        for step in leaves(program):
            if not isinstance(step, StreamCopy):
                continue
            first = streams.setdefault(step.stream, step)
            t, f = step.tensor, first.tensor
            if (first.to_device, f.shape, f.dtype) != (step.to_device, t.shape, t.dtype):
                raise Error(f"host stream {step.stream!r} is used as {_stream_kind(first)} and as {_stream_kind(step)}")
            if step.stream in inputs or step.stream in outputs:
                raise Error(f"program {name!r}: {step.stream!r} names both a host stream and an input or output")
    return streams


def _stream_kind(step):
    direction = "host-to-device" if step.to_device else "device-to-host"
    return f"{direction} {step.tensor.dtype}{list(step.tensor.shape)}"


def _host_call_streams(flat):
    """The host streams of ``flat``'s host calls: the executable feeds and reads them itself."""
    return {name for call in getattr(flat, "host_calls", ()) for name in (*call["sends"], *call["receives"])}


def _stream_executions(step):
    """name -> the most times each host stream's StreamCopy steps can run in one execution of ``step``."""
    if isinstance(step, StreamCopy):
        return {step.stream: 1}
    parts = [_stream_executions(child) for child in children(step)]
    if isinstance(step, If):
        merged = {}
        for part in parts:
            for name, count in part.items():
                merged[name] = max(merged.get(name, 0), count)
        return merged
    total = {}
    for part in parts:
        for name, count in part.items():
            total[name] = total.get(name, 0) + count
    if isinstance(step, Repeat):
        total = {name: count * step.count for name, count in total.items()}
    return total


def _storages_of(step):
    if isinstance(step, StreamCopy):
        return {step.tensor.storage}
    if isinstance(step, ComputeSet):
        return {r.tensor.storage for batch in step.batches for r in batch.fields.values()}
    return {step.dst.storage} | {s.storage for s in step.srcs}


def _liveness(program, inputs, outputs):
    """(storage, first step, last step) of each temporary storage, in placement order. Steps are numbered in
    program order (an If's condition test counts as a step). A storage touched inside a Repeat or If body is
    live across the whole body: a loop reads in its next iteration what it wrote late in this one."""
    first, last = {}, {}
    count = 0

    def use(storages):
        nonlocal count
        for s in storages:
            first.setdefault(s, count)
            last[s] = count
        count += 1
        return set(storages)

    def walk(step):
        if isinstance(step, ComputeSet | Copy | StreamCopy):
            return use(_storages_of(step))
        if isinstance(step, Execute):
            return use(_storages_of(step.compute_set))
        start = count
        touched = use({step.condition.tensor.storage}) if isinstance(step, If) else set()
        for child in children(step):
            touched |= walk(child)
        if isinstance(step, Repeat | If):
            for s in touched:
                first[s] = min(first[s], start)
                last[s] = max(last[s], count - 1)
        return touched

    walk(program)
    for t in inputs.values():
        first[t.storage] = -1
        last.setdefault(t.storage, -1)
    for t in outputs.values():
        first.setdefault(t.storage, count)
        last[t.storage] = count
    order = sorted(first, key=lambda s: (first[s], s.id))
    return [(s, first[s], last[s]) for s in order if s.category not in ("variable", "constant")]


def _vertex_memory(target, programs):
    """Per tile: bytes of vertex state (all vertices stay resident) and of codelet code."""
    state = np.zeros(target.num_tiles, np.int64)
    codelets, tiles = {}, []  # codelet key -> its number; (tiles, codelet number) of each batch
    # A compute set executed at several places in a program is resident once.
    sets = {id(cs): cs for program in programs for cs in leaves(program) if isinstance(cs, ComputeSet)}
    for cs in sets.values():
        for batch in cs.batches:
            state += np.bincount(batch.tiles, minlength=target.num_tiles) * (8 + 4 * len(batch.fields))
            # Each distinct fused expression is a codelet of its own, as popops generates one per map expression.
            key = (batch.kind, batch.sub) if batch.program is None else batch.program.tobytes()
            tiles.append(codelets.setdefault(key, len(codelets)) * target.num_tiles + batch.tiles)
    pairs = np.unique(np.concatenate(tiles)) if tiles else np.zeros(0, np.int64)
    code = np.bincount(pairs % target.num_tiles, minlength=target.num_tiles) * target.code_bytes_per_codelet
    return {"vertex_state": state.tolist(), "code": code.tolist()}
