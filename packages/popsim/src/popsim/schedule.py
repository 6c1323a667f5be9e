"""The multi-IPU schedule of a program run once per micro-batch: its stages run one after another (sharded)
or overlapped over the IPUs (pipelined, as PopART pipelines a PopTorch model with gradient accumulation).

Each profile step of a placed node names its (stage, IPU) and role; a stage's forward cycles per micro-batch
are those of its forward steps with their syncs, its backward cycles those of the rest (gradients and the
accumulation into them), each without the inter-IPU copies between stages, which are costed on their own.
Each micro-batch's host streams (``Stream``) belong to the pass that reads or produces their tensor: an input
streams in on that stage's IPU just before the pass, an output streams out just after it, each holding the
replica's host link, inside the pipeline cycle of that pass, as PopART streams them. The steps of no stage
(control, unplaced work) and the streams of no pass run once per micro-batch outside the pipeline.

Pipelined, the step is a sequence of pipeline cycles, as PopART builds it: in each cycle every IPU runs its
stages' work for the micro-batches at that point of the pipeline, then all IPUs sync and the activations
(forward) and gradients (backward) cross to the next stage's IPU over the IPU-Links, ready for the next
cycle. The backward pass of the k-th of ``S`` stages is pipeline stage ``2 S - 2 - k`` (the last stage's
forward and backward share one), so in cycle t the k-th stage runs the forward of micro-batch ``t - k`` and
the backward of micro-batch ``t - (2 S - 2 - k)``: ``M`` micro-batches take ``M + 2 S - 2`` cycles, each
as long as its busiest IPU plus its copies (the IPUs run in lock-step: a cycle's copies are one exchange
after a sync of every IPU). Ramp-up (before the last IPU starts) and ramp-down (after the first IPU is done)
are where some IPUs wait: the bubbles fall out of the cycles.
"""

import functools
import graphlib
from dataclasses import dataclass, field

import numpy as np

from popsim.timeline import (
    HOST_TRANSFER,
    STREAMING_MEMORY,
    Timeline,
    compute_lane,
    copy_destinations,
    link_lane,
    transfer_lane,
)

# Labels of the timeline intervals of a run's steps in no phase or stage (host transfers, control).
OUTSIDE_PHASES, OUTSIDE_STAGES = "outside phases", "outside stages"
PASSES = ("forward", "backward")
COPY = "inter-IPU copy"  # the transfer label of a pipeline's copies between stages
REMOTE_STORE = "remote store "  # how streaming-memory stores are named


@dataclass(frozen=True)
class Copy:
    """An inter-IPU copy of one micro-batch's tensors into ``stage``'s ``direction`` pass: ``cycles`` with
    their sync, over the IPU-Links ``links`` (``(from IPU, to IPU)`` pairs); ``before`` when it feeds that pass
    (it crosses at the end of the cycle before), else it sends that pass's results (at the end of its cycle)."""

    stage: int
    direction: str
    cycles: int
    links: tuple
    before: bool


@dataclass(frozen=True)
class Stream:
    """A host stream of one micro-batch's tensor ``name`` (``to_device``: an input), ``cycles`` on the host link:
    into the tiles of ``stage``'s ``direction`` pass before the pass reads it, or out after it produces it."""

    name: str
    to_device: bool
    cycles: int
    stage: int
    direction: str


