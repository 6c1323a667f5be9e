"""Multi-IPU annotations: blocks (``BeginBlock``, ``Block``, ``BlockFunction``, the older ``IPU`` wrapper),
stages and phases, and the execution strategies that map blocks to pipeline stages and IPUs.

Outside capture every annotation is a no-op, so the model runs unchanged on the CPU. While the executor
captures the model (``recording``), beginning a block resolves it, through the strategy's stage manager, to
a (pipeline stage, IPU) placement and tags every fx node torch.export records from then on with it: a block
lasts until the next one begins (ops after a ``with Block`` stay on it), and ops before the first block run
on IPU 0. The capture turns the tags into each popir node's ``placement``.
"""

import contextlib
import enum
from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback

from poptorch._marker_ops import define_marker
from poptorch.errors import Error

# The fx node meta key (under "custom") holding a node's (stage, IPU) placement.
PLACEMENT_KEY = "poptorch_placement"
# The largest simulated device: an IPU-POD64 (64 IPUs).
MAX_IPUS = 64


class AutoStage(enum.IntEnum):
    """How a strategy without explicit stages numbers them: after the block's IPU (SameAsIpu, the default)
    or in the order blocks first run (AutoIncrement)."""

    SameAsIpu = 0
    AutoIncrement = 1


class Liveness(enum.IntEnum):
    """Where phased execution keeps tensors between phases."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


def _check_ipu_id(ipu_id):
    if ipu_id is None:
        return None
    if isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0:
        raise Error(f"ipu_id must be either a positive integer or None, got {ipu_id!r}")
    if ipu_id >= MAX_IPUS:
        raise Error(
            f"ipu_id {ipu_id} is beyond the device: the simulator's largest device is an IPU-POD64 "
            f"(IPUs 0 to {MAX_IPUS - 1})"
        )
    return ipu_id


def _check_user_id(user_id):
    if user_id is not None and not isinstance(user_id, str):
        raise Error(f"A block's user_id must be a string or None, got {user_id!r}")
    return user_id


class Stage:
    """A pipeline stage: one or more blocks (by ``user_id``) that run on one IPU."""

    def __init__(self, *block_ids):
        if not all(isinstance(b, str) for b in block_ids):
            raise Error(f"Block IDs are supposed to be strings but got {block_ids}")
        self._blocks = block_ids
        self._stage_id = -1
        self._phase_id = -1
        self._ipu = None

    @property
    def blocks(self):
        """The block IDs this stage is made of."""
        return self._blocks

    def ipu(self, ipu):
        """Run this stage on IPU ``ipu`` (overrides the blocks' own ``ipu_id``)."""
        self._ipu = _check_ipu_id(ipu)
        return self

    def __repr__(self):
        return f"Stage({', '.join(map(repr, self._blocks))}, stage={self._stage_id}, ipu={self._ipu})"


class Phase:
    """An execution phase of a phased strategy: stages run in parallel, each on its IPU."""

    def __init__(self, *args):
        if args and all(isinstance(a, Stage) for a in args):
            self.stages = list(args)
        elif all(isinstance(a, str) for a in args):
            self.stages = [Stage(*args)]
        else:
            raise Error(f"All arguments must either be block IDs (strings) or Stages: {[type(a) for a in args]}")

    def stage(self, idx):
        """The ``idx``-th stage of this phase."""
        return self.stages[idx]

    def ipus(self, *ipus):
        """One IPU per stage of this phase."""
        if len(ipus) != len(self.stages):
            raise Error(f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)
        return self


class _StageManager:
    """Resolves each block (by user_id, as it begins) to its Stage, as the strategy says."""

    def __init__(self, block_map, auto_stage):
        self._block_map = block_map
        self._auto_stage = auto_stage
        self._next_stage = 1
        self._next_auto_id = 0

    def next_auto_id(self):
        auto_id = str(self._next_auto_id)
        self._next_auto_id += 1
        return auto_id

    def reset_auto_id(self):
        self._next_auto_id = 0

    def stage_of(self, user_id, ipu_id):
        if user_id in self._block_map:
            return self._block_map[user_id]
        if self._auto_stage is None:
            raise Error(f"Unknown Block '{user_id}' list of expected Blocks: {list(self._block_map)}")
        stage = Stage(user_id)
        if self._auto_stage == AutoStage.SameAsIpu:
            if ipu_id is None:
                raise Error(f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for block {user_id}")
            stage._stage_id = ipu_id
        else:
            stage._stage_id = self._next_stage
            self._next_stage += 1
        self._block_map[user_id] = stage
        return stage


class _ExecutionStrategy:
    """What every strategy holds: the block -> stage map and how unlisted blocks get a stage."""

    pipelined = False

    def __init__(self, block_map, auto_stage):
        self._block_map = block_map
        self._auto_stage = auto_stage

    def stage(self, block_id):
        """The Stage ``block_id`` belongs to."""
        if block_id not in self._block_map:
            raise Error(f"Unknown block {block_id}")
        return self._block_map[block_id]

    def _manager(self):
        # Stages the strategy lists keep their numbers; auto stages are numbered afresh for each capture.
        return _StageManager(dict(self._block_map), self._auto_stage)

    def __repr__(self):
        stages = list(dict.fromkeys(self._block_map.values()))
        args = [repr(s) for s in stages] or (
            [f"AutoStage.{self._auto_stage.name}"] if self._auto_stage is not None else []
        )
        return f"{type(self).__name__}({', '.join(args)})"


def _stages_from(args):
    """{block id: Stage} of a strategy's explicit arguments (Stages, block IDs or lists of block IDs)."""
    block_map = {}
    for stage_id, arg in enumerate(args):
        if isinstance(arg, Stage):
            stage = arg
        elif isinstance(arg, str):
            stage = Stage(arg)
        elif isinstance(arg, list | tuple):
            stage = Stage(*arg)
        else:
            raise Error(f"A strategy takes an AutoStage, Stages or block IDs, got {arg!r}")
        stage._stage_id = stage_id
        for block in stage.blocks:
            if block in block_map:
                raise Error(f"{block} associated with more than one stage")
            block_map[block] = stage
    return block_map


class PipelinedExecution(_ExecutionStrategy):
    """Pipeline the stages over their IPUs (the default when blocks are used): each IPU runs its stage on one
    micro-batch while the others run theirs on other micro-batches. Takes an ``AutoStage`` or the stages
    (Stages, block IDs or lists of block IDs) in order."""

    pipelined = True

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], AutoStage):
            super().__init__({}, args[0])
        elif args:
            super().__init__(_stages_from(args), None)
        else:
            super().__init__({}, AutoStage.SameAsIpu)


