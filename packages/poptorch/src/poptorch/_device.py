"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import dataclasses
import math

import numpy as np

import popir
import popsim
from poptorch import _blocks, _overlapped_io, _streaming
from poptorch.errors import Error

_OVERLAP_HINT = (
    " With Liveness.OffChipAfterFwd each phase's streaming-memory loads run during the phase before (and its "
    "stores during the phase after), so the tiles hold both phases' tensors at once: "
    "Liveness.OffChipAfterFwdNoOverlap does not overlap them and needs less tile memory."
)


def target_of(options):
    """The simulated IPU ``options`` choose; tiles reserved by TensorLocations.numIOTiles hold no computation."""
    target = popsim.Target.named(options.ipu_version)
    io_tiles = options.TensorLocations.num_io_tiles
    if io_tiles:
        target = dataclasses.replace(target, num_tiles=target.num_tiles - io_tiles)
    return target


def compile_programs(graphs, options, num_ipus=1):
    """Compile ``{program: popir.Graph}`` for a device of ``num_ipus`` of the simulated IPUs chosen by
    ``options``; returns the executable. A variable in streaming memory is loaded once per phase for all its
    readers there, or, when the program does not fit that way, afresh for each reader. With
    ``Liveness.OffChipAfterFwd`` a phase's streaming-memory loads run during the phase before and its stores
    during the phase after, so the allocator holds those tensors on the tiles that much longer."""
    available_memory = options.available_memory_proportion
    beyond = sorted(ipu for ipu in available_memory if ipu >= num_ipus)
    if beyond:
        raise Error(
            f"setAvailableMemoryProportion names IPU{beyond[0]}, but the model runs on {num_ipus} IPU(s) "
            f"(IPU0 to IPU{num_ipus - 1}): remove that key or place a block on that IPU"
        )
    remote = _streaming.remote_variables(graphs, options)
    overlap = _blocks.overlaps_streaming(options.execution_strategy)

    def attempt(remote_loads):
        return popsim.compile(
            graphs,
            target=popsim.Device(target_of(options), num_ipus),
            partials_type=options.Precision.partials_type,
            conv_dithering=options.Training.convolution_dithering,
            relax_memory=options.allow_out_of_memory,
            available_memory=available_memory,
            remote=remote,
            spill=_streaming.activation_spill(options),
            optimize=False,  # the executor optimised the programs before keying its cache on them
            remote_loads=remote_loads,
            overlap_streaming=overlap,
        )

    try:
        try:
            return attempt("shared_phase" if _blocks.shares_last_phase(options.execution_strategy) else "phase")
        except popsim.OutOfMemoryError:
            if not remote:
                raise
            # A streamed variable held for all its readers in a phase does not fit: load it for each reader.
            return attempt("reader")
    except popsim.OutOfMemoryError as exc:
        raise Error(
            f"Out of memory on the simulated IPU: {exc}{_OVERLAP_HINT if overlap else ''} From poptorch, compile "
            """anyway with opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})."""
        ) from exc


def check_pipeline_memory(exe, program, plan, options, training):
    """Refuse a pipelined training program whose tiles cannot also hold the activations of the micro-batches
    a pipeline keeps in flight (``popsim.schedule.stash_per_tile``), unless out-of-memory is allowed."""
    if not (plan.pipelined and training) or options.allow_out_of_memory:
        return
    profile = exe.profile.programs[program]
    target = exe.target
    schedule = popsim.step_schedule(profile, target, 1, True)
    stash = popsim.stash_per_tile(profile, target, schedule.stage_ipu)
    used = sum(np.asarray(profile["memory"][k], np.int64) for k in ("tensors", "vertex_state", "code"))
    over = np.flatnonzero(used + stash > target.tile_bytes)
    if over.size:
        tile = int(over[np.argmax((used + stash)[over])])
        in_flight = 2 * len(schedule.stage_ipu) - 1
        raise Error(
            f"Out of memory on the simulated IPU: a pipeline of {len(schedule.stage_ipu)} stages keeps up to "
            f"{in_flight} micro-batches in flight, and stashing their activations takes {int(stash[tile]):,} more "
            f"bytes on {target.describe_tile(tile)}, which would need {int(used[tile] + stash[tile]):,} of its "
            f"{target.tile_bytes:,} bytes ({over.size} tile(s) over). Recompute the activations from each stage's "
            """inputs (opts._Popart.set("autoRecomputation", 3)), use more IPUs, or ShardedExecution."""
        )


