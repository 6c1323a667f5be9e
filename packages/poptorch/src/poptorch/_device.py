"""The only module that talks to popsim: compile programs, and the device errors users may see."""

import math

import popsim
from poptorch.errors import Error


def compile_programs(graphs, options):
    """Compile ``{program: popir.Graph}`` for the simulated IPU chosen by ``options``; returns the executable."""
    try:
        return popsim.compile(
            graphs,
            target=options.ipu_version,
            partials_type=options.Precision.partials_type,
        )
    except popsim.OutOfMemoryError as exc:
        raise Error(f"Out of memory on the simulated IPU: {exc}") from exc


def check_input_fits(name, shape, itemsize, options):
    """Refuse, before capture, an input whose one micro-batch (``shape``, ``itemsize`` bytes per element on
    the device) cannot fit the tile memory of the simulated IPU at all."""
    target = popsim.Target.named(options.ipu_version)
    capacity = target.num_tiles * target.tile_bytes
    needed = math.prod(shape) * itemsize
    if needed > capacity:
        raise Error(
            f"Input {name}: one micro-batch of shape {list(shape)} takes {needed:,} bytes on the device, more "
            f"than the {capacity:,} bytes of tile memory of the simulated {target.name} ({target.num_tiles:,} tiles "
            f"x {target.tile_bytes:,} bytes). Use a smaller batch, or split it over more micro-batches with "
            "Options.deviceIterations or Options.Training.gradientAccumulation."
        )