class ShardedExecution(PipelinedExecution):
    """Run the stages one after another, each on its IPU (no overlap between IPUs)."""

    pipelined = False


class _PhasedExecution(_ExecutionStrategy):
    """Phased execution: the phases run one after another, each stage on its IPU. ``Liveness`` says which
    activations wait in streaming memory (see ``spill_mode``). A phase's stages on different IPUs run at the
    same time unless one reads another's values (``popsim.place_phases``); streaming-memory transfers overlap
    the neighbouring phases' compute with ``Liveness.OffChipAfterFwd`` only (see ``overlaps_streaming``)."""

    def __init__(self, *phases):
        if not phases:
            raise Error("There is currently no AutoStage for PhasedExecution, please explicitly specify the phases")
        self._phases = []
        block_map = {}
        for phase_id, arg in enumerate(phases):
            phase = arg if isinstance(arg, Phase) else Phase(*(arg if isinstance(arg, list) else [arg]))
            self._phases.append(phase)
            for stage in phase.stages:
                stage._phase_id = phase_id
                for block in stage.blocks:
                    if block in block_map:
                        raise Error(f"{block} associated with more than one stage")
                    block_map[block] = stage
        self._liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False
        super().__init__(block_map, None)

    def phase(self, phase):
        """The ``phase``-th Phase."""
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use=True):
        """Run the backward pass in phases of its own: by default the last forward phase also runs the start of
        the backward pass (phases 0, 1, 2 forward, 2, 3, 4 backward); with ``use`` no phase holds both passes
        (0, 1, 2 forward, 4, 5, 6 backward), so a streamed variable of the last phase is loaded again for the
        backward pass (see ``shares_last_phase``)."""
        self._separate_backward_phase = bool(use)
        return self


class SerialPhasedExecution(_PhasedExecution):
    """All phases run one after another on one group of IPUs."""

    def setTensorsLiveness(self, liveness):
        """Where tensors live between phases (a ``poptorch.Liveness``)."""
        if not isinstance(liveness, Liveness):
            raise Error(f"setTensorsLiveness takes a poptorch.Liveness, got {liveness!r}")
        self._liveness = liveness
        return self


class ParallelPhasedExecution(_PhasedExecution):
    """Phases alternate between two groups of IPUs."""

    def sendTensorsOffChipAfterFwd(self, off_chip=True):
        """Move tensors to streaming memory after the forward pass."""
        self._liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        return self


