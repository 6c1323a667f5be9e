"""poptorch: run unmodified PyTorch models on a simulated Graphcore IPU."""

from importlib.metadata import version as _version

__version__ = _version("poptorch")