@dataclass(frozen=True)
class Schedule:
    """Cycles of one step of ``micro_batches`` runs of a program over its stages."""

    micro_batches: int
    pipelined: bool
    forward_cycles: dict = field(default_factory=dict)  # stage -> forward compute cycles per micro-batch
    backward_cycles: dict = field(default_factory=dict)  # stage -> backward compute cycles per micro-batch
    stage_ipu: dict = field(default_factory=dict)  # stage -> IPU
    outside_cycles: int = 0  # per micro-batch, in no stage
    copies: tuple = ()  # the Copy entries of one micro-batch
    # (stage, pass) -> ((transfer kind or None, cycles), ...): the pass's compute and its host-side transfers
    # (streaming-memory loads and stores) in program order, adding up to its cycles
    pieces: dict = field(default_factory=dict)
    streams: tuple = ()  # the Stream entries of one micro-batch

    def streams_of(self, stage, direction, to_device):
        """The host streams into (``to_device``) or out of ``stage``'s ``direction`` pass."""
        return [s for s in self.streams if (s.stage, s.direction, s.to_device) == (stage, direction, to_device)]

    @property
    def stages(self):
        return sorted(self.stage_ipu)

    def cycles_of(self, stage, direction):
        """Compute cycles per micro-batch of ``stage``'s ``direction`` pass."""
        return (self.forward_cycles if direction == "forward" else self.backward_cycles).get(stage, 0)

    def pipeline_cycle(self, stage, direction, batch):
        """The pipeline cycle in which ``stage`` runs its ``direction`` pass of micro-batch ``batch``."""
        return batch + _pipeline_stage(self.stages, stage, direction)

    def has_work(self, stage, direction):
        return self.cycles_of(stage, direction) > 0 or any(
            (c.stage, c.direction) == (stage, direction) for c in (*self.copies, *self.streams)
        )

    @property
    def serial_cycles(self):
        """The step's cycles with the stages run one after another (sharded)."""
        staged = sum(self.forward_cycles.values()) + sum(self.backward_cycles.values())
        moved = sum(c.cycles for c in self.copies) + sum(s.cycles for s in self.streams)
        return self.micro_batches * (staged + moved + self.outside_cycles)

    @functools.cached_property
    def _placed(self):
        """The pipelined step laid out on a Timeline of its own, from cycle 0."""
        timeline = Timeline()
        ipus = sorted(set(self.stage_ipu.values()) | {ipu for c in self.copies for link in c.links for ipu in link})
        place_pipeline(timeline, self, 0, ipus)
        return timeline

    @functools.cached_property
    def _figures(self):
        """Ramp-up (until every IPU has started), ramp-down (once the first IPU is done), the cycles of the
        pipeline (without the work outside the stages) and each IPU's idle cycles in it."""
        spans, busy = {}, {}  # ipu -> [first start, last end] of its stages' work; ipu -> cycles with copies
        for i in self._placed.intervals:
            if "stage" in i.label and i.end > i.start:
                busy[i.label["ipu"]] = busy.get(i.label["ipu"], 0) + i.end - i.start
                if i.label.get("transfer") != COPY:
                    span = spans.setdefault(i.label["ipu"], [i.start, i.end])
                    span[:] = min(span[0], i.start), max(span[1], i.end)
        pipeline = self.total_cycles - self.micro_batches * self.outside_cycles
        if not spans:
            return 0, 0, pipeline, {}
        ramp_up = max(first for first, _ in spans.values())
        ramp_down = pipeline - min(last for _, last in spans.values())
        return ramp_up, ramp_down, pipeline, {ipu: pipeline - cycles for ipu, cycles in sorted(busy.items())}

    @property
    def ramp_up_cycles(self):
        """Cycles before every IPU has started (0 when not pipelined)."""
        return self._figures[0] if self.pipelined else 0

    @property
    def ramp_down_cycles(self):
        """Cycles after the first IPU has finished its work (0 when not pipelined)."""
        return self._figures[1] if self.pipelined else 0

    @property
    def main_cycles(self):
        """The pipeline's cycles between ramp-up and ramp-down (pipelined)."""
        if not self.pipelined:
            return 0
        ramp_up, ramp_down, pipeline, _ = self._figures
        return pipeline - ramp_up - ramp_down

    @property
    def total_cycles(self):
        """The step's cycles under this schedule."""
        return self._placed.makespan if self.pipelined else self.serial_cycles

    def timeline(self):
        """When each stage works on each micro-batch: dicts of ipu, stage, micro_batch, pass ("forward" or
        "backward"), start and end cycles within the step (copies and work outside the stages not listed)."""
        if self.pipelined:
            spans = {}  # (stage, micro-batch, pass) -> [start, end] over its pieces
            for i in self._placed.intervals:
                if "stage" in i.label and i.label.get("transfer") != COPY:
                    key = (i.label["stage"], i.label["micro_batch"], i.label["pass"])
                    span = spans.setdefault(key, [i.start, i.end])
                    span[:] = min(span[0], i.start), max(span[1], i.end)
            entries = [self._entry(*key, *span) for key, span in spans.items()]
            return sorted(entries, key=lambda e: (e["start"], e["ipu"]))
        entries, now = [], 0
        order = [(s, "forward") for s in self.stages] + [(s, "backward") for s in reversed(self.stages)]
        for batch in range(self.micro_batches):
            for stage, direction in order:
                for copy in self._copies_of(stage, direction, True):
                    now += copy.cycles
                now += sum(s.cycles for s in self.streams_of(stage, direction, True))
                cycles = self.cycles_of(stage, direction)
                if cycles:
                    entries.append(self._entry(stage, batch, direction, now, now + cycles))
                    now += cycles
                now += sum(s.cycles for s in self.streams_of(stage, direction, False))
                for copy in self._copies_of(stage, direction, False):
                    now += copy.cycles
            now += self.outside_cycles
        return entries

    def _copies_of(self, stage, direction, before):
        return [c for c in self.copies if (c.stage, c.direction, c.before) == (stage, direction, before)]

    def _entry(self, stage, batch, direction, start, end):
        return {
            "ipu": self.stage_ipu[stage],
            "stage": stage,
            "micro_batch": batch,
            "pass": direction,
            "start": start,
            "end": end,
        }

    def as_dict(self):
        """The schedule for a profile: per stage its IPU, compute cycles per micro-batch and the inter-IPU
        copies into it and out of it, the figures of the whole step and (pipelined) each IPU's idle cycles."""
        shown = {
            "micro_batches": self.micro_batches,
            "pipelined": self.pipelined,
            "stages": {
                s: {
                    "ipu": self.stage_ipu[s],
                    "forward_cycles": self.forward_cycles.get(s, 0),
                    "backward_cycles": self.backward_cycles.get(s, 0),
                    "copy_cycles": sum(c.cycles for c in self.copies if c.stage == s),
                }
                for s in self.stages
            },
            "outside_stages_cycles": self.outside_cycles,
            "ramp_up_cycles": self.ramp_up_cycles,
            "main_cycles": self.main_cycles,
            "ramp_down_cycles": self.ramp_down_cycles,
            "serial_cycles": self.serial_cycles,
            "total_cycles": self.total_cycles,
            "timeline": self.timeline(),
        }
        if self.pipelined:
            shown["bubble_cycles"] = self._figures[3]
        return shown


