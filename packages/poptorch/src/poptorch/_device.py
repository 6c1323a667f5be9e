"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import popsim
from poptorch.errors import Error


def compile_programs(graphs, options):
    """Compile ``{program: popir.Graph}`` for the simulated IPU chosen by ``options``; returns the executable."""
    try:
        return popsim.compile(
            graphs,
            target=options.ipu_version,
            partials_type=options.Precision.partials_type,
            optimize=False,  # the executor optimised the programs before keying its cache on them
        )
    except popsim.OutOfMemoryError as exc:
        raise Error(f"Out of memory on the simulated IPU: {exc}") from exc
