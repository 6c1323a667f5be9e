"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import dataclasses
import math

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
            optimize=False,  # the executor optimised the programs before keying its cache on them
        )
    except popsim.OutOfMemoryError as exc:
        raise Error(f"Out of memory on the simulated IPU: {exc}") from exc


def check_input_fits(name, shape, itemsize, options):
    """Refuse, before capture, an input whose one micro-batch (``shape``, ``itemsize`` bytes per element on
    the device) cannot fit the tile memory of the simulated IPU at all."""
    target = target_of(options)
    capacity = target.num_tiles * target.tile_bytes
    needed = math.prod(shape) * itemsize
    if needed > capacity:
        raise Error(
            f"Input {name}: one micro-batch of shape {list(shape)} takes {needed:,} bytes on the device, more "
            f"than the {capacity:,} bytes of tile memory of the simulated {target.name} ({target.num_tiles:,} tiles "
            f"x {target.tile_bytes:,} bytes). Use a smaller batch, or split it over more micro-batches with "
            "Options.deviceIterations or Options.Training.gradientAccumulation."
        )
