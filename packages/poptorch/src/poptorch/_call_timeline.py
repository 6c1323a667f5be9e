"""The timeline of one call on the simulated device, whose makespan is the call's cycle count.

Each replica has a resource per IPU's compute tiles and one for its I/O tiles (``popsim.Timeline``). A run of
the micro-batch program holds its replica's compute tiles for its cycles; pipelined stages (``popsim.
place_pipeline``) and the IPUs of one phase (``popsim.place_phases``) hold only their own IPU's, so they overlap
where PopTorch's schedules overlap them (a pipeline cycle by cycle, its inter-IPU copies on the IPU-Links).
Host transfers of tensors marked by ``set_overlap_for_input`` / ``_output`` hold the I/O tiles: the next
run's inputs load and the previous run's outputs store while the compute tiles run, when both runs are in
the loop the tensor's ``OverlapMode`` overlaps
(``OverlapDeviceIterationLoop``: the call's device-iteration loop; ``OverlapAccumulationLoop``: the inner
loop, the accumulation loop with gradient accumulation); a transfer no neighbouring run can hide holds the
compute tiles too. Replicas run in parallel, and a training step's gradient reduction and optimizer run hold
every replica's compute tiles once all their micro-batches are done.
"""

from dataclasses import dataclass

import popsim
from popsim.timeline import HOST_TRANSFER
from poptorch import _blocks
from poptorch._overlapped_io import INPUT
from poptorch.enums import OverlapMode

IO_IPU = 0  # the marked tensors stream through the I/O tiles of each replica's first IPU


@dataclass(frozen=True)
class CallRuns:
    """What one call ran: ``runs`` ``(device iteration, accumulation step, replica)`` of the micro-batch
    program with their ``run_cycles``, ``runs_per_step`` of them before each of ``step_cycles`` (the gradient
    reduction and optimizer run of each training step, empty for inference), and whether the inner loop is
    the accumulation loop (``accumulating``); ``host_write_cycles`` of the host writes made since the previous
    call (setOptimizer's hyper-parameters), which go before its runs."""

    runs: list
    run_cycles: list
    runs_per_step: int
    step_cycles: list
    accumulating: bool
    host_write_cycles: int = 0


def call_cycles(exe, programs, plan, options, marks, call):
    """The cycles of ``call`` (CallRuns) of the micro-batch program of ``programs`` compiled in ``exe``
    under the MultiIpuPlan ``plan``, with the overlapped-I/O ``marks`` (``{name: (direction, mode)}``). The
    micro-batch program's profile gets the call's timeline (``run_timeline``), the pipeline's ``schedule``,
    the phases' ``phases`` and the I/O figures ``io_overlap``."""
    name = programs.micro_batch
    profile = exe.profile.programs[name]
    step = exe.profile.programs[programs.step] if programs.step else None
    plan_of = _Placement(exe, profile, programs.graphs[name], plan, options, call, step)
    timeline = plan_of.place(marks)
    if plan_of.schedule is not None:
        profile["schedule"] = plan_of.schedule.as_dict()
    if plan_of.phased and call.runs:
        streams = plan_of.unmarked_streams(marks)
        profile["phases"] = popsim.phase_schedule(profile, exe.target, plan_of.depends, plan_of.overlap, streams)
    if marks and call.runs:
        serial = plan_of.place({}).makespan
        profile["io_overlap"] = plan_of.io_figures(marks, serial, timeline.makespan)
    profile["run_timeline"] = timeline.as_dict()
    return timeline.makespan