def io_tile_memory(graph, marks, options):
    """The I/O tiles' memory for the tensors of ``graph`` marked for overlapped I/O (``marks``: ``{name:
    (direction, mode)}``): each marked input or output is held once on the ``TensorLocations.numIOTiles`` I/O
    tiles of the first IPU, its elements spread evenly over them, while it streams to or from the host.
    Refuses, unless out-of-memory is allowed, bytes beyond an I/O tile's memory. Returns the profile's
    ``io_tiles`` entry (None without marks)."""
    if not marks:
        return None
    count, tile_bytes = options.TensorLocations.num_io_tiles, target_of(options).tile_bytes
    tensors, used = [], np.zeros(count, np.int64)
    for name, (direction, _) in marks.items():
        value_type = (graph.input(name) if direction == _overlapped_io.INPUT else graph.outputs[name]).type
        elements = np.full(count, value_type.size // count, np.int64)
        elements[: value_type.size % count] += 1
        per_tile = elements * value_type.dtype.itemsize
        used += per_tile
        tensors.append(
            {"name": name, "direction": direction, "bytes": value_type.nbytes, "tile_bytes": per_tile.tolist()}
        )
    if used.max() > tile_bytes and not options.allow_out_of_memory:
        total, most = sum(t["bytes"] for t in tensors), options.TensorLocations.MAX_IO_TILES
        needed = next((n for n in range(count, most + 1, 2) if -(-total // n) <= tile_bytes), None)
        fix = f"numIOTiles({needed})" if needed else f"the most I/O tiles, {most}, and fewer marked bytes"
        names = ", ".join(f"{t['name']} ({t['bytes']:,} bytes)" for t in tensors)
        raise Error(
            f"Out of memory on the simulated IPU's I/O tiles: the tensors marked for overlapped I/O, {names}, take "
            f"{int(used.max()):,} bytes on an I/O tile, more than its {tile_bytes:,} bytes, with "
            f"TensorLocations.numIOTiles({count}). Reserve more I/O tiles ({fix}), or mark fewer or smaller "
            "tensors with set_overlap_for_input / set_overlap_for_output."
        )
    return {"io_tiles": count, "ipu": 0, "tile_bytes": tile_bytes, "memory": used.tolist(), "tensors": tensors}


def check_input_fits(name, shape, itemsize, options):
    """Refuse, before capture, an input whose one micro-batch (``shape``, ``itemsize`` bytes per element on
    the device) cannot fit the tile memory of the simulated IPU at all."""
    target = target_of(options)
    capacity = target.num_tiles * target.tile_bytes
    needed = math.prod(shape) * itemsize
    if needed > capacity:
        raise Error(
            f"Input {name}: one micro-batch of shape {list(shape)} takes {needed:,} bytes on the device, more "
            f"than the {capacity:,} bytes of tile memory of the simulated {target.name} ({target.num_tiles:,} tiles "
            f"x {target.tile_bytes:,} bytes). Use a smaller batch, or split it over more micro-batches with "
            "Options.deviceIterations or Options.Training.gradientAccumulation."
        )


def locate_index_error(exe, graph, feeds):
    """Where a run's out-of-range gather/scatter index came from, found by replaying the run on the popir
    reference interpreter (only on this error path): the op with its source line, the range of the indices,
    and the model inputs they derive from. None when the replay does not fail."""
    values = dict(feeds)
    for v in graph.inputs:
        if v.kind != "input":
            values[v.name] = exe.read_variable(v.name)
    try:
        popir.interpreter.run(graph, values)
    except popir.IRError as exc:
        message = str(exc)
        node = next((n for n in graph.nodes if message.startswith(n.describe())), None)
        sources = sorted(_int_inputs_behind(node)) if node is not None else []
        where = f"; the indices derive from input {', '.join(sources)}" if sources else ""
        return message + where
    return None


def _int_inputs_behind(node):
    """Names of the integer model inputs ``node`` reads, directly or through other ops."""
    found, pending, seen = set(), list(node.inputs), set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.producer is None:
            if value.kind == "input" and not value.dtype.is_float:
                found.add(value.name)
        else:
            pending.extend(value.producer.inputs)
    return found
