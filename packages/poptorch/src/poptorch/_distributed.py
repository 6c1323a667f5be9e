"""Several host processes training one model: who this process is, and what the processes exchange.

A process learns its place from ``torch.distributed`` when a process group is initialised, else from the
environment of its launcher: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` or Open MPI's
``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_LOCAL_RANK``.
"""

import datetime
import os
from typing import NamedTuple

import numpy as np
import torch
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


# Seconds a collective waits for the other processes before failing (a stopped process must not hang the
# rest); POPTORCH_DISTRIBUTED_TIMEOUT overrides it.
DEFAULT_TIMEOUT = 300
ENV_TIMEOUT = "POPTORCH_DISTRIBUTED_TIMEOUT"


def timeout():
    """The collective timeout as a timedelta."""
    seconds = _integer(ENV_TIMEOUT, 1) if os.environ.get(ENV_TIMEOUT) else DEFAULT_TIMEOUT
    return datetime.timedelta(seconds=seconds)


def join(options):
    """Make sure a torch.distributed process group joins this process to the others ``options`` declares:
    initialise one (gloo, from torchrun's MASTER_ADDR / MASTER_PORT) if none is, else check it matches."""
    place = options.Distributed.processId, options.Distributed.numProcesses
    if dist.is_initialized():
        group = dist.get_rank(), dist.get_world_size()
        if group != place:
            raise Error(
                f"Options.Distributed says process {place[0]} of {place[1]}, but the torch.distributed process "
                f"group is rank {group[0]} of {group[1]}: configure the options from the same launcher"
            )
        return
    missing = [variable for variable in ("MASTER_ADDR", "MASTER_PORT") if variable not in os.environ]
    if missing:
        raise Error(
            f"Process {place[0]} of {place[1]} cannot reach the other processes: {' and '.join(missing)} "
            "not set. Launch with torchrun (which sets them), set them to the address and a free port of "
            "process 0's host, or call torch.distributed.init_process_group yourself before the first run"
        )
    dist.init_process_group("gloo", init_method="env://", rank=place[0], world_size=place[1], timeout=timeout())


def _collective_failed(what, exc):
    return Error(
        f"{what} with the other processes failed (process {dist.get_rank()} of {dist.get_world_size()}): {exc}. "
        "Another process has probably stopped or run a different number of steps; every process must run "
        f"the same model and steps. (The wait is bounded by {ENV_TIMEOUT}, in seconds.)"
    )


def broadcast_host_tensors(tensors):
    """Give every process process 0's values of ``tensors`` (in place), so that all start alike."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    try:
        dist.broadcast(flat, src=0)
    except (RuntimeError, ValueError) as exc:
        raise _collective_failed("Broadcasting the initial weights and buffers", exc) from exc
    with torch.no_grad():
        for tensor, value in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(value.reshape(tensor.shape).to(tensor.dtype))


def broadcast_optimizer_state(optimizer):
    """Give every process process 0's optimizer state (momentum, Adam moments, step; e.g. loaded from a
    checkpoint on process 0 only), matched by the parameters' order in the optimizer's groups."""
    if optimizer is None:
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = [dict(optimizer.state.get(param, {})) for param in params]
    shared = [state if dist.get_rank() == 0 else None]
    try:
        dist.broadcast_object_list(shared, src=0)
    except (RuntimeError, ValueError) as exc:
        raise _collective_failed("Broadcasting the optimizer state", exc) from exc
    if len(shared[0]) != len(params):
        raise Error(
            f"Process 0's optimizer has {len(shared[0])} parameters, this process's has {len(params)}: every "
            "process must build the same model and optimizer"
        )
    for param, values in zip(params, shared[0]):
        if values:
            optimizer.state[param] = values
        else:
            optimizer.state.pop(param, None)


def all_reduce_sum(exe, names, grouped):
    """Sum the device variables ``names`` over every process (one gloo all-reduce), in place. A variable
    in ``grouped`` (a ``GroupedParameters``) is summed group by group: a process holds zeros for the groups
    none of its replicas belongs to, so each group's sum is over its own replicas only."""
    values = [grouped.stacked(exe, name) if name in grouped else np.asarray(exe.read_variable(name)) for name in names]
    flat = torch.from_numpy(np.concatenate([v.reshape(-1).astype(np.float32) for v in values]))
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    except (RuntimeError, ValueError) as exc:
        raise _collective_failed("The all-reduce of the gradients", exc) from exc
    pieces = np.split(flat.numpy(), np.cumsum([v.size for v in values])[:-1])
    for name, value, reduced in zip(names, values, pieces):
        if name in grouped:
            grouped.replace(exe, name, reduced)
        else:
            exe.write_variable(name, reduced.reshape(value.shape).astype(value.dtype))
