"""The ``poptorch`` logger, its level taken from POPTORCH_LOG_LEVEL (TRACE, DEBUG, INFO, WARN, ERR, OFF)."""

import logging
import os

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {
    "TRACE": TRACE,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERR": logging.ERROR,
    "OFF": logging.CRITICAL + 10,
}

logger = logging.getLogger("poptorch")


def set_level(name):
    """Set the logger's level from a PopTorch level name; unknown names raise ValueError."""
    try:
        logger.setLevel(_LEVELS[name.upper()])
    except KeyError:
        raise ValueError(f"Unknown log level {name!r}: expected one of {', '.join(_LEVELS)}") from None


if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [poptorch] [%(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
set_level(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))
