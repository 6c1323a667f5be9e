"""Conditions the device checks on every run of a program, for results torch would give that the simulator
cannot reproduce (and must not silently replace).

Lowering marks each condition as an extra scalar graph output (0 when it holds, > 0 when broken) named after
its message. After every run the host removes these outputs from the results and raises ``poptorch.Error``
for the first broken one, so a wrong value never reaches the user.
"""

import numpy as np

from poptorch.errors import Error

_PREFIX = "_check."


def record(graph, flag, message, location):
    """Mark the scalar ``flag`` of ``graph`` (> 0: broken) as a check raising ``message`` at ``location``."""
    index = sum(1 for name in graph.outputs if name.startswith(_PREFIX))
    graph.output(f"{_PREFIX}{index:05d}\0{location or ''}\0{message}", flag)


def check(result):
    """Remove the check outputs from a run's ``result``; raise for the first broken check."""
    broken = None
    for name in sorted(n for n in result if n.startswith(_PREFIX)):
        flag = float(np.max(result.pop(name)))
        if broken is None and flag > 0:
            broken = name
    if broken is not None:
        _, location, message = broken.split("\0", 2)
        where = f" at {location}" if location else ""
        raise Error(f"{message}{where}", type="device_check", location=location)
