"""popsim: a tile-level simulator of a Graphcore IPU.

Every tensor byte lives in one tile's own memory; vertices touch only their own tile; every cross-tile
movement is an exchange the engine performs and charges for.
"""

from importlib.metadata import version as _version

from popsim._arena import TileArena

__version__ = _version("popsim")

__all__ = ["TileArena", "__version__"]
