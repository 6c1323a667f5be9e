"""popsim: a tile-level simulator of a Graphcore IPU.

Every tensor byte lives in one tile's own memory; vertices touch only their own tile; every cross-tile
movement is an exchange the engine performs and charges for.

    exe = popsim.compile(graph_or_programs, target="ipu2")
    outputs = exe.run(feeds, program=None)

A hand-built DeviceGraph program (Sequence, Execute, Copy, Repeat, If, Sync, StreamCopy, HostCall) compiles with
``popsim.compile_device_graph(dg, inputs, outputs)``. ``popsim.register_lowering(op_name)`` adds the lowering
of a popir op defined outside popir (see docs/frontends.md).
"""

from importlib.metadata import version as _version

from popsim._arena import TileArena
from popsim.device_graph import (
    ComputeSet,
    Copy,
    DeviceGraph,
    Execute,
    HostCall,
    If,
    Region,
    Regions,
    Repeat,
    Sequence,
    StreamCopy,
    Sync,
    Tensor,
    Vertices,
)
from popsim.errors import EngineFault, Error, HostCallbackError, IndexRangeError, OutOfMemoryError, UnsupportedOpError
from popsim.executable import Executable, compile, compile_device_graph, supported_ops
from popsim.lowerings import register_lowering
from popsim.mapping import TileMapping
from popsim.planner import Lowerer
from popsim.profile import Profile
from popsim.schedule import (
    Schedule,
    phase_schedule,
    place_phases,
    place_pipeline,
    place_shared_run,
    place_steps,
    run_stretches,
    stash_per_tile,
    step_schedule,
    stream_stretches,
)
from popsim.target import Device, Target
from popsim.timeline import Timeline, compute_lane, io_lane, link_lane, transfer_lane

__version__ = _version("popsim")

__all__ = [
    "ComputeSet",
    "Copy",
    "Device",
    "DeviceGraph",
    "EngineFault",
    "Error",
    "Executable",
    "Execute",
    "HostCall",
    "HostCallbackError",
    "If",
    "IndexRangeError",
    "Lowerer",
    "OutOfMemoryError",
    "Profile",
    "Region",
    "Regions",
    "Repeat",
    "Schedule",
    "Sequence",
    "StreamCopy",
    "Sync",
    "Target",
    "Tensor",
    "TileArena",
    "TileMapping",
    "Timeline",
    "UnsupportedOpError",
    "Vertices",
    "__version__",
    "compile",
    "compile_device_graph",
    "compute_lane",
    "io_lane",
    "link_lane",
    "register_lowering",
    "run_stretches",
    "stream_stretches",
    "phase_schedule",
    "place_phases",
    "place_pipeline",
    "place_shared_run",
    "place_steps",
    "stash_per_tile",
    "transfer_lane",
    "step_schedule",
    "supported_ops",
]