STRATEGIES = (PipelinedExecution, ShardedExecution, SerialPhasedExecution, ParallelPhasedExecution)

# popsim's activation spill mode for each Liveness: AlwaysLive keeps every tensor on the chip; OffChipAfterFwd
# (with or without overlap, see overlaps_streaming) parks the forward values the backward pass reads in
# streaming memory; OffChipAfterEachPhase parks every value read outside its phase.
_SPILL = {
    Liveness.AlwaysLive: None,
    Liveness.OffChipAfterFwd: "backward",
    Liveness.OffChipAfterFwdNoOverlap: "backward",
    Liveness.OffChipAfterEachPhase: "phase",
}


def shares_last_phase(strategy):
    """Whether phased ``strategy`` runs the end of the forward pass and the start of the backward pass in one
    phase (PopTorch's default with ``Liveness.AlwaysLive``); ``useSeparateBackwardPhase(True)`` starts the
    backward pass in a phase of its own, and so do the off-chip liveness settings (PopTorch leaves a gap of
    phases between the passes so that tensors can go off chip)."""
    return (
        isinstance(strategy, _PhasedExecution)
        and strategy._liveness == Liveness.AlwaysLive
        and not strategy._separate_backward_phase
    )


def overlaps_streaming(strategy):
    """Whether phased ``strategy``'s streaming-memory loads and stores overlap the neighbouring phases' compute:
    with ``Liveness.OffChipAfterFwd``, not ``OffChipAfterFwdNoOverlap`` ("no overlapping of load and store
    operations between phases", more memory-efficient at the cost of delayed computation)."""
    return isinstance(strategy, _PhasedExecution) and strategy._liveness == Liveness.OffChipAfterFwd


def is_phased(strategy):
    """Whether execution strategy ``strategy`` is SerialPhasedExecution or ParallelPhasedExecution."""
    return isinstance(strategy, _PhasedExecution)


def update_placements(grads, strategy):
    """{parameter: placement} for its optimizer update under phased ``strategy`` (``grads``: {name: gradient
    Value}): the phase and IPU whose backward pass produced its gradient, as PopART updates a weight in that
    phase, so a streamed weight loaded there for the backward pass serves its update too. Empty for other
    strategies, whose updates stay unplaced (on their operands' IPU)."""
    if not is_phased(strategy):
        return {}
    return {name: g.producer.placement for name, g in grads.items() if g.producer is not None}


def accumulation_placement(gradient):
    """The placement of the accumulation of ``gradient`` (a Value) over micro-batches: that of the pass that
    produced it (None: unplaced)."""
    return gradient.producer.placement if gradient.producer is not None else None


def order_updates(graph):
    """Reorder ``graph``'s nodes so that each optimizer node runs as early in the backward pass as its operands
    allow and once the forward and backward passes have done reading the values it reads (a weight is updated
    in place only after its last reader): a placed update so runs in its gradient's phase, as PopART runs a
    weight's update there, and its gradient dies at once instead of living to the end of the phase. A stable
    sort, so every node still follows its operands."""
    nodes = graph.nodes
    start = next((i for i, n in enumerate(nodes) if n.role not in (None, "forward")), len(nodes))
    last_read = {v.id: i for i, n in enumerate(nodes) if n.role != "optimizer" for v in n.inputs}
    slot_of = {}  # value id -> slot of its producer
    slots = []
    for i, node in enumerate(nodes):
        if node.role != "optimizer":
            slot = i
        else:
            operands = [slot_of[v.id] for v in node.inputs if v.id in slot_of]
            slot = max([start, *operands, *(last_read[v.id] for v in node.inputs if v.id in last_read)])
        slots.append(slot)
        slot_of.update((v.id, slot) for v in node.outputs)
    graph.nodes = [node for _, _, node in sorted(zip(slots, range(len(nodes)), nodes), key=lambda t: t[:2])]


def spill_mode(strategy):
    """popsim's ``spill`` mode for execution strategy ``strategy`` (None unless phased with an off-chip
    ``Liveness``)."""
    return _SPILL[strategy._liveness] if isinstance(strategy, _PhasedExecution) else None


