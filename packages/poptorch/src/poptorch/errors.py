"""poptorch's exception types (PopTorch's ``poptorch.Error`` and friends)."""


class Error(RuntimeError):
    """A user-level error: the message names the cause and, where known, the user's source line."""


class UnsupportedOpError(Error):
    """The model uses operations the simulated IPU cannot run; all of them are listed at once."""
