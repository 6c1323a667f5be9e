"""The multi-IPU schedule of a program run once per micro-batch: its stages run one after another (sharded)
or overlapped over the IPUs (pipelined, GPipe-style with gradient accumulation).

Each profile step of a placed node names its (stage, IPU) and role; a stage's forward cycles per micro-batch
are those of its forward steps with their syncs, its backward cycles those of the rest (gradients and the
accumulation into them). Steps of no stage (host transfers, control, unplaced work) run once per micro-batch
outside the pipeline.

Pipelined, ``M`` micro-batches over ``S`` stages take ``M + S - 1`` forward slots, then ``M + S - 1``
backward slots, each as long as the busiest IPU's forward (backward) work on one micro-batch: while IPU k
runs the forward of micro-batch i, IPU k+1 runs that of micro-batch i-1, and the backward wave runs the other
way. The ``S - 1`` forward slots before every IPU is busy are the ramp-up, the ``S - 1`` backward slots after
the first IPU is done the ramp-down.
"""

import graphlib
from dataclasses import dataclass, field

import numpy as np

from popsim.timeline import Timeline, compute_lane, link_lane

# Labels of the timeline intervals of a run's steps in no phase or stage (host transfers, control).
OUTSIDE_PHASES, OUTSIDE_STAGES = "outside phases", "outside stages"