# -- recording during capture ---------------------------------------------------------------------------
class _Recorder:
    """The blocks begun while one capture runs: the stage manager and the (stage, IPU) of each block."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.manager = strategy._manager()
        self.current = None  # the user_id of the block begun last

    def begin(self, user_id, ipu_id):
        user_id = user_id or self.manager.next_auto_id()
        stage = self.manager.stage_of(user_id, ipu_id)
        ipu = stage._ipu if stage._ipu is not None else ipu_id
        phased = stage._phase_id >= 0
        if ipu is None:
            if phased:
                raise Error(
                    f"No IPU for block {user_id} of phase {stage._phase_id}: give it with Stage(...).ipu(n), "
                    "Phase(...).ipus(...) or the block's ipu_id"
                )
            ipu = stage._stage_id
        _check_ipu_id(ipu)
        if phased and isinstance(self.strategy, ParallelPhasedExecution) and stage._phase_id % 2 != ipu % 2:
            raise Error(
                "When phases are executed in parallel: even phases must run on even IPUs and odd phases on odd "
                f"IPUs (block {user_id} of phase {stage._phase_id} is on IPU {ipu}): give it an IPU of the phase's "
                "parity, or use SerialPhasedExecution"
            )
        self.current = user_id
        self._tag((stage._phase_id if phased else stage._stage_id, ipu))

    def end(self):
        """A ``with Block`` ended: ops recorded before the next block begins have no block."""
        self._tag(_Ended(self.current))

    @staticmethod
    def _tag(placement):
        # A fresh dict each time: nodes recorded earlier keep the placement they were made under.
        custom = dict(fx_traceback.current_meta.get("custom", {}))
        custom[PLACEMENT_KEY] = placement
        fx_traceback.current_meta["custom"] = custom


@dataclass(frozen=True)
class _Ended:
    """The placement of ops recorded after a ``with Block`` ended and before another block began."""

    user_id: object


_ACTIVE = []  # the recorder of the capture under way (at most one)


def _recorder():
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(strategy):
    """Inside: blocks begun by the model tag the fx nodes torch.export records (see ``placement_of``)."""
    recorder = _Recorder(strategy if strategy is not None else PipelinedExecution())
    _ACTIVE.append(recorder)
    try:
        with fx_traceback.preserve_node_meta():
            yield recorder
    finally:
        _ACTIVE.pop()


def placement_of(fx_node):
    """The (stage, IPU) an exported fx node was tagged with, or None; raises for an op recorded between the
    end of a ``with Block`` and the start of the next block."""
    placement = (fx_node.meta.get("custom") or {}).get(PLACEMENT_KEY)
    if isinstance(placement, _Ended):
        raise Error(
            f"No active Block for {fx_node.target}: it runs after the `with poptorch.Block(...)` of block "
            f"{placement.user_id!r} ended and before another block begins. Move it into a block, or begin blocks "
            "with poptorch.Block.start or poptorch.BeginBlock, which last until the next block begins"
        )
    return placement


def fill_placements(graph):
    """Place the nodes of a captured graph that no block covers: those before the first block on IPU 0
    (stage 0), the rest (outputs bound after the model ran) with the block before them. A graph without
    blocks stays unplaced."""
    if all(node.placement is None for node in graph.nodes):
        return
    current = (0, 0)
    for node in graph.nodes:
        if node.placement is None:
            node.placement = current
        else:
            current = node.placement


# -- the annotations ---------------------------------------------------------------------------------------
class Block:
    """``with poptorch.Block(user_id=None, ipu_id=None):`` runs the layers called inside on a block (and the
    layers after it, until the next block begins)."""

    def __init__(self, user_id=None, ipu_id=None):
        self._user_id = _check_user_id(user_id)
        self._ipu_id = _check_ipu_id(ipu_id)

    @staticmethod
    def useAutoId():
        """Number the following ID-less blocks from "0" again (call it at the start of ``forward``)."""
        recorder = _recorder()
        if recorder is not None:
            recorder.manager.reset_auto_id()

    @staticmethod
    def start(user_id=None, ipu_id=None):
        """Begin a block here without a ``with`` statement."""
        recorder = _recorder()
        if recorder is not None:
            recorder.begin(_check_user_id(user_id), _check_ipu_id(ipu_id))

    def __enter__(self):
        Block.start(self._user_id, self._ipu_id)
        return self

    def __exit__(self, *exc):
        recorder = _recorder()
        if recorder is not None:
            recorder.end()
        return False

    def __repr__(self):
        return f"Block(user_id={self._user_id!r}, ipu_id={self._ipu_id})"


class _BlockHook:
    """The forward pre-hook ``BeginBlock`` registers: the module (and what follows it) starts a block."""

    def __init__(self, user_id, ipu_id):
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __call__(self, module, args):
        recorder = _recorder()
        if recorder is not None:
            if self._user_id is None:
                self._user_id = recorder.manager.next_auto_id()
            recorder.begin(self._user_id, self._ipu_id)

    def __repr__(self):
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


class _BlockFunctionCall(torch.nn.Module):
    """``BeginBlock`` of a plain callable: calling it begins the block, then calls the function."""

    def __init__(self, function, user_id, ipu_id):
        super().__init__()
        self._function = function
        self._hook = _BlockHook(user_id, ipu_id)

    def forward(self, *args, **kwargs):
        self._hook(self, args)
        return self._function(*args, **kwargs)


def BeginBlock(layer_to_call, user_id=None, ipu_id=None):
    """Start a block at ``layer_to_call`` (a module, annotated in place and returned): the module and every
    layer after it run in the block ``user_id`` on IPU ``ipu_id`` until another block begins."""
    user_id, ipu_id = _check_user_id(user_id), _check_ipu_id(ipu_id)
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _BlockFunctionCall(layer_to_call, user_id, ipu_id)
        raise Error("module is not an instance of torch.nn.Module or function.")
    if any(isinstance(h, _BlockHook) for h in layer_to_call._forward_pre_hooks.values()):
        raise Error("module has already been assigned to a block.")
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(user_id=None, ipu_id=None):
    """Decorator: the function's layers run in the block ``user_id`` on IPU ``ipu_id``."""
    user_id, ipu_id = _check_user_id(user_id), _check_ipu_id(ipu_id)

    def decorator(function):
        def wrapper(*args, **kwargs):
            with Block(user_id, ipu_id):
                return function(*args, **kwargs)

        wrapper.__wrapped__ = function
        return wrapper

    return decorator


