"""poptorch's exception types (PopTorch's ``poptorch.Error`` and friends)."""


class Error(RuntimeError):
    """A user-level error: the message names the cause and, where known, the user's source line.

    Attributes, as in PopTorch: ``message`` (the text), ``type`` (the error's category: the exception class
    name, or the device error it comes from) and ``location`` (the user's ``file:line: code``, or "" when the
    error is not tied to a line of the model).
    """

    def __init__(self, message="", *, type=None, location=None):  # noqa: A002 - PopTorch's attribute name
        super().__init__(message)
        self.message = message
        self.type = type or self.__class__.__name__
        self.location = location or ""


class UnsupportedOpError(Error):
    """The model uses operations the simulated IPU cannot run; all of them are listed at once."""


class RecoverableError(Error):
    """The device failed while running; ``recovery_action`` says what brings it back.

    The simulator raises it with ``recovery_action`` "IPU_RESET" when a run fails on the device (as
    PopTorch does for Poplar's recoverable runtime errors): detach and attach again to reset the device.
    """

    def __init__(self, message="", *, recovery_action, type=None, location=None):  # noqa: A002
        super().__init__(message, type=type, location=location)
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    """The device is unusable for the rest of the process (PopTorch: the IPU needs a reboot)."""
