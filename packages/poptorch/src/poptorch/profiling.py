"""``poptorch.profiling.Channel``: PopVision System Analyser tracepoints (libpvti).

The simulator ships without libpvti, so, as PopTorch documents for that case, a channel records nothing:
``instrument`` returns the object unchanged and ``tracepoint`` is an empty context. Asking for a trace with
``PVTI_OPTIONS`` logs that tracepoints are disabled, as PopTorch does when it cannot import libpvti."""

import contextlib
import os

from poptorch._logging import logger

if os.environ.get("PVTI_OPTIONS") is not None:
    logger.info("Tracepoints disabled: the simulator has no libpvti (PVTI_OPTIONS is ignored)")


class Channel:
    """A named profiling channel; without libpvti its tracepoints record nothing."""

    def __init__(self, name):
        if not isinstance(name, str):
            raise TypeError(f"Channel name must be a string, got {name!r}")
        self.name = name

    def instrument(self, obj, *methods):
        """Wrap ``obj``'s ``methods`` in tracepoints: returns ``obj`` unchanged (no libpvti)."""
        for method in methods:
            if not callable(getattr(obj, method, None)):
                raise AttributeError(f"{type(obj).__name__} has no method {method!r} to instrument")
        return obj

    def tracepoint(self, name):
        """A context timing its body under ``<channel>.<name>``: empty without libpvti."""
        return contextlib.nullcontext()