def removeBlocks(module):
    """Remove every ``BeginBlock`` annotation from ``module`` and its submodules."""
    if not isinstance(module, torch.nn.Module):
        raise Error(f"removeBlocks takes a torch.nn.Module, got {type(module).__name__}")
    for m in module.modules():
        for key in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, _BlockHook)]:
            del m._forward_pre_hooks[key]
    return module


def IPU(ipu_id, layer_to_call=None):
    """The older pipeline annotator. ``IPU(ipu_id, layer)`` runs ``layer`` (and the layers after it) on IPU
    ``ipu_id``, as ``BeginBlock(layer, ipu_id=ipu_id)``; ``with IPU(ipu_id):`` is ``with Block(ipu_id=ipu_id):``."""
    if layer_to_call is None:
        return Block(ipu_id=ipu_id)
    return BeginBlock(layer_to_call, ipu_id=ipu_id)


_checkpoint = define_marker("recomputation_checkpoint")


def recomputationCheckpoint(*tensors):
    """Keep these tensors between the forward and backward passes when recomputation is on
    (``opts._Popart.set("autoRecomputation", 3)``) instead of recomputing them; returns them (one tensor, or a
    tuple, or the list or tuple given)."""
    if len(tensors) == 1 and isinstance(tensors[0], tuple | list):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("All inputs must be tensors")
    out = tuple(_checkpoint(t) for t in tensors)
    return out[0] if len(out) == 1 else out


# -- checking a captured model's placement -----------------------------------------------------------------
@dataclass(frozen=True)
class MultiIpuPlan:
    """How a captured model runs over IPUs: its stages in order, the IPU count of the device and whether
    the stages are pipelined (else sharded: one after another)."""

    stages: tuple
    num_ipus: int
    pipelined: bool


def plan(graph, options, training):
    """Check a captured forward graph's placements against ``options`` and PopTorch's rules; returns the
    MultiIpuPlan (one stage on one IPU for a model without blocks)."""
    from poptorch.options import not_modelled  # options imports this module

    strategy = options.execution_strategy
    placements = [n.placement for n in graph.nodes if n.placement is not None]
    if not placements:
        return MultiIpuPlan((0,), 1, False)
    pipelined = strategy is None or strategy.pipelined
    if pipelined:
        _check_stage_order(graph)
        _check_one_ipu_per_stage(placements)
        merge_consecutive_stages(graph)
        placements = [n.placement for n in graph.nodes if n.placement is not None]
    stages = tuple(sorted({stage for stage, _ in placements}))
    used = max(ipu for _, ipu in placements) + 1
    num_ipus = _device_ipus(used, options.auto_round_num_ipus)
    if pipelined and len(stages) > 1:
        _check_pipeline_depth(len(stages), options, training)
        if training and options.recomputation in ("standard", "norm_only"):
            raise not_modelled(
                "autoRecomputation "
                + ("1 (Standard)" if options.recomputation == "standard" else "2 (NormOnly)")
                + " with PipelinedExecution",
                "a pipeline recomputes each stage from its stashed inputs: use 3 (Pipeline) with "
                "recomputationCheckpoint, or ShardedExecution",
            )
        if training and "Activation" in options.TensorLocations.streamed:
            raise not_modelled(
                "TensorLocations.setActivationLocation with useOnChipStorage(False) with PipelinedExecution",
                "a pipeline stashes each stage's activations on its IPU: use ShardedExecution, or recomputation",
            )
    return MultiIpuPlan(stages, num_ipus, pipelined and len(stages) > 1)