class _Placement:
    """Lays a call's runs out on a Timeline: per replica its runs (a pipeline group, phased runs or whole
    runs, with their marked transfers), then each training step on every replica."""

    def __init__(self, exe, profile, graph, plan, options, call, step_profile=None):
        self.exe, self.profile, self.graph, self.call = exe, profile, graph, call
        self.step_profile = step_profile  # the profile of the training step's program, if it has its own
        self.stretches = {}  # (replica, marked names) -> the micro-batch program's stretches with its streams
        self.ipus = list(range(plan.num_ipus))
        self.replicas = sorted({r for _, _, r in call.runs})
        self.phased = _blocks.is_phased(options.execution_strategy)
        self.depends = _phase_reads(graph) if self.phased else set()
        self.overlap = _blocks.overlaps_streaming(options.execution_strategy)
        self.io_tiles = options.TensorLocations.num_io_tiles
        self.schedule = None
        self.streams = _host_streams(graph, exe.target, with_ipu=self.phased)
        if plan.pipelined and call.runs:
            per_group = call.runs_per_step if call.step_cycles else len(call.runs)
            micro_batches = per_group // len(self.replicas)
            self.schedule = popsim.step_schedule(profile, exe.target, micro_batches, True, self.streams)

    def place(self, marks):
        """The Timeline of the call with ``marks`` overlapped (``{}``: every transfer in its run)."""
        timeline = popsim.Timeline()
        io = {r: _MarkedTransfers(self, marks, r) for r in self.replicas}
        every = [popsim.compute_lane(r, ipu) for r in self.replicas for ipu in self.ipus]
        self._place_host_writes(timeline, every)
        for step, group in enumerate(self._groups()):
            start = timeline.free_at(every)  # replicas start each group together
            for replica in self.replicas:
                if self.schedule is not None:
                    popsim.place_pipeline(timeline, self.schedule, replica, self.ipus, start)
                    continue
                for i in group:
                    if self.call.runs[i][2] == replica:
                        io[replica].place_run(timeline, i, start)
            if step < len(self.call.step_cycles):
                self._place_step(timeline, self.call.step_cycles[step])
        return timeline

    def _place_host_writes(self, timeline, every):
        """The host writes made since the previous call, on each replica's host link before any run: the
        device's tiles wait for the values they read (each replica gets its own copy, over its own link)."""
        if self.call.host_write_cycles:
            links = [popsim.transfer_lane(r, 0, HOST_TRANSFER) for r in self.replicas or [0]]
            timeline.add([*links, *every], self.call.host_write_cycles, program="host write", transfer=HOST_TRANSFER)

    def _place_step(self, timeline, cycles):
        """A training step's reduction and optimizer run on every replica's compute tiles, its streaming-memory
        and host transfers (the optimizer state off chip) on their lanes too."""
        if self.step_profile is None:
            every = [popsim.compute_lane(r, ipu) for r in self.replicas for ipu in self.ipus]
            timeline.add(every, cycles, program="step")
            return
        target = self.exe.target
        popsim.place_shared_run(timeline, self.step_profile, target, self.replicas, self.ipus, cycles, program="step")

    def _groups(self):
        """Runs that start together once the previous group's work (and its step) is done: one training
        step's, one device iteration's, or the whole call's when an inference pipeline spans it."""
        runs = len(self.call.runs)
        whole = self.schedule is not None and not self.call.step_cycles
        size = runs if whole else self.call.runs_per_step
        return [range(start, min(start + size, runs)) for start in range(0, runs, size)]

    def place_body(self, timeline, index, not_before, extra_cycles, marked=()):
        """One run (``index`` into the call's runs) on its replica's compute tiles, ``extra_cycles`` added to
        its cycles, its host streams at their program positions but those of the tensors ``marked`` (streamed
        beside the run); returns its intervals."""
        d, a, replica = self.call.runs[index]
        label = {"device_iteration": d, "accumulation_step": a}
        if self.phased:
            depends, target, streams = self.depends, self.exe.target, self.unmarked_streams(marked)
            return popsim.place_phases(
                timeline,
                self.profile,
                target,
                depends,
                replica,
                self.ipus,
                not_before,
                extra_cycles,
                self.overlap,
                streams,
                **label,
            )
        cycles = self.call.run_cycles[index] + extra_cycles
        # Sharded: each stage on its IPU's lane, one after another; host-side transfers on their lanes too.
        target = self.exe.target
        key = (replica, frozenset(marked))
        if key not in self.stretches:
            run = popsim.run_stretches(self.profile, target, replica)
            self.stretches[key] = popsim.stream_stretches(run, self.unmarked_streams(marked), replica)
        stretches = self.stretches[key]
        placed = popsim.place_steps(
            timeline, self.profile, target, replica, self.ipus, cycles, not_before, stretches, **label
        )
        if placed is not None:
            return placed
        lanes = [popsim.compute_lane(replica, ipu) for ipu in self.ipus]
        return [timeline.add(lanes, cycles, not_before=not_before, replica=replica, **label)]

    def unmarked_streams(self, marked):
        """The run's host streams (``_host_streams``) but those of the tensors ``marked`` (streamed beside it)."""
        return [s for s in self.streams if s[0] not in marked]

    def io_figures(self, marks, serial, overlapped):
        """The profile's ``io_overlap`` entry: the marked tensors, their transfers and the call's cycles with
        the transfers in their runs (``serial``) and overlapped (``overlapped``)."""
        transfers = _MarkedTransfers(self, marks, self.replicas[0])
        return {
            "io_tiles": self.io_tiles,
            "tensors": {
                name: {
                    "direction": direction,
                    "mode": mode.name,
                    "bytes": transfers.nbytes[name],
                    "transfer_cycles": transfers.cycles[name],
                }
                for name, (direction, mode) in marks.items()
            },
            "io_exchange_cycles_per_run": transfers.exchange,
            "serial_cycles": serial,
            "overlapped_cycles": overlapped,
        }


