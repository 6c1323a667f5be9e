"""popsim's exceptions."""


class Error(Exception):
    """Base class of every popsim error."""


class OutOfMemoryError(Error):
    """A tile needs more bytes than it has (names the tile, the bytes and its largest tensors)."""


class IndexRangeError(Error):
    """A run read or wrote through gather/scatter indices outside their axis (``count`` of them); the run's
    results are invalid. Raised after the run, so indices computed on the device are caught too."""

    def __init__(self, message, count):
        super().__init__(message)
        self.count = int(count)


class EngineFault(Error):
    """The engine met an instruction no codelet implements (a corrupted executable): the run stopped and the
    device's memory can no longer be trusted."""


class UnsupportedOpError(Error):
    """The graph uses ops without a popsim lowering; ``ops`` lists all of them."""

    def __init__(self, message, ops=()):
        super().__init__(message)
        self.ops = tuple(ops)


class HostCallbackError(Error):
    """A host callback raised during a run (the original exception is its ``__cause__``); the run stopped
    there and its results are invalid."""
