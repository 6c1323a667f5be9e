"""popdata: PopTorch-style batching DataLoader and AsynchronousDataAccessor (torch.utils.data based)."""

from importlib.metadata import version as _version

__version__ = _version("popdata")
