"""popsim: a tile-level simulator of a Graphcore IPU.

Every tensor byte lives in one tile's own memory; vertices touch only their own tile; every cross-tile
movement is an exchange the engine performs and charges for.

    exe = popsim.compile(graph_or_programs, target="ipu2")
    outputs = exe.run(feeds, program=None)
"""

from importlib.metadata import version as _version

from popsim._arena import TileArena
from popsim.device_graph import ComputeSet, Copy, DeviceGraph, Region, Tensor, Vertex
from popsim.errors import Error, OutOfMemoryError, UnsupportedOpError
from popsim.executable import Executable, compile, supported_ops
from popsim.mapping import TileMapping
from popsim.profile import Profile
from popsim.target import Device, Target

__version__ = _version("popsim")

__all__ = [
    "ComputeSet",
    "Copy",
    "Device",
    "DeviceGraph",
    "Error",
    "Executable",
    "OutOfMemoryError",
    "Profile",
    "Region",
    "Target",
    "Tensor",
    "TileArena",
    "TileMapping",
    "UnsupportedOpError",
    "Vertex",
    "__version__",
    "compile",
    "supported_ops",
]