def step_schedule(program, target, micro_batches, pipelined, streams=()):
    """The Schedule of ``micro_batches`` runs of ``program`` (a ``Profile.programs`` entry) compiled for
    ``target`` (its graph target), pipelined or sharded. ``streams``: ``(name, to_device, cycles, passes)`` of
    each tensor the program streams from or to the host per run, ``passes`` the ``(stage, pass)`` reading it
    (an input) or producing it (an output): an input streams into the first of them in pipeline order, an
    output out of the last; one with none of the program's stages stays outside the stages."""
    passes = {"forward": {}, "backward": {}}
    stage_ipu = {}
    copies = {}  # (stage, pass, links, before) -> cycles
    pieces = {}  # (stage, pass) -> [[transfer kind or None, cycles], ...]
    for step in program["steps"]:
        if "stage" not in step:
            continue
        direction, cycles = _pass_of(step), step["cycles"] + target.bsp_sync_cycles
        stage_ipu[step["stage"]] = step["ipu"]
        links = _link_pairs(step)
        if links:
            # Labelled with the stage it lands on (it feeds that pass), or merged into the sender's exchange.
            before = step["ipu"] in copy_destinations(step["name"])
            key = (step["stage"], direction, links, before)
            copies[key] = copies.get(key, 0) + cycles
        else:
            passes[direction][step["stage"]] = passes[direction].get(step["stage"], 0) + cycles
            run = pieces.setdefault((step["stage"], direction), [])
            if not run or run[-1][0] != step.get("transfer"):
                run.append([step.get("transfer"), 0])
            run[-1][1] += cycles
    placed = _placed_streams(streams, sorted(stage_ipu))
    staged = sum(sum(c.values()) for c in passes.values()) + sum(copies.values()) + sum(s.cycles for s in placed)
    return Schedule(
        micro_batches,
        pipelined,
        passes["forward"],
        passes["backward"],
        stage_ipu,
        max(0, program["total_cycles"] - staged),
        tuple(
            Copy(stage, direction, cycles, links, before)
            for (stage, direction, links, before), cycles in copies.items()
        ),
        {key: tuple(map(tuple, run)) for key, run in pieces.items()},
        placed,
    )


def _pipeline_stage(stages, stage, direction):
    """PopART's pipeline stage of ``stage``'s ``direction`` pass (``stages`` in order): the k-th of S stages
    runs its forward pass as pipeline stage k, its backward pass as 2 S - 2 - k."""
    k = stages.index(stage)
    return k if direction == "forward" else 2 * len(stages) - 2 - k


def _stream_label(stream):
    """The timeline label of a Stream's interval: its tensor and direction ("in" to the device, else "out")."""
    return {"tensor": stream.name, "stream": "in" if stream.to_device else "out"}


def _placed_streams(streams, stages, keep_unplaced=False):
    """The Stream of each of ``streams`` (see ``step_schedule``) with a pass of one of ``stages`` (and, if
    ``keep_unplaced``, of each other one, with stage and pass None)."""
    placed = []
    for name, to_device, cycles, passes in streams:
        order = [(_pipeline_stage(stages, s, d), s, d) for s, d in passes if s in stages]
        if order or keep_unplaced:
            _, stage, direction = (min(order) if to_device else max(order)) if order else (None, None, None)
            placed.append(Stream(name, to_device, int(cycles), stage, direction))
    return tuple(placed)


