"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import dataclasses

import popsim
from poptorch.errors import Error


def target_of(options):
    """The simulated IPU ``options`` choose; tiles reserved by TensorLocations.numIOTiles hold no computation."""
    target = popsim.Target.named(options.ipu_version)
    io_tiles = options.TensorLocations.num_io_tiles
    if io_tiles:
        target = dataclasses.replace(target, num_tiles=target.num_tiles - io_tiles)
    return target


def compile_programs(graphs, options):
    """Compile ``{program: popir.Graph}`` for the simulated IPU chosen by ``options``; returns the executable."""
    try:
        return popsim.compile(
            graphs,
            target=target_of(options),
            partials_type=options.Precision.partials_type,
        )
    except popsim.OutOfMemoryError as exc:
        raise Error(f"Out of memory on the simulated IPU: {exc}") from exc
