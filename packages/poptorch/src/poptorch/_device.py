"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import dataclasses
import math

import numpy as np

import popir
import popsim
from poptorch import _blocks, _streaming
from poptorch.enums import OverlapMode
from poptorch.errors import Error


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
    readers there, or, when the program does not fit that way, afresh for each reader."""
    available_memory = options.available_memory_proportion
    beyond = sorted(ipu for ipu in available_memory if ipu >= num_ipus)
    if beyond:
        raise Error(
            f"setAvailableMemoryProportion names IPU{beyond[0]}, but the model runs on {num_ipus} IPU(s) "
            f"(IPU0 to IPU{num_ipus - 1}): remove that key or place a block on that IPU"
        )
    remote = _streaming.remote_variables(graphs, options)

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
            f"Out of memory on the simulated IPU: {exc} From poptorch, compile anyway with "
            """opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})."""
        ) from exc


def pipeline_overlap(exe, program, plan, groups, micro_batches):
    """Cycles a pipelined multi-IPU ``plan`` saves on ``groups`` groups of ``micro_batches`` runs of
    ``program`` (0 when the stages are not pipelined): a group's runs overlap over the IPUs instead of running
    one after another. The group's schedule (stages, IPUs, ramp-up / main / ramp-down, timeline) goes into
    the profile."""
    if not plan.pipelined or not groups or not micro_batches:
        return 0
    schedule = popsim.step_schedule(exe.profile.programs[program], exe.target, micro_batches, True)
    exe.profile.programs[program]["schedule"] = schedule.as_dict()
    return groups * (schedule.serial_cycles - schedule.total_cycles)


def phase_overlap(exe, program, graph, strategy, runs):
    """Cycles a phased ``strategy`` saves on ``runs`` runs of ``program`` (its popir ``graph``): within a phase
    and pass, the stages on different IPUs that do not read each other's values run at the same time (the
    phase costs its critical path, inter-IPU copies included); 0 for other strategies. The phases' timeline
    goes into the profile under ``phases``."""
    if not _blocks.is_phased(strategy) or not runs:
        return 0
    schedule = popsim.phase_schedule(exe.profile.programs[program], exe.target, _phase_reads(graph))
    exe.profile.programs[program]["phases"] = schedule
    return runs * (schedule["serial_cycles"] - schedule["total_cycles"])


def _phase_reads(graph):
    """``(phase, pass, from_ipu, to_ipu)`` for each value a node of one phase and pass reads from another IPU
    of the same phase and pass."""
    reads = set()
    for node in graph.nodes:
        if node.placement is None:
            continue
        direction = "forward" if node.role in (None, "forward") else "backward"
        for value in node.inputs:
            producer = value.producer
            if producer is None or producer.placement is None or producer.placement[0] != node.placement[0]:
                continue
            if producer.placement[1] == node.placement[1] or producer.op == "constant":
                continue  # a constant is on the device from load time: no wait
            if (producer.role in (None, "forward")) == (direction == "forward"):
                reads.add((node.placement[0], direction, producer.placement[1], node.placement[1]))
    return reads


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


def io_overlap(exe, program, graph, marks, runs, run_cycles, io_tiles, inner_is_accumulation):
    """Cycles overlapped host I/O saves on ``runs`` (``(device iteration, accumulation step, replica)`` of each
    run of ``program``, with its ``run_cycles``). A marked tensor streams to or from the ``io_tiles`` I/O tiles
    and is exchanged with the compute tiles (more compute-tile cycles); the next run's marked inputs load and
    the previous run's marked outputs store while the compute tiles run, when both runs are in the loop the
    tensor's ``OverlapMode`` overlaps (``OverlapDeviceIterationLoop``: the call's device-iteration loop;
    ``OverlapAccumulationLoop``: the inner loop, the accumulation loop when ``inner_is_accumulation``). A run
    then costs max(compute, I/O-tile transfers) plus the transfers no neighbouring run hid. Replicas run in
    parallel: the least saving counts. The figures go into the profile under ``io_overlap``."""
    if not marks or not runs:
        return 0
    nbytes = {
        name: (graph.input(name) if direction == "input" else graph.outputs[name]).type.nbytes
        for name, (direction, _) in marks.items()
    }
    target = exe.target
    transfer = {name: popsim.cost.host_cycles(target, n) for name, n in nbytes.items()}
    exchange = popsim.cost.exchange_cycles(target, -(-sum(nbytes.values()) // io_tiles))

    best = None
    for replica in sorted({r for _, _, r in runs}):
        own = [(run, c) for run, c in zip(runs, run_cycles, strict=True) if run[2] == replica]
        serial = sum(c for _, c in own)
        overlapped = _overlapped_cycles(own, marks, transfer, exchange, inner_is_accumulation)
        if best is None or serial - overlapped < best[0] - best[1]:
            best = (serial, overlapped)
    exe.profile.programs[program]["io_overlap"] = {
        "io_tiles": io_tiles,
        "tensors": {
            name: {"direction": direction, "mode": mode.name, "bytes": nbytes[name], "transfer_cycles": transfer[name]}
            for name, (direction, mode) in marks.items()
        },
        "io_exchange_cycles_per_run": exchange,
        "serial_cycles": best[0],
        "overlapped_cycles": best[1],
    }
    return best[0] - best[1]


def _overlapped_cycles(own, marks, transfer, exchange, inner_is_accumulation):
    """Cycles of one replica's runs ``own`` (``[(run, cycles)]`` in order) with overlapped I/O."""

    def loop_of(i, mode):
        d, _, r = own[i][0]
        inner = mode is OverlapMode.OverlapAccumulationLoop and inner_is_accumulation
        return (r, d) if inner else r

    def same_loop(i, j, mode):
        return 0 <= j < len(own) and loop_of(j, mode) == loop_of(i, mode)

    total = 0
    for i, (_, cycles) in enumerate(own):
        compute = cycles - sum(transfer.values()) + exchange
        hidden = exposed = 0
        for name, (direction, mode) in marks.items():
            # An input loads during the previous run, an output stores during the next.
            ahead, behind = (i + 1, i - 1) if direction == "input" else (i - 1, i + 1)
            hidden += transfer[name] if same_loop(i, ahead, mode) else 0
            exposed += 0 if same_loop(i, behind, mode) else transfer[name]
        total += max(compute, hidden) + exposed
    return total
