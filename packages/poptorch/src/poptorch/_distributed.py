"""Several host processes training one model: who this process is, and what the processes exchange.

A process learns its place from ``torch.distributed`` when a process group is initialised, else from the
environment of its launcher: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` or Open MPI's
``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_LOCAL_RANK``.
"""

import os
from typing import NamedTuple

import torch.distributed as dist

from poptorch.errors import Error

# (process id, process count, process id on this host) variables of each launcher, in order of preference.
LAUNCHERS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
}


class Place(NamedTuple):
    """This process's id among ``count`` processes, and its id among the processes of its host."""

    id: int
    count: int
    local_id: int


def _integer(variable, minimum):
    text = os.environ[variable]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise Error(f"The environment variable {variable} must be an integer >= {minimum}, got {text!r}")
    return value


def from_variables(id_variable, count_variable, local_variable=None):
    """The place the environment variables name, or None when the count variable is unset."""
    if count_variable not in os.environ:
        return None
    count = _integer(count_variable, 1)
    process = _integer(id_variable, 0) if id_variable in os.environ else 0
    if process >= count:
        raise Error(f"{id_variable}={process} is not below {count_variable}={count}")
    local = _integer(local_variable, 0) if local_variable and local_variable in os.environ else process
    return Place(process, count, local)


def from_environment():
    """This process's place: from torch.distributed if initialised, else from a launcher's variables (two
    launchers that disagree are an error), else process 0 of 1."""
    found = {name: from_variables(*variables) for name, variables in LAUNCHERS.items()}
    found = {name: place for name, place in found.items() if place is not None}
    if dist.is_available() and dist.is_initialized():
        process, count = dist.get_rank(), dist.get_world_size()
        local = next((p.local_id for p in found.values() if p[:2] == (process, count)), process)
        return Place(process, count, local)
    places = {place[:2] for place in found.values()}
    if len(places) > 1:
        described = ", ".join(f"{name} says process {p.id} of {p.count}" for name, p in found.items())
        raise Error(
            f"The launchers' environment variables disagree about this process ({described}): unset the "
            "variables of the launcher you do not use, or call Options.Distributed.configureProcessId(id, count)"
        )
    return next(iter(found.values()), Place(0, 1, 0))