def stash_per_tile(program, target, stage_ipu):
    """Bytes each tile adds when a pipeline keeps the activations of several micro-batches: with ``S``
    stages, the k-th stage (in order) holds ``2 (S - 1 - k) + 1`` micro-batches between their forward and
    backward passes, as PopART's stashes do, so each forward activation still live when the backward pass
    starts is kept ``2 (S - 1 - k)`` more times (an IPU with several stages, for its earliest one). Returns
    an int64 array over the tiles of ``target``."""
    stages = sorted(stage_ipu)
    extra = {}
    for k, stage in enumerate(stages):
        ipu = stage_ipu[stage]
        extra[ipu] = max(extra.get(ipu, 0), 2 * (len(stages) - 1 - k))
    tensors = program.get("tensors", ())
    stash = np.zeros(target.num_tiles, np.int64)
    backward = [t["first"] for t in tensors if t.get("role") == "backward" and t["first"] >= 0]
    if not backward:
        return stash
    start = min(backward)
    for t in tensors:
        if t.get("role") != "forward" or t["category"] != "activations" or t["last"] is None:
            continue
        if t["first"] < start <= t["last"]:
            # tile_runs: [first tile, tile count, bytes on each tile of the run] (see provenance.tile_runs).
            for first, count, nbytes in t["tile_runs"]:
                tiles = np.arange(first, first + count)
                copies = np.array([extra.get(ipu, 0) for ipu in (tiles // target.tiles_per_ipu).tolist()], np.int64)
                stash[tiles] += nbytes * copies
    return stash


def phase_schedule(program, target, depends, overlap=False, streams=()):
    """The cycles of one run of a phased ``program`` (a ``Profile.programs`` entry; each placed step's
    ``stage`` is its phase) compiled for ``target``, with its host ``streams`` (see ``place_phases``), as
    ``place_phases`` lays it out on a Timeline of its own (see there). Returns a dict with the serial and
    scheduled cycles and a timeline of each phase's IPUs' work."""
    timeline = Timeline()
    work = _phase_work(program, target, 0)
    ipus = {ipu for unit in work.values() for ipu in unit} | {0}
    place_phases(timeline, program, target, depends, 0, sorted(ipus), overlap=overlap, streams=streams)
    spans = {}  # (phase, pass, ipu) -> [start, end] over its pieces (its host streams apart)
    for i in timeline.intervals:
        if "phase" in i.label and "stream" not in i.label:
            span = spans.setdefault((i.label["phase"], i.label["pass"], i.label["ipu"]), [i.start, i.end])
            span[:] = min(span[0], i.start), max(span[1], i.end)
    entries = [{"phase": p, "pass": d, "ipu": u, "start": a, "end": b} for (p, d, u), (a, b) in spans.items()]
    return {
        "serial_cycles": max(_total(work), program["total_cycles"]),
        "total_cycles": timeline.makespan,
        "timeline": sorted(entries, key=lambda e: (e["start"], e["ipu"])),
    }


def place_phases(
    timeline,
    program,
    target,
    depends,
    replica,
    ipus,
    not_before=0,
    extra_cycles=0,
    overlap=False,
    streams=(),
    **label,
):
    """Lay one run of a phased ``program`` on ``ipus`` of ``replica`` out on ``timeline``. The phases run one
    after another, forward then backward as the steps order them; within one phase and pass (a unit), each
    IPU's work (its steps with their syncs, the inter-IPU copies into it included, which also hold their
    IPU-Links) starts once the IPUs it reads from are done (``depends``: ``(phase, pass, from_ipu, to_ipu)``),
    so a phase costs its critical path; IPUs that read each other both ways run one after another.

    The run's host ``streams`` (``(name, to_device, cycles, ((phase, pass, ipu), ...))``: the placed nodes
    reading an input, or producing an output) sit at their program positions, each holding the replica's
    host link and the compute tiles of the IPUs it writes or reads (``_phase_streams``): an input streams in
    once the unit before the first unit that reads it is done, and its readers wait for it; an output
    streams out once its producing unit is done on its IPU, while the next unit's other IPUs go on; a stream
    of no unit holds every IPU, an input at the run's start, an output at its end. Steps of no phase run on
    every IPU (a host-side one on its transfer's lane too) after the unit begun before them. The rest of the
    run's cycles (control, loop repeats), plus ``extra_cycles``, follow on every IPU once everything is done.
    When the streams and steps of no phase add up to more than the run's cycles beyond its units, they stay
    in that rest, after the units.

    Streaming-memory loads and stores hold the compute tiles, one after another with the compute, unless
    ``overlap`` (PopTorch's ``Liveness.OffChipAfterFwd``): then they hold only the streaming-memory lane, a
    unit's loads running while the unit before computes (once the one before that is done) and its stores
    while the next computes (the unit after that waits for them), within one pass: PopTorch leaves a gap of
    phases between the forward and backward passes, where the last forward unit's stores and the first
    backward unit's loads overlap no compute. ``compile(..., overlap_streaming=True)`` places the tile memory
    this holds (``streaming_overlap``).
    Returns the intervals."""
    label = {"replica": replica, **label}
    work = _phase_work(program, target, replica)
    rest = max(0, program["total_cycles"] - _total(work)) + extra_cycles
    at, between = _phase_streams(streams, list(work), ipus), _unplaced_work(program, target, replica)
    streamed = sum(s.cycles for entries in at.values() for s, _ in entries)
    streamed += sum(piece[1] for pieces in between.values() for piece in pieces)
    if streamed > rest:
        at, between, streamed = {}, {}, 0
    link, everywhere = transfer_lane(replica, 0, HOST_TRANSFER), [compute_lane(replica, i) for i in ipus]

    def stream(entry, after):  # one host stream on the host link and its IPUs' compute tiles
        s, held = entry
        tags = {"phase": s.stage, "pass": s.direction, "ipu": held[0]} if s.stage is not None else {}
        tags |= {"transfer": HOST_TRANSFER, **_stream_label(s)}
        resources = [link, *(compute_lane(replica, ipu) for ipu in held)]
        return timeline.add(resources, s.cycles, after, not_before, **tags, **label)

    def unplaced(index, after):  # the steps of no phase after unit ``index``, on every IPU
        for lanes, cycles, transfer in between.get(index, []):
            tags = {"transfer": transfer} if transfer else {"work": OUTSIDE_PHASES}
            placed.append(timeline.add([*everywhere, *lanes], cycles, after, not_before, **tags, **label))
            after = placed[-1:]
        return after

    placed = [stream(entry, []) for entry in at.get((None, True), [])]
    previous, last_pass, streamed_out = unplaced(-1, placed[:]), None, []
    moved = [[], []]  # the streaming-memory transfers of the unit before the previous one and the previous one
    for index, ((phase, direction), unit) in enumerate(work.items()):
        edges = {(a, b) for p, d, a, b in depends if (p, d) == (phase, direction) and a in unit and b in unit}
        order, edges = _run_order(unit, edges)
        if direction != last_pass:  # between the passes, a gap of phases: the transfers overlap no compute
            moved = [previous + moved[0] + moved[1], []]
        done, settled, moved, last_pass = {}, moved[0], [moved[1], []], direction
        inputs = [(stream(entry, previous), entry[1]) for entry in at.get((index, True), [])]
        placed += [interval for interval, _ in inputs]
        for ipu in order:
            after = previous + settled + [done[a] for a, b in edges if b == ipu and a in done]
            after += [interval for interval, held in inputs if ipu in held]
            tags = {"phase": phase, "pass": direction, "ipu": ipu}
            placed += _place_ipu_work(
                timeline, unit[ipu], tags, after, settled, done, moved, overlap, not_before, label
            )
        previous = list(done.values())
        for entry in at.get((index, False), []):
            streamed_out.append(stream(entry, [done[ipu] for ipu in entry[1] if ipu in done] or previous))
            placed.append(streamed_out[-1])
        previous = unplaced(index, previous)
    ends = previous + moved[0] + moved[1] + streamed_out
    for entry in at.get((None, False), []):
        placed.append(stream(entry, ends))
        ends = placed[-1:]
    placed.append(timeline.add(everywhere, rest - streamed, ends, not_before, work=OUTSIDE_PHASES, **label))
    return placed


def _place_ipu_work(timeline, pieces, tags, after, settled, done, moved, overlap, not_before, label):
    """Place the ``pieces`` (``_phase_work``) of one IPU's work in a unit (``tags``: its phase, pass and IPU)
    after the intervals ``after``; with ``overlap``, its streaming-memory loads hold only their lane, after
    ``settled``, and its stores after its compute (both added to ``moved[1]``). Records the IPU's last
    compute interval in ``done``; returns the intervals."""
    ipu, placed, loads = tags["ipu"], [], []
    for lanes, cycles, transfer, remote in pieces:
        kind = {"transfer": transfer} if transfer else {}
        if overlap and remote == "load":
            interval = timeline.add(lanes, cycles, settled, not_before, **tags, **kind, **label)
            loads.append(interval)
            moved[1].append(interval)
        elif overlap and remote == "store":
            waits = [done[ipu]] if ipu in done else after
            interval = timeline.add(lanes, cycles, waits, not_before, **tags, **kind, **label)
            moved[1].append(interval)
        else:
            resources = [compute_lane(label["replica"], ipu), *lanes]
            interval = timeline.add(resources, cycles, after + loads, not_before, **tags, **kind, **label)
            done[ipu] = interval
        placed.append(interval)
    return placed


def _phase_streams(streams, units, ipus):
    """Where ``place_phases`` puts each of ``streams``: ``{(unit index or None, to_device): [(Stream, IPUs it
    holds), ...]}``, an input at the first of ``units`` (``(phase, pass)`` in run order) with a node reading it,
    holding the IPUs of that unit's readers, an output at its producer's unit, on the producer's IPU; a
    stream with no such unit (index None) holds every one of ``ipus``."""
    index = {unit: i for i, unit in enumerate(units)}
    at = {}
    for name, to_device, cycles, passes in streams:
        found = sorted({index[(p, d)] for p, d, _ in passes if (p, d) in index})
        unit = (found[0] if to_device else found[-1]) if found else None
        held = sorted({ipu for p, d, ipu in passes if index.get((p, d)) == unit}) if found else sorted(ipus)
        phase, direction = units[unit] if found else (None, None)
        at.setdefault((unit, to_device), []).append((Stream(name, to_device, int(cycles), phase, direction), held))
    return at


def place_steps(timeline, program, target, replica, ipus, cycles, not_before=0, stretches=None, **label):
    """Lay one run of ``cycles`` of a sharded or single-IPU ``program`` on ``ipus`` of ``replica`` out on
    ``timeline`` in program order: each stretch of steps of one stage, IPU and pass on that IPU's lane (an
    inter-IPU copy on its IPU-Links too), each after the one before; steps of no stage, and what the run's
    ``cycles`` have beyond the steps (control, loop repeats), on every IPU. A host stream, a host callback or
    a streaming-memory transfer is a stretch of its own that also holds its lane (``transfer_lane``), so the
    run's intervals add up to its ``cycles``. A host stream out of one stage's IPU (``stream_stretches``) holds
    that IPU and the host link only: the work after it waits for it only where it needs one of them, so
    another IPU's work goes on while it streams; the run ends after it. None (nothing placed) when the steps
    add up to more than ``cycles``; ``stretches``: ``run_stretches(program, target, replica)`` (or
    ``stream_stretches`` of them) if the caller keeps them. Returns the intervals."""
    label = {"replica": replica, **label}
    stretches = run_stretches(program, target, replica) if stretches is None else stretches
    rest = cycles - sum(stretch[1] for stretch in stretches)
    if rest < 0:
        return None
    everywhere = [compute_lane(replica, i) for i in ipus]
    placed, follows = [], []  # follows: the interval the next stretch starts after
    for (stage, direction, ipu, lanes, transfer), span, *names in [*stretches, [_step_key({}, replica), rest]]:
        tags = ({"transfer": transfer} if transfer else {}) | (names[0] if names else {})
        if stage is None:
            tags = tags or {"work": OUTSIDE_STAGES}
            resources = [*everywhere, *lanes]
        else:
            tags |= {"stage": stage, "pass": direction, "ipu": ipu}
            resources = [compute_lane(replica, ipu), *lanes]
        placed.append(timeline.add(resources, span, follows, not_before, **tags, **label))
        if tags.get("stream") != "out":
            follows = placed[-1:]
    return placed


def run_stretches(program, target, replica):
    """The stretches ``place_steps`` lays out for a run of ``program`` on ``replica``: ``(key, cycles)`` of
    consecutive steps with the same key (stage, pass, ipu, lanes, transfer; stage None for steps of no
    stage), with their syncs."""
    stretches = []
    sync, plain = target.bsp_sync_cycles, _step_key({}, replica)
    for step in program["steps"]:
        # Most steps hold nothing beside compute tiles: their key needs no work (one call runs this per step).
        key = _step_key(step, replica) if "stage" in step or "transfer" in step else plain
        if not stretches or stretches[-1][0] != key:
            stretches.append([key, 0])
        stretches[-1][1] += step["cycles"] + sync
    return [tuple(stretch) for stretch in stretches]


def stream_stretches(stretches, streams, replica):
    """``stretches`` (``run_stretches``) with a run's host ``streams`` (``(name, to_device, cycles, passes)``,
    see ``step_schedule``) at their program positions: an input just before the first stretch of the first of
    its passes in program order, an output just after the last stretch of the last of them, each holding the
    replica's host link and that stage's IPU; a stream with no pass among the stretches' holds every IPU, an
    input at the run's start, an output at its end. Each stream stretch is ``(key, cycles, label)``, its label
    the tensor's name and the stream's direction (``{"tensor": name, "stream": "in" or "out"}``)."""
    ipu_of = {key[0]: key[2] for key, *_ in stretches if key[0] is not None}
    link = (transfer_lane(replica, 0, HOST_TRANSFER),)
    where = {key[:2]: i for i, (key, *_) in enumerate(stretches)}  # (stage, pass) -> its last stretch
    first = {key[:2]: i for i, (key, *_) in reversed(list(enumerate(stretches)))}
    before, after = {}, {}  # stretch index -> the stream stretches placed before / after it
    for stream in _placed_streams(streams, sorted(ipu_of), keep_unplaced=True):
        unit = (stream.stage, stream.direction)
        placed = stream.stage is not None and unit in where
        key = (stream.stage, stream.direction, ipu_of[stream.stage]) if placed else (None, None, None)
        entry = ((*key, link, HOST_TRANSFER), stream.cycles, _stream_label(stream))
        if stream.to_device:
            before.setdefault(first[unit] if placed else 0, []).append(entry)
        else:
            after.setdefault(where[unit] if placed else len(stretches) - 1, []).append(entry)
    merged = [] if stretches else [*before.get(0, []), *after.get(-1, [])]
    for i, stretch in enumerate(stretches):
        merged += [*before.get(i, []), stretch, *after.get(i, [])]
    return merged


def place_shared_run(timeline, run_profile, target, replicas, ipus, cycles, not_before=0, **label):
    """Lay a run of ``cycles`` of the program of ``run_profile`` (a ``Profile.programs`` entry) that every one
    of ``replicas`` runs together (a training step's reduction and optimizer) out on ``timeline``: each
    stretch of its host-side transfers (streaming-memory loads and stores of optimizer state, host streams)
    on every replica's compute tiles and the transfer's lane of each replica, the rest of its ``cycles`` on
    every compute lane, in program order. One interval on every compute lane when the steps add up to more
    than ``cycles``. Returns the intervals."""
    everywhere = [compute_lane(r, i) for r in replicas for i in ipus]
    stretches = []  # [transfer kind or None, its IPU, cycles]
    for step in run_profile["steps"]:
        kind = step.get("transfer")
        if not stretches or stretches[-1][:2] != [kind, step.get("ipu", 0)]:
            stretches.append([kind, step.get("ipu", 0), 0])
        stretches[-1][2] += step["cycles"] + target.bsp_sync_cycles
    rest = cycles - sum(c for _, _, c in stretches)
    if rest < 0:
        return [timeline.add(everywhere, cycles, not_before=not_before, **label)]
    placed = []
    for kind, ipu, span in [*stretches, [None, 0, rest]]:
        lanes = [transfer_lane(r, ipu, kind) for r in replicas] if kind else []
        tags = {"transfer": kind} if kind else {}
        placed.append(timeline.add([*everywhere, *lanes], span, placed[-1:], not_before, **tags, **label))
    return placed


def _step_key(step, replica):
    """What a step holds beside compute tiles: ``(stage, pass, ipu, lanes, transfer)``, the first three None
    for a step of no stage; ``lanes`` its IPU-Links or its transfer's lane, ``transfer`` its kind if any."""
    transfer = step.get("transfer")
    if "stage" in step:
        lanes = _links(step, replica) + ((transfer_lane(replica, step["ipu"], transfer),) if transfer else ())
        return step["stage"], _pass_of(step), step["ipu"], lanes, transfer
    return None, None, None, (transfer_lane(replica, 0, transfer),) if transfer else (), transfer


def _link_pairs(step):
    """``(from IPU, to IPU)`` of the IPU-Links an exchange step's inter-IPU copies use: a copy merged into the
    sender's exchange goes from the step's IPU to the one it names; a copy into the step's IPU (the one it
    names, else the step's own) comes from each other IPU the step keeps busy."""
    own, busy = step["ipu"], step.get("ipus", ())
    destinations = copy_destinations(step.get("name", "")) or [own]
    return tuple((a, b) for b in destinations for a in ([own] if b != own else busy) if a != b)


def _links(step, replica):
    """The IPU-Link lanes an inter-IPU copy in the step holds."""
    return tuple(link_lane(replica, a, b) for a, b in _link_pairs(step))


def _phase_work(program, target, replica):
    """``{(phase, pass): {ipu: [[links, cycles, transfer, remote], ...]}}`` of a phased program's placed steps
    with their syncs, in the order the steps run: consecutive steps holding the same IPU-Links or transfer
    lane merged, a streaming-memory load (``remote`` "load") apart from a store ("store")."""
    work = {}
    for step in program["steps"]:
        if "stage" in step:
            pieces = work.setdefault((step["stage"], _pass_of(step)), {}).setdefault(step["ipu"], [])
            _, _, _, lanes, transfer = _step_key(step, replica)
            remote = _remote_direction(step)
            if not pieces or pieces[-1][0] != lanes or pieces[-1][3] != remote:
                pieces.append([lanes, 0, transfer, remote])
            pieces[-1][1] += step["cycles"] + target.bsp_sync_cycles
    return work


def _unplaced_work(program, target, replica):
    """``{unit index: [[lanes, cycles, transfer], ...]}`` of a phased program's steps of no phase with their
    syncs, each after the last unit (by index in order of first step, -1 before the first) begun before it:
    consecutive steps holding the same lanes (a host-side transfer's) merged."""
    work, units = {}, {}
    for step in program["steps"]:
        if "stage" in step:
            units.setdefault((step["stage"], _pass_of(step)), len(units))
            continue
        pieces = work.setdefault(len(units) - 1, [])
        lanes = _step_key(step, replica)[3]
        if not pieces or pieces[-1][0] != lanes:
            pieces.append([lanes, 0, step.get("transfer")])
        pieces[-1][1] += step["cycles"] + target.bsp_sync_cycles
    return work


def _remote_direction(step):
    """ "load" or "store" for a streaming-memory transfer step, else None."""
    if step.get("transfer") != STREAMING_MEMORY:
        return None
    return "store" if step.get("name", "").startswith(REMOTE_STORE) else "load"


def _total(work):
    return sum(piece[1] for unit in work.values() for pieces in unit.values() for piece in pieces)


def _run_order(cycles, edges):
    """The order to place the IPUs of one phase (``cycles``: {ipu: work}) and the edges to wait on: the
    reads ``edges`` (from, to) in topological order, or, when they form a cycle, every IPU after the one
    before it in IPU order."""
    graph = graphlib.TopologicalSorter({ipu: {a for a, b in edges if b == ipu} for ipu in cycles})
    try:
        return list(graph.static_order()), edges
    except graphlib.CycleError:
        order = sorted(cycles)
        return order, set(zip(order, order[1:]))


def place_pipeline(timeline, schedule, replica, ipus, not_before=0, **label):
    """Lay one group of ``schedule.micro_batches`` pipelined runs on ``ipus`` of ``replica`` out on
    ``timeline``, pipeline cycle by pipeline cycle (see the module's docstring): each stage's pass of a
    micro-batch on its IPU's lane (its host streams in before it and out after it, on the host link too) after
    the sync that began the cycle, the previous stage's forward (the next stage's backward, or its own forward
    for the last stage) of that micro-batch and its IPU's work before it;
    then the cycle's inter-IPU copies, each on its destination IPU and its IPU-Links, once every IPU's work in
    the cycle is done; then a sync of every IPU. The steps of no stage follow on every IPU. Returns the
    intervals."""
    label = {"replica": replica, **label}
    lanes = [compute_lane(replica, ipu) for ipu in ipus]
    sync = timeline.add(lanes, 0, not_before=not_before)
    work, placed = {}, []  # work: (stage, pass, micro-batch) -> its interval
    for cycle in range(-1, _last_cycle(schedule) + 1):  # cycle -1: copies feeding cycle 0, if any
        done = []
        for stage, direction, batch in _cycle_work(schedule, cycle):
            ipu = schedule.stage_ipu[stage]
            tags = {"stage": stage, "micro_batch": batch, "ipu": ipu, "pass": direction, "pipeline_cycle": cycle}
            after = [sync, *(work[d] for d in _feeds(schedule, stage, direction, batch) if d in work)]
            for transfer, cycles, names in _pass_pieces(schedule, stage, direction):
                resources = [compute_lane(replica, ipu)] + ([transfer_lane(replica, ipu, transfer)] if transfer else [])
                kind = ({"transfer": transfer} if transfer else {}) | names
                done.append(timeline.add(resources, cycles, after, **tags, **kind, **label))
                after = [done[-1]]
            work[(stage, direction, batch)] = done[-1]
        copies = [
            _place_copy(timeline, schedule, copy, batch, cycle, [sync, *done], replica, label)
            for copy, batch in _cycle_copies(schedule, cycle)
        ]
        placed += done + copies
        sync = timeline.add(lanes, 0, [sync, *done, *copies])  # the cycle's end, on every IPU
    outside = schedule.micro_batches * schedule.outside_cycles
    placed.append(timeline.add(lanes, outside, [sync], work=OUTSIDE_STAGES, **label))
    return placed


def _pass_pieces(schedule, stage, direction):
    """``(transfer kind or None, cycles, extra label)`` of one micro-batch's ``stage`` ``direction`` pass in
    order: the host streams of its inputs, its compute and host-side transfers, the streams of its outputs."""
    pieces = [(None, 0, {})]
    if (stage, direction) in schedule.pieces:
        pieces = [(kind, cycles, {}) for kind, cycles in schedule.pieces[(stage, direction)]]
    return [
        *((HOST_TRANSFER, s.cycles, _stream_label(s)) for s in schedule.streams_of(stage, direction, True)),
        *pieces,
        *((HOST_TRANSFER, s.cycles, _stream_label(s)) for s in schedule.streams_of(stage, direction, False)),
    ]


def _place_copy(timeline, schedule, copy, batch, cycle, after, replica, label):
    """One micro-batch's ``copy`` at the end of pipeline ``cycle``: on the IPUs it lands on and its links."""
    destinations = sorted({b for _, b in copy.links})
    resources = [compute_lane(replica, b) for b in destinations] + [link_lane(replica, a, b) for a, b in copy.links]
    tags = {"stage": copy.stage, "micro_batch": batch, "pass": copy.direction, "pipeline_cycle": cycle}
    tags |= {"ipu": destinations[0], "transfer": COPY}
    return timeline.add(resources, copy.cycles, after, **tags, **label)


def _last_cycle(schedule):
    """The last pipeline cycle with work in it."""
    last = schedule.micro_batches - 1
    return max(
        (schedule.pipeline_cycle(s, d, last) for s in schedule.stages for d in PASSES if schedule.has_work(s, d)),
        default=-1,
    )


def _cycle_work(schedule, cycle):
    """``(stage, pass, micro-batch)`` of the stages' work in pipeline ``cycle``, in PopART's order of pipeline
    stages: the forward passes by stage, then the backward passes from the last stage."""
    order = [(s, "forward") for s in schedule.stages] + [(s, "backward") for s in reversed(schedule.stages)]
    for stage, direction in order:
        batch = cycle - schedule.pipeline_cycle(stage, direction, 0)
        streamed = schedule.streams_of(stage, direction, True) + schedule.streams_of(stage, direction, False)
        if 0 <= batch < schedule.micro_batches and (schedule.cycles_of(stage, direction) or streamed):
            yield stage, direction, batch


def _cycle_copies(schedule, cycle):
    """``(Copy, micro-batch)`` of the inter-IPU copies at the end of pipeline ``cycle``: those feeding the
    next cycle's passes and those sending this cycle's results."""
    for copy in schedule.copies:
        batch = cycle + (1 if copy.before else 0) - schedule.pipeline_cycle(copy.stage, copy.direction, 0)
        if 0 <= batch < schedule.micro_batches:
            yield copy, batch


def _feeds(schedule, stage, direction, batch):
    """The work ``(stage, pass, micro-batch)`` whose results ``stage``'s ``direction`` pass of ``batch`` reads:
    the previous stage's forward, the next stage's backward, the last stage's own forward."""
    stages, k = schedule.stages, schedule.stages.index(stage)
    if direction == "forward":
        return [(stages[k - 1], "forward", batch)] if k > 0 else []
    if k + 1 < len(stages):
        return [(stages[k + 1], "backward", batch)]
    return [(stage, "forward", batch)]


def _pass_of(step):
    return "forward" if step.get("role") in (None, "forward") else "backward"
