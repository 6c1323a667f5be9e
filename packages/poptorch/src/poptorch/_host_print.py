"""``ipu_print_tensor`` on the device: the printed value (and its gradient) streams to the host and prints.

Capture marks each printed value as an extra graph output; training adds the gradient of each value whose
gradient is to be printed. After every run of a program, the host prints those outputs (forward prints in
program order, then gradients in backward order) and removes them from the run's results.
"""

import numpy as np

_PREFIX = "_print."
_FORWARD, _GRADIENT = "f", "g"
# Gradients print in backward order: their names sort by a descending index.
_MAX_PRINTS = 10_000


def describe(title, array, gradient=False):
    """The printed line of a tensor (or of its gradient)."""
    label = f"{title} gradient" if gradient else title
    text = np.array2string(np.asarray(array), separator=", ", threshold=1000, edgeitems=3)
    return f"{label}: {text}" if label else text


def record(graph, value, title, print_gradient):
    """Mark ``value`` of ``graph`` for printing after each run (and its gradient, when trained)."""
    index = sum(1 for name in graph.outputs if name.startswith(_PREFIX + _FORWARD))
    if index >= _MAX_PRINTS:
        raise ValueError(f"A model can print at most {_MAX_PRINTS} tensors")
    flag = "g" if print_gradient else "-"
    graph.output(f"{_PREFIX}{_FORWARD}{index:05d}{flag} {title}", value)


def gradient_requests(graph):
    """``[(index, title, value)]`` of the printed values whose gradient should print too."""
    requests = []
    for name, value in graph.outputs.items():
        wanted = name.startswith(_PREFIX + _FORWARD) and name[len(_PREFIX) + 6] == "g"
        if wanted and value.dtype.is_float:
            requests.append((int(name[len(_PREFIX) + 1 : len(_PREFIX) + 6]), name.split(" ", 1)[1], value))
    return requests


def record_gradient(graph, index, title, gradient):
    """Mark ``gradient``, the gradient of printed value ``index``, for printing after each run."""
    graph.output(f"{_PREFIX}{_GRADIENT}{_MAX_PRINTS - index:05d}- {title}", gradient)


def emit(result):
    """Print and remove the printed outputs of a run's ``result``."""
    for name in sorted(n for n in result if n.startswith(_PREFIX)):
        array = result.pop(name)
        kind, title = name[len(_PREFIX)], name.split(" ", 1)[1]
        print(describe(title, array, gradient=kind == _GRADIENT))
