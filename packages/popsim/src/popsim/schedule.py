"""The multi-IPU schedule of a program run once per micro-batch: its stages run one after another (sharded)
or overlapped over the IPUs (pipelined, GPipe-style with gradient accumulation).

Each profile step of a placed node names its (stage, IPU); a stage's cycles per micro-batch are those of its
steps with their syncs. Steps of no stage (host transfers, control, unplaced work) run once per micro-batch
outside the pipeline.

Pipelined, a step of ``M`` micro-batches over ``S`` stages takes ``M + S - 1`` slots, each as long as the
busiest IPU's work on one micro-batch (all its stages): while IPU k works on micro-batch i, IPU k+1 works on
micro-batch i-1. The ``S - 1`` extra slots are the pipeline's bubbles, filled at ramp-up and drained at
ramp-down; a stage's forward and backward are not told apart, so the bubbles are split evenly between the two.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Schedule:
    """Cycles of one step of ``micro_batches`` runs of a program over its stages."""

    micro_batches: int
    pipelined: bool
    stage_cycles: dict = field(default_factory=dict)  # stage -> cycles per micro-batch
    stage_ipu: dict = field(default_factory=dict)  # stage -> IPU
    outside_cycles: int = 0  # per micro-batch, in no stage
    slot_cycles: int = 0  # the busiest IPU's cycles per micro-batch
    ramp_up_cycles: int = 0
    main_cycles: int = 0
    ramp_down_cycles: int = 0

    @property
    def serial_cycles(self):
        """The step's cycles with the stages run one after another (sharded)."""
        return self.micro_batches * (sum(self.stage_cycles.values()) + self.outside_cycles)

    @property
    def total_cycles(self):
        """The step's cycles under this schedule."""
        if not self.pipelined:
            return self.serial_cycles
        return self.ramp_up_cycles + self.main_cycles + self.ramp_down_cycles + self.micro_batches * self.outside_cycles

    def as_dict(self):
        """The schedule for a profile: per stage its IPU and cycles per micro-batch, the phases' cycles."""
        return {
            "micro_batches": self.micro_batches,
            "pipelined": self.pipelined,
            "stages": {s: {"ipu": self.stage_ipu[s], "cycles": c} for s, c in sorted(self.stage_cycles.items())},
            "outside_stages_cycles": self.outside_cycles,
            "ramp_up_cycles": self.ramp_up_cycles,
            "main_cycles": self.main_cycles,
            "ramp_down_cycles": self.ramp_down_cycles,
            "serial_cycles": self.serial_cycles,
            "total_cycles": self.total_cycles,
        }


def step_schedule(program, target, micro_batches, pipelined):
    """The Schedule of ``micro_batches`` runs of ``program`` (a ``Profile.programs`` entry) compiled for
    ``target`` (its graph target), pipelined or sharded."""
    stage_cycles, stage_ipu = {}, {}
    for step in program["steps"]:
        if "stage" not in step:
            continue
        stage = step["stage"]
        stage_cycles[stage] = stage_cycles.get(stage, 0) + step["cycles"] + target.bsp_sync_cycles
        stage_ipu[stage] = step["ipu"]
    outside = max(0, program["total_cycles"] - sum(stage_cycles.values()))
    ipu_cycles = {}
    for stage, cycles in stage_cycles.items():
        ipu_cycles[stage_ipu[stage]] = ipu_cycles.get(stage_ipu[stage], 0) + cycles
    slot = max(ipu_cycles.values(), default=0)
    bubbles = (len(stage_cycles) - 1) * slot if pipelined else 0
    return Schedule(
        micro_batches,
        pipelined,
        stage_cycles,
        stage_ipu,
        outside,
        slot,
        ramp_up_cycles=bubbles // 2,
        main_cycles=micro_batches * slot,
        ramp_down_cycles=bubbles - bubbles // 2,
    )
