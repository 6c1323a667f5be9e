"""The ``poptorch`` logger, its level taken from POPTORCH_LOG_LEVEL (TRACE_ALL, TRACE, DEBUG, INFO, WARN
(default), ERR, OFF) or set with ``poptorch.setLogLevel``. A message repeated more than ``maxRepeatLogs``
times in a row is silenced until a different message is logged."""

import logging
import os

TRACE = 5
TRACE_ALL = 1
logging.addLevelName(TRACE, "TRACE")
logging.addLevelName(TRACE_ALL, "TRACE_ALL")

_LEVELS = {
    "TRACE_ALL": TRACE_ALL,
    "TRACE": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERR": logging.ERROR,
    "OFF": logging.CRITICAL + 10,
}
# PopTorch's legacy integer levels (0 = TRACE ... 6 = OFF; 5 is unused).
_INTEGER_LEVELS = {0: "TRACE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERR", 6: "OFF"}
_PUBLIC = sorted(set(_LEVELS) - {"TRACE_ALL"})
DEFAULT_MAX_REPEATS = 4

logger = logging.getLogger("poptorch")


class _RepeatFilter(logging.Filter):
    """Drops a message once it has been logged ``max_repeats`` times in a row."""

    def __init__(self):
        super().__init__()
        self.max_repeats = DEFAULT_MAX_REPEATS
        self._last, self._count = None, 0

    def filter(self, record):
        message = (record.levelno, record.getMessage())
        self._count = self._count + 1 if message == self._last else 1
        self._last = message
        return self._count <= self.max_repeats


_repeats = _RepeatFilter()


def set_level(level):
    """Set the logger's level from a PopTorch level name (or legacy integer); unknown levels raise ValueError."""
    if isinstance(level, int) and not isinstance(level, bool):
        if level not in _INTEGER_LEVELS:
            raise ValueError("Invalid log level integer")
        level = _INTEGER_LEVELS[level]
    name = level.upper() if isinstance(level, str) else level
    if name not in _LEVELS:
        raise ValueError(f"Unknown log level: {level}. Valid values are {', '.join(_PUBLIC[:-1])} and {_PUBLIC[-1]}")
    logger.setLevel(_LEVELS[name])


def set_max_repeats(number):
    """Silence a message after it has been logged ``number`` times in a row."""
    _repeats.max_repeats = number


if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [poptorch] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
logger.addFilter(_repeats)
try:
    set_level(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))
except ValueError as _exc:
    raise ValueError(f"The environment variable POPTORCH_LOG_LEVEL is invalid: {_exc}") from None