def _producing_ipu(graph, name, direction):
    """The IPU other than the I/O tiles' one that produces marked output ``name``, else None."""
    if direction == INPUT:
        return None
    producer = graph.outputs[name].producer
    if producer is None or producer.placement is None or producer.placement[1] == IO_IPU:
        return None
    return producer.placement[1]


class _MarkedTransfers:
    """One replica's marked host transfers: each run's compute tiles lose the transfers and gain the exchange
    between the I/O tiles and them; a transfer runs on the I/O tiles during a neighbouring run of its loop
    (an input during the run before, an output during the run after), else on both before (input) or after
    (output) its own run."""

    def __init__(self, placement, marks, replica):
        self.placement, self.marks, self.replica = placement, marks, replica
        target, graph = placement.exe.target, placement.graph
        self.nbytes = {
            name: (graph.input(name) if direction == INPUT else graph.outputs[name]).type.nbytes
            for name, (direction, _) in marks.items()
        }
        self.cycles = {name: popsim.cost.host_cycles(target, n) for name, n in self.nbytes.items()}
        io_tiles = max(placement.io_tiles, 1)
        self.exchange = popsim.cost.exchange_cycles(target, -(-sum(self.nbytes.values()) // io_tiles))
        # A marked output produced on another IPU crosses the IPU-Link to the I/O tiles after its run: {name:
        # (that IPU, link cycles)} (a marked input read there crosses it in the program, an inter-IPU copy).
        self.away = {}
        for name, (direction, _) in marks.items():
            ipu = _producing_ipu(graph, name, direction)
            if ipu is not None:
                self.away[name] = ipu, popsim.cost.link_cycles(target, self.nbytes[name])
        self.own = [i for i, run in enumerate(placement.call.runs) if run[2] == replica]
        self.position = {index: position for position, index in enumerate(self.own)}
        self.loaded = {}  # run index -> the intervals that loaded its inputs ahead

    def _loop(self, position, mode):
        d, _, _ = self.placement.call.runs[self.own[position]]
        inner = mode is OverlapMode.OverlapAccumulationLoop and self.placement.call.accumulating
        return d if inner else None

    def _neighbour(self, position, step, mode):
        """The run ``step`` runs away from the one at ``position`` in this replica's order, if in one loop."""
        other = position + step
        if 0 <= other < len(self.own) and self._loop(other, mode) == self._loop(position, mode):
            return self.own[other]
        return None

    def place_run(self, timeline, index, not_before):
        """Place run ``index``: its exposed input loads, the transfers it hides, its compute, its exposed
        output stores."""
        if not self.marks:
            self.placement.place_body(timeline, index, not_before, 0)
            return
        position = self.position[index]
        io = [popsim.io_lane(self.replica, IO_IPU)]
        both = io + [popsim.compute_lane(self.replica, ipu) for ipu in self.placement.ipus]
        before = max(not_before, timeline.free_at(both[1:]))
        waits = list(self.loaded.pop(index, []))
        for name, (direction, mode) in self.marks.items():
            if direction == INPUT and self._neighbour(position, -1, mode) is None:
                waits.append(timeline.add(both, self.cycles[name], not_before=before, tensor=name, transfer="load"))
        start = max([before, *(w.end for w in waits)])
        # Hidden while this run computes: the previous run's outputs, then the next run's inputs.
        for name, (direction, mode) in sorted(self.marks.items(), key=lambda m: m[1][0] == INPUT):
            other = self._neighbour(position, 1 if direction == INPUT else -1, mode)
            if other is not None:
                kind = "load" if direction == INPUT else "store"
                hidden = timeline.add(io, self.cycles[name], not_before=start, tensor=name, transfer=kind)
                if direction == INPUT:
                    self.loaded.setdefault(other, []).append(hidden)
        extra = self.exchange - sum(self.cycles.values())
        body = self.placement.place_body(timeline, index, start, extra, self.marks)
        crossed = {name: [self._cross(timeline, name, body)] for name in self.away}
        for name, (direction, mode) in self.marks.items():
            if direction != INPUT and self._neighbour(position, 1, mode) is None:
                after = body + crossed.get(name, [])
                timeline.add(both, self.cycles[name], after=after, tensor=name, transfer="store")

    def _cross(self, timeline, name, body):
        """Marked output ``name``, made on another IPU by the run ``body``, over the IPU-Link to the I/O tiles:
        the producing IPU's tiles send it, the I/O tiles receive it (its store waits for it)."""
        ipu, cycles = self.away[name]
        lanes = [popsim.link_lane(self.replica, ipu, IO_IPU), popsim.io_lane(self.replica, IO_IPU)]
        lanes.append(popsim.compute_lane(self.replica, ipu))
        return timeline.add(lanes, cycles, after=body, tensor=name, transfer="IPU-Link")


def _pass_of(node):
    return "forward" if node.role in (None, "forward") else "backward"


def _host_streams(graph, target, with_ipu=False):
    """``(name, to device, host cycles, ((stage, pass), ...))`` of each model input of ``graph`` with the placed
    passes that read it, and each output with the placed pass that produces it (none when unplaced), in the
    order the run streams them (``popsim.step_schedule``, ``popsim.stream_stretches``); ``with_ipu``: each
    pass ``(phase, pass, ipu)`` with the IPU of its node (``popsim.place_phases``)."""

    def where(node):  # the placed node's (stage, pass) or (phase, pass, ipu)
        stage, ipu = node.placement
        return (stage, _pass_of(node), ipu) if with_ipu else (stage, _pass_of(node))

    readers = {id(v): (v, []) for v in graph.inputs if v.kind == "input"}  # id(input) -> (input, its passes)
    for node in graph.nodes:
        for value in node.inputs if node.placement is not None else ():
            if id(value) in readers:
                readers[id(value)][1].append(where(node))
    streams = [(v.name, True, v.type.nbytes, tuple(passes)) for v, passes in readers.values()]
    for name, value in graph.outputs.items():
        producer = value.producer
        placed = producer is not None and producer.placement is not None
        passes = (where(producer),) if placed else ()
        streams.append((name, False, value.type.nbytes, passes))
    # Each stream's share of the host cycles of all of them, which the run's cycles count as one transfer.
    shares, streamed = [], 0
    for name, inward, n, passes in streams:
        before, streamed = popsim.cost.host_cycles(target, streamed), streamed + n
        shares.append((name, inward, popsim.cost.host_cycles(target, streamed) - before, passes))
    return shares


def _phase_reads(graph):
    """``(phase, pass, from_ipu, to_ipu)`` for each value a node of one phase and pass reads from another IPU
    of the same phase and pass."""
    reads = set()
    for node in graph.nodes:
        if node.placement is None:
            continue
        direction = _pass_of(node)
        for value in node.inputs:
            producer = value.producer
            if producer is None or producer.placement is None or producer.placement[0] != node.placement[0]:
                continue
            if producer.placement[1] == node.placement[1] or producer.op == "constant":
                continue  # a constant is on the device from load time: no wait
            if (producer.role in (None, "forward")) == (direction == "forward"):
                reads.add((node.placement[0], direction, producer.placement[1], node.placement[1]))
    return reads
