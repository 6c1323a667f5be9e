"""Which copy of each parameter, buffer and optimizer state is current: the host's or one device's.

Wrapped models share host tensors in every way torch allows: tied weights, a submodule used twice, one
module inside two user models, a trainingModel and an inferenceModel of one model. Each host tensor (and
each optimizer) therefore has one ``Record``, found by the object's identity, never by a name:

- ``generation`` counts the values it has had; a device holds generation g when it last uploaded or
  computed value g, so a device whose generation differs from the record's must upload before running;
- ``holder`` is the executor whose device holds a value newer than the host's (None: the host is current);
- ``version`` is the tensor's in-place version counter and storage address when the host copy was last
  current, so a host-side edit (``weight.add_(1)``, ``copy_``, ``load_state_dict``) is seen as a new value.

Executors that hold newer values than the host are listed in ``_HOLDERS``; reading a model's weights on the
host asks those that share tensors with it to copy their values back first.
"""

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from poptorch.errors import Error

STEP_SLOT = "step"

_RECORDS = WeakIdKeyDictionary()
_OPTIMIZER_RECORDS = weakref.WeakKeyDictionary()
_HOLDERS = weakref.WeakSet()


def version_of(tensor):
    """What changes when the host value of ``tensor`` is edited in place or its storage is replaced."""
    return tensor._version, tensor.data_ptr()


class Record:
    """The coherence state of one host tensor or optimizer (see the module docstring)."""

    __slots__ = ("generation", "_holder", "version")

    def __init__(self, version=None):
        self.generation = 0
        self._holder = None
        self.version = version

    @property
    def holder(self):
        """The executor whose device holds a newer value than the host, or None."""
        return self._holder() if self._holder is not None else None

    def device_updated(self, executor):
        """``executor``'s device computed a new value; the host copy is now stale."""
        self.generation += 1
        self._holder = weakref.ref(executor)
        _HOLDERS.add(executor)
        return self.generation

    def host_current(self, version=None):
        """The host copy is current again (copied back from the device, or edited on the host)."""
        self._holder = None
        if version is not None:
            self.version = version

    def host_changed(self, version=None):
        """The host copy holds a new value that every device must upload."""
        self.host_current(version)
        self.generation += 1


def record(tensor):
    """The Record of a host tensor (created on first use)."""
    found = _RECORDS.get(tensor)
    if found is None:
        found = _RECORDS[tensor] = Record(version_of(tensor))
    return found


def optimizer_record(optimizer):
    """The Record of an optimizer's state (created on first use, with hooks that keep it honest)."""
    found = _OPTIMIZER_RECORDS.get(optimizer)
    if found is None:
        found = _OPTIMIZER_RECORDS[optimizer] = Record()
        optimizer.register_state_dict_pre_hook(sync_optimizer_state)
        optimizer.register_load_state_dict_pre_hook(check_loading_state)
        optimizer.register_load_state_dict_post_hook(_loaded_optimizer_state)
    return found


def sync_optimizer_state(optimizer):
    """Copy the optimizer's state back from the device that holds a newer one (before ``state_dict()``)."""
    found = _OPTIMIZER_RECORDS.get(optimizer)
    holder = found.holder if found is not None else None
    if holder is not None:
        holder.download_optimizer_state()


def _loaded_optimizer_state(optimizer):
    """After ``optimizer.load_state_dict()``: the loaded state replaces the device's at the next call."""
    optimizer_record(optimizer).host_changed()


def check_loading_state(optimizer, state_dict):
    """Before ``optimizer.load_state_dict(state_dict)``: raise unless every tensor of the state fits the
    parameter it is about to belong to, so that a failed load leaves the optimizer as it was."""
    state = state_dict.get("state", {})
    for index, (saved, group) in enumerate(zip(state_dict.get("param_groups", ()), optimizer.param_groups)):
        names = group.get("param_names") or [None] * len(group["params"])
        for position, (key, param, name) in enumerate(zip(saved.get("params", ()), group["params"], names)):
            what = f"parameter '{name}'" if name else f"parameter {position} of parameter group {index}"
            for slot, value in state.get(key, {}).items():
                check_state_value(value, param, what, slot)


def check_state_value(value, param, what, slot):
    """Raise unless optimizer state ``slot`` (a tensor) fits ``param``: same shape, floating point."""
    if slot == STEP_SLOT or not isinstance(value, torch.Tensor):
        return
    if value.shape != param.shape or not value.is_floating_point():
        raise Error(
            f"Optimizer state '{slot}' of {what} is a {value.dtype} tensor of shape {list(value.shape)}, but the "
            f"parameter is {param.dtype} of shape {list(param.shape)}: the optimizer state does not belong to this "
            "model's parameters (check the checkpoint and the order of the parameter groups)."
        )


def forget_holder(holder):
    """``holder`` has copied back everything it held."""
    _HOLDERS.discard(holder)


def holders_sharing(tensors):
    """Executors holding newer device values than the host for any of ``tensors``."""
    if not _HOLDERS:
        return []
    holders = []
    for tensor in tensors:
        found = _RECORDS.get(tensor)
        holder = found.holder if found is not None else None
        if holder is not None and holder not in holders:
            holders.append(holder)
    return holders


def state_tensors(module):
    """Every parameter and buffer of ``module`` and its submodules, read without the modules' accessors."""
    seen, pending, tensors = set(), [module], []
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        state = vars(current)
        for table in ("_parameters", "_buffers"):
            tensors.extend(t for t in state.get(table, {}).values() if t is not None)
        pending.extend(m for m in state.get("_modules", {}).values() if m is not None)
    return tensors


def sync_host(module):
    """Copy back the newer device values of ``module``'s parameters and buffers (before a host read)."""
    if _HOLDERS:
        for holder in holders_sharing(state_tensors(module)):
            holder.download()