@dataclass(frozen=True)
class Schedule:
    """Cycles of one step of ``micro_batches`` runs of a program over its stages."""

    micro_batches: int
    pipelined: bool
    forward_cycles: dict = field(default_factory=dict)  # stage -> forward cycles per micro-batch
    backward_cycles: dict = field(default_factory=dict)  # stage -> backward cycles per micro-batch
    stage_ipu: dict = field(default_factory=dict)  # stage -> IPU
    outside_cycles: int = 0  # per micro-batch, in no stage
    forward_slot: int = 0  # the busiest IPU's forward cycles per micro-batch
    backward_slot: int = 0  # the busiest IPU's backward cycles per micro-batch

    @property
    def stages(self):
        return sorted(self.stage_ipu)

    @property
    def ramp_up_cycles(self):
        """Forward slots before the last stage starts (0 when not pipelined)."""
        return (len(self.stage_ipu) - 1) * self.forward_slot if self.pipelined else 0

    @property
    def ramp_down_cycles(self):
        """Backward slots after the last stage's backward is done (0 when not pipelined)."""
        return (len(self.stage_ipu) - 1) * self.backward_slot if self.pipelined else 0

    @property
    def main_cycles(self):
        """The slots in which every IPU works (pipelined)."""
        return self.micro_batches * (self.forward_slot + self.backward_slot) if self.pipelined else 0

    @property
    def serial_cycles(self):
        """The step's cycles with the stages run one after another (sharded)."""
        staged = sum(self.forward_cycles.values()) + sum(self.backward_cycles.values())
        return self.micro_batches * (staged + self.outside_cycles)

    @property
    def total_cycles(self):
        """The step's cycles under this schedule."""
        if not self.pipelined:
            return self.serial_cycles
        return self.ramp_up_cycles + self.main_cycles + self.ramp_down_cycles + self.micro_batches * self.outside_cycles

    def timeline(self):
        """When each stage works on each micro-batch: dicts of ipu, stage, micro_batch, pass ("forward" or
        "backward"), start and end cycles within the step (work outside the stages is not listed)."""
        if self.pipelined:
            return self._pipelined_timeline()
        entries, now = [], 0
        order = [(s, "forward") for s in self.stages] + [(s, "backward") for s in reversed(self.stages)]
        for batch in range(self.micro_batches):
            for stage, direction in order:
                cycles = (self.forward_cycles if direction == "forward" else self.backward_cycles).get(stage, 0)
                if cycles:
                    entries.append(self._entry(stage, batch, direction, now, now + cycles))
                    now += cycles
            now += self.outside_cycles
        return entries

    def _pipelined_timeline(self):
        # Forward of micro-batch i on the k-th stage in slot i + k; the backward wave runs from the last stage.
        entries, count = [], len(self.stages)
        backward_start = (self.micro_batches + count - 1) * self.forward_slot
        for k, stage in enumerate(self.stages):
            for batch in range(self.micro_batches):
                start = (batch + k) * self.forward_slot
                entries.append(self._entry(stage, batch, "forward", start, start + self.forward_cycles.get(stage, 0)))
                start = backward_start + (batch + count - 1 - k) * self.backward_slot
                end = start + self.backward_cycles.get(stage, 0)
                entries.append(self._entry(stage, batch, "backward", start, end))
        return sorted(entries, key=lambda e: (e["start"], e["ipu"]))

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
        """The schedule for a profile: per stage its IPU and cycles per micro-batch, the phases' cycles."""
        return {
            "micro_batches": self.micro_batches,
            "pipelined": self.pipelined,
            "stages": {
                s: {
                    "ipu": self.stage_ipu[s],
                    "forward_cycles": self.forward_cycles.get(s, 0),
                    "backward_cycles": self.backward_cycles.get(s, 0),
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


def step_schedule(program, target, micro_batches, pipelined):
    """The Schedule of ``micro_batches`` runs of ``program`` (a ``Profile.programs`` entry) compiled for
    ``target`` (its graph target), pipelined or sharded."""
    passes = {"forward": {}, "backward": {}}
    stage_ipu = {}
    for step in program["steps"]:
        if "stage" not in step:
            continue
        cycles = passes["forward" if step.get("role") in (None, "forward") else "backward"]
        cycles[step["stage"]] = cycles.get(step["stage"], 0) + step["cycles"] + target.bsp_sync_cycles
        stage_ipu[step["stage"]] = step["ipu"]
    staged = sum(sum(c.values()) for c in passes.values())
    return Schedule(
        micro_batches,
        pipelined,
        passes["forward"],
        passes["backward"],
        stage_ipu,
        max(0, program["total_cycles"] - staged),
        _busiest(passes["forward"], stage_ipu),
        _busiest(passes["backward"], stage_ipu),
    )


def _busiest(stage_cycles, stage_ipu):
    """The largest total over the stages of one IPU."""
    per_ipu = {}
    for stage, cycles in stage_cycles.items():
        per_ipu[stage_ipu[stage]] = per_ipu.get(stage_ipu[stage], 0) + cycles
    return max(per_ipu.values(), default=0)


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


def phase_schedule(program, target, depends):
    """The cycles of one run of a phased ``program`` (a ``Profile.programs`` entry; each placed step's
    ``stage`` is its phase) compiled for ``target``, as ``place_phases`` lays it out on a Timeline of its own
    (see there). Returns a dict with the serial and scheduled cycles and a timeline of each phase's IPUs."""
    timeline = Timeline()
    work = _phase_work(program, target, 0)
    ipus = {ipu for unit in work.values() for ipu in unit} | {0}
    place_phases(timeline, program, target, depends, 0, sorted(ipus))
    spans = {}  # (phase, pass, ipu) -> [start, end] over its pieces
    for i in timeline.intervals:
        if "phase" in i.label:
            span = spans.setdefault((i.label["phase"], i.label["pass"], i.label["ipu"]), [i.start, i.end])
            span[:] = min(span[0], i.start), max(span[1], i.end)
    entries = [{"phase": p, "pass": d, "ipu": u, "start": a, "end": b} for (p, d, u), (a, b) in spans.items()]
    return {
        "serial_cycles": max(_total(work), program["total_cycles"]),
        "total_cycles": timeline.makespan,
        "timeline": sorted(entries, key=lambda e: (e["start"], e["ipu"])),
    }


def place_phases(timeline, program, target, depends, replica, ipus, not_before=0, extra_cycles=0, **label):
    """Lay one run of a phased ``program`` on ``ipus`` of ``replica`` out on ``timeline``. The phases run one
    after another, forward then backward as the steps order them; within one phase and pass, each IPU's work
    (its steps with their syncs, the inter-IPU copies into it included, which also hold their IPU-Links)
    starts once the IPUs it reads from are done (``depends``: ``(phase, pass, from_ipu, to_ipu)``), so a
    phase costs its critical path; IPUs that read each other both ways run one after another. The steps of
    no phase (host transfers, control), plus ``extra_cycles``, follow on every IPU. Returns the intervals."""
    label = {"replica": replica, **label}
    work = _phase_work(program, target, replica)
    outside = max(0, program["total_cycles"] - _total(work))
    placed, previous = [], []
    for (phase, direction), unit in work.items():
        edges = {(a, b) for p, d, a, b in depends if (p, d) == (phase, direction) and a in unit and b in unit}
        order, edges = _run_order(unit, edges)
        done = {}
        for ipu in order:
            after = previous + [done[a] for a, b in edges if b == ipu]
            for links, cycles in unit[ipu]:  # one after another on the IPU's lane
                resources = [compute_lane(replica, ipu), *links]
                tags = {"phase": phase, "pass": direction, "ipu": ipu}
                done[ipu] = timeline.add(resources, cycles, after, not_before, **tags, **label)
                placed.append(done[ipu])
        previous = list(done.values())
    lanes = [compute_lane(replica, i) for i in ipus]
    rest = outside + extra_cycles
    placed.append(timeline.add(lanes, rest, previous, not_before, work=OUTSIDE_PHASES, **label))
    return placed


def place_steps(timeline, program, target, replica, ipus, cycles, not_before=0, **label):
    """Lay one run of ``cycles`` of a sharded ``program`` on ``ipus`` of ``replica`` out on ``timeline`` in
    program order: each stretch of steps of one stage, IPU and pass on that IPU's lane (an inter-IPU copy on
    its IPU-Links too), each after the one before; steps of no stage, and what the run's ``cycles`` have
    beyond the steps (control, host), on every IPU. None (nothing placed) when the steps add up to more than
    ``cycles``. Returns the intervals."""
    label = {"replica": replica, **label}
    stretches = []  # [key, cycles]: key (stage, pass, ipu, links), or None for steps of no stage
    for step in program["steps"]:
        key = (step["stage"], _pass_of(step), step["ipu"], _links(step, replica)) if "stage" in step else None
        if not stretches or stretches[-1][0] != key:
            stretches.append([key, 0])
        stretches[-1][1] += step["cycles"] + target.bsp_sync_cycles
    rest = cycles - sum(c for _, c in stretches)
    if rest < 0:
        return None
    everywhere = [compute_lane(replica, i) for i in ipus]
    placed = []
    for key, span in [*stretches, [None, rest]]:
        after = placed[-1:]
        if key is None:
            placed.append(timeline.add(everywhere, span, after, not_before, work=OUTSIDE_STAGES, **label))
        else:
            stage, direction, ipu, links = key
            tags = {"stage": stage, "pass": direction, "ipu": ipu}
            placed.append(timeline.add([compute_lane(replica, ipu), *links], span, after, not_before, **tags, **label))
    return placed


def _links(step, replica):
    """The IPU-Link lanes an inter-IPU copy into the step's IPU holds (from each other IPU it keeps busy)."""
    return tuple(link_lane(replica, other, step["ipu"]) for other in step.get("ipus", ()) if other != step["ipu"])


def _phase_work(program, target, replica):
    """``{(phase, pass): {ipu: [[links, cycles], ...]}}`` of a phased program's placed steps with their syncs,
    in the order the steps run: consecutive steps holding the same IPU-Links merged."""
    work = {}
    for step in program["steps"]:
        if "stage" in step:
            pieces = work.setdefault((step["stage"], _pass_of(step)), {}).setdefault(step["ipu"], [])
            links = _links(step, replica)
            if not pieces or pieces[-1][0] != links:
                pieces.append([links, 0])
            pieces[-1][1] += step["cycles"] + target.bsp_sync_cycles
    return work


def _total(work):
    return sum(cycles for unit in work.values() for pieces in unit.values() for _, cycles in pieces)


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
    ``timeline``, pipeline cycle by pipeline cycle: in forward cycle t the k-th stage runs micro-batch t - k,
    in backward cycle t micro-batch t - (S - 1 - k), each after the sync that ended the cycle before (the
    inter-IPU copies between stages happen at that sync). A cycle is a superstep of all the IPUs as long as
    the busiest IPU's slot (ramp-up and ramp-down cycles run the same program with stages idle). The steps of
    no stage follow on every IPU. Returns the intervals."""
    label = {"replica": replica, **label}
    lanes = [compute_lane(replica, ipu) for ipu in ipus]
    stages, count = schedule.stages, len(schedule.stage_ipu)
    sync = timeline.add(lanes, 0, not_before=not_before)
    placed = []
    for direction, cycles, slot in (
        ("forward", schedule.forward_cycles, schedule.forward_slot),
        ("backward", schedule.backward_cycles, schedule.backward_slot),
    ):
        for cycle in range(schedule.micro_batches + count - 1):
            for k, stage in enumerate(stages):
                batch = cycle - (k if direction == "forward" else count - 1 - k)
                if 0 <= batch < schedule.micro_batches and cycles.get(stage, 0):
                    ipu = schedule.stage_ipu[stage]
                    tags = {"stage": stage, "micro_batch": batch, "ipu": ipu, "pass": direction}
                    placed.append(timeline.add([compute_lane(replica, ipu)], cycles[stage], [sync], **tags, **label))
            sync = timeline.add(lanes, 0, not_before=sync.end + slot)  # the cycle's end, on every IPU
    outside = schedule.micro_batches * schedule.outside_cycles
    placed.append(timeline.add(lanes, outside, [sync], work=OUTSIDE_STAGES, **label))
    return placed


def _pass_of(step):
    return "forward" if step.get("role") in (None, "forward") else "backward"