def _check_stage_order(graph):
    """In a pipeline, data flows from earlier stages to later ones: a node may not read a later stage's value."""
    for node in graph.nodes:
        for value in node.inputs:
            producer = value.producer
            if producer is None or producer.placement is None or node.placement is None:
                continue
            if producer.placement[0] > node.placement[0]:
                where = f" at {node.source}" if node.source else ""
                raise Error(
                    f"Pipeline stages out of order: {node.op}{where} in stage {node.placement[0]} (IPU "
                    f"{node.placement[1]}) reads a value of the later stage {producer.placement[0]} (IPU "
                    f"{producer.placement[1]}). A pipeline's stages must run in order: give the blocks increasing "
                    "stages (PipelinedExecution(poptorch.AutoStage.AutoIncrement) numbers them in the order they "
                    "run), or use ShardedExecution."
                )


def merge_consecutive_stages(graph):
    """Renumber a pipelined graph's stages as PopART does before it counts them: a stage on the same IPU as
    the stage numbered just before it joins that stage, and later stages shift down. Ops before the first
    block run in stage 0 on IPU 0, so under ``AutoStage.AutoIncrement`` (whose blocks count from stage 1)
    a first block on IPU 0 adds no stage, and consecutive blocks on one IPU form one pipeline stage."""
    ipu_of = dict(sorted({n.placement for n in graph.nodes if n.placement is not None}))
    merged, shift, previous = {}, 0, None
    for stage, ipu in ipu_of.items():
        if ipu == previous:
            shift += 1
        merged[stage] = stage - shift
        previous = ipu
    for node in graph.nodes:
        if node.placement is not None:
            node.placement = (merged[node.placement[0]], node.placement[1])


def _check_one_ipu_per_stage(placements):
    """A pipeline stage runs on one IPU (ops before the first block run in stage 0 on IPU 0)."""
    ipus = {}
    for stage, ipu in placements:
        ipus.setdefault(stage, set()).add(ipu)
    for stage, on in sorted(ipus.items()):
        if len(on) > 1:
            raise Error(
                f"Pipeline stage {stage} runs on IPUs {sorted(on)}: a pipeline stage runs on one IPU. Ops before "
                "the first block run in stage 0 on IPU 0: begin the first block at the model's first layer, or "
                "give the stage's blocks one IPU (Stage(...).ipu(n))."
            )


def _device_ipus(used, auto_round):
    """IPU devices come in powers of two: the IPUs a model uses, rounded up when ``autoRoundNumIPUs``."""
    rounded = 1 << (used - 1).bit_length()
    if rounded == used:
        return used
    if not auto_round:
        raise Error(
            f"The model uses {used} IPUs, but a device has a power of two IPUs: use {rounded} IPUs, or "
            "Options.autoRoundNumIPUs(True) to allocate them"
        )
    return rounded


def _check_pipeline_depth(num_stages, options, training):
    if training:
        # PopART pipelines the backward pass too: the last stage's forward and backward form one pipeline
        # stage and every other stage adds two, so a step needs 2 x stages - 1 micro-batches to fill it.
        needed = 2 * num_stages - 1
        have = options.Training.gradient_accumulation
        if have < needed:
            raise Error(
                f"Options.Training.gradientAccumulation({have}) is too small for a pipeline of {num_stages} stages: "
                f"pipelined training needs a gradient accumulation of at least 2 x {num_stages} - 1 = {needed} "
                "(Options.Training.gradientAccumulation), or use ShardedExecution"
            )
    elif options.device_iterations < num_stages:
        raise Error(
            f"Options.deviceIterations({options.device_iterations}) is too small for a pipeline of {num_stages} "
            f"stages: pipelined inference needs at least {num_stages} device iterations, or use ShardedExecution"
        )
