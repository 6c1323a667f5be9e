"""One compiled executable's device copies of the host tensors and optimizer state it uses.

Device variables are named by the first FQN under which torch lists each tensor, but they are tied to the
host tensor object itself: ``DeviceWeights.tensors`` maps variable -> tensor, and coherence with the host
and with other executables using the same tensors goes through the identity-keyed records of ``_weights``.
"""

import warnings

import numpy as np
import torch

from poptorch import _weights
from poptorch._optimizer_graph import LOSS_SCALE_FACTOR, LOSS_SCALING, STEP, hyper_name
from poptorch._replication import GroupedParameters, ShardedState
from poptorch._training import ACCUMULATOR_PREFIX, RNG_SEED
from poptorch.errors import Error
from poptorch.optim import loss_scale_factor, set_loss_scale_factor

_STATE_PREFIX = "_opt."
_STEP_SLOT = _weights.STEP_SLOT
_WORD = 32
_WORD_MASK = (1 << _WORD) - 1
_SEED_FOLD = 0x9E3779B1  # odd multiplier: every bit of the high half moves the folded word


def device_seed(seed):
    """The device's int32[2] RNG_SEED for a 64-bit ``randomSeed``: word 0 folds in both halves (a seed below
    2**32 is kept as it is), word 1 is left for the per-op stream numbers the capture adds."""
    folded = (seed ^ ((seed >> _WORD) * _SEED_FOLD)) & _WORD_MASK
    return np.array([folded, 0], dtype=np.uint32).view(np.int32)


class DeviceWeights:
    """Uploads, downloads and tracks the device values of one executable's parameters, buffers and optimizer
    state, so that each is current wherever it is read (see ``_weights`` for the protocol)."""

    def __init__(self, exe, captured, programs, random_seed):
        self.exe = exe
        variables = set(exe.variables)
        self.tensors = {name: t for name, t in captured.tensors.items() if name in variables}
        # Each tensor's coherence Record, looked up once: a Record lives as long as its tensor, which this holds.
        self.records = {name: _weights.record(t) for name, t in self.tensors.items()}
        updated = {state.name for graph in programs.graphs.values() for state in graph.updates}
        updated.update(programs.sharded)  # the host joins the replicas' updated shards (ShardedState)
        self.updated = [name for name in self.tensors if name in updated]
        self.slots = _state_slots(variables, programs.trained)
        self.initial = {name: value for name, value in programs.initial.items() if name in variables}
        self.has_step = STEP in variables
        self.has_scale_factor = LOSS_SCALE_FACTOR in variables
        self.has_seed = RNG_SEED in variables
        self.random_seed = random_seed
        self.generations = {}
        self.optimizer = self.spec = self.opt_generation = None
        self.seeded = False
        # Tensors written from the host since the replicas last took their values (see ReplicaBuffers).
        self.uploaded = set()
        # Parameters with one value per group of replicas (replicaGrouping); set once compiled.
        self.grouped = GroupedParameters({}, {})
        # Optimizer state sharded over the replicas (replicated tensor sharding); set once compiled.
        self.sharded = ShardedState()

    # -- attaching and running ------------------------------------------------------------------
    def attach(self):
        """A freshly attached device: write initial values; every host value is uploaded by ``prepare``."""
        for name, value in self.initial.items():
            self.exe.write_variable(name, value)
        self._write_loss_scale_factor()
        if self.spec is not None:
            self.write_hyper_parameters()
        if self.has_seed and not self.seeded:
            seed = self.random_seed
            seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
            self.exe.write_variable(RNG_SEED, device_seed(seed))
            self.seeded = True
        self.generations.clear()
        self.opt_generation = None

    def prepare(self):
        """Before a run: take host edits and other devices' newer values into account, upload what is stale."""
        stale = []
        for name, tensor in self.tensors.items():
            record = self.records[name]
            version = _weights.version_of(tensor)
            if version != record.version:
                if record.holder is not None:
                    _warn_host_edit(name)
                record.host_changed(version)
            holder = record.holder
            if holder is not None and holder is not self:
                holder.download()
            if self.generations.get(name) != record.generation:
                stale.append((name, tensor, record))
        for name, tensor, record in stale:
            self._write(name, tensor)
            self.generations[name] = record.generation
        if self.optimizer is not None:
            self._prepare_optimizer_state()

    def after_run(self, trained):
        """The device computed new values of the updated tensors (and of the optimizer state if ``trained``)."""
        for name in self.updated:
            self.generations[name] = self.records[name].device_updated(self)
        if trained and self.optimizer is not None and self.slots:
            self.opt_generation = _weights.optimizer_record(self.optimizer).device_updated(self)
        if trained and self.has_scale_factor and self.optimizer is not None:
            # Automatic loss scaling: the host keeps the device's factor (state_dict's ipu_state shows it).
            set_loss_scale_factor(self.optimizer, float(np.array(self.exe.read_variable(LOSS_SCALE_FACTOR))))

    def discard_partial_step(self):
        """Zero the gradient accumulators of an optimizer step that a failure or interrupt cut short."""
        for name, value in self.initial.items():
            if name.startswith(ACCUMULATOR_PREFIX):
                self.exe.write_variable(name, value)
        self.grouped.reset_accumulators(self.exe)

    # -- host <-> device ------------------------------------------------------------------------
    def download(self):
        """Copy every value this device holds newer than the host back into the host tensors and optimizer."""
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                record = self.records[name]
                if record.holder is self:
                    value = torch.from_numpy(self._read_value(name)).to(tensor.dtype)
                    if name in self.grouped.all_replicas:  # the host tensor takes every replica's value
                        tensor.data = value
                    else:
                        tensor.copy_(value.reshape(tensor.shape))
                    record.host_current(_weights.version_of(tensor))
        self.download_optimizer_state()
        _weights.forget_holder(self)

    def upload_all(self):
        """Write every host value to the device (``copyWeightsToDevice``), discarding unsynced device training."""
        self.upload(self.tensors)
        if self.optimizer is not None:
            self.opt_generation = None
            self._prepare_optimizer_state()

    def upload(self, names):
        """Write the host values of the tensors ``names`` to the device."""
        for name in names:
            tensor = self.tensors[name]
            record = self.records[name]
            holder = record.holder
            if holder is not None and holder is not self:
                holder.download()
            self._write(name, tensor)
            if record.holder is self:
                record.host_changed(_weights.version_of(tensor))
            else:
                record.host_current(_weights.version_of(tensor))
            self.generations[name] = record.generation

    def _write(self, name, tensor):
        self._write_value(name, tensor.detach().cpu().numpy())
        self.uploaded.add(name)

    def _write_value(self, name, value):
        """Write a device variable; a grouped one (replicaGrouping) takes every group's value, a sharded one
        (replicated tensor sharding) the whole tensor."""
        if name in self.grouped:
            self.grouped.write(self.exe, name, value)
        elif name in self.sharded:
            self.sharded.write(name, value)
        else:
            self.exe.write_variable(name, value)

    def _read_value(self, name):
        """A device variable's value; a grouped one's holds every group's along its first dimension, a sharded
        one's is the whole tensor."""
        if name in self.sharded:
            return self.sharded.read(name)
        return self.grouped.read(self.exe, name) if name in self.grouped else np.array(self.exe.read_variable(name))

    # -- optimizer ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer, spec):
        """Use ``optimizer``: its state is uploaded if it has one, else the device's state carries over.
        Returns the cycles of writing its hyper-parameters from the host."""
        previous = self.optimizer
        self.spec = spec
        if optimizer is not previous:
            if previous is not None:
                self.download_optimizer_state()
            self.optimizer = optimizer
            record = _weights.optimizer_record(optimizer)
            if previous is None or any(optimizer.state.values()):
                self.opt_generation = None
            else:
                self.opt_generation = record.device_updated(self)
            if self.has_scale_factor and loss_scale_factor(optimizer) is None:
                # As PopTorch's ipu_state, the optimizer shows the factor from compilation on: the initial one,
                # or the one the device reached with the previous optimizer.
                factor = self.initial[LOSS_SCALE_FACTOR] if previous is None else self._read_value(LOSS_SCALE_FACTOR)
                set_loss_scale_factor(optimizer, float(factor))
        return self.write_hyper_parameters()

    def write_hyper_parameters(self):
        """Write the variable hyper-parameters of every parameter group and the loss scaling; returns the
        cycles of those host writes (``popsim.Executable.write_cycles``)."""
        variables = self.exe.variables
        written = {}
        for index, group in enumerate(self.spec.groups):
            for hyper, value in group.values.items():
                name = hyper_name(index, hyper)
                if name in variables:
                    written[name] = value
        if LOSS_SCALING in variables:
            written[LOSS_SCALING] = self.spec.loss_scaling
        for name, value in written.items():
            self.exe.write_variable(name, np.array(value, dtype=np.float32))
        return sum(self.exe.write_cycles(name) for name in written)

    def _prepare_optimizer_state(self):
        record = _weights.optimizer_record(self.optimizer)
        holder = record.holder
        if holder is not None and holder is not self:
            holder.download_optimizer_state()
        if self.opt_generation != record.generation:
            self._write_optimizer_state()
            self.opt_generation = record.generation

    def _write_loss_scale_factor(self):
        """Upload the automatic loss scaling factor the host optimizer holds (the device keeps its own if none)."""
        factor = loss_scale_factor(self.optimizer) if self.optimizer is not None else None
        if self.has_scale_factor and factor is not None:
            self.exe.write_variable(LOSS_SCALE_FACTOR, np.array(factor, dtype=np.float32))

    def _write_optimizer_state(self):
        """Upload the host optimizer state; slots the host has no value for restart from their initial value."""
        self._write_loss_scale_factor()
        steps = {}
        for name, slots in self.slots.items():
            param = self.tensors[name]
            state = self.optimizer.state.get(param) or {}
            for slot, variable in slots.items():
                value = state.get(slot)
                if value is None:
                    self._write_value(variable, self.initial[variable])
                    continue
                _weights.check_state_value(value, param, f"parameter '{name}'", slot)
                self._write_value(variable, value.detach().cpu().numpy())
            if _STEP_SLOT in state:
                steps[name] = float(state[_STEP_SLOT])
        if self.has_step:
            if len(set(steps.values())) > 1:
                raise Error(
                    f"The optimizer state's 'step' differs between parameters ({steps}): the IPU keeps one step "
                    "count for all parameters. Load a state saved from a poptorch model."
                )
            step = next(iter(steps.values()), None)
            self.exe.write_variable(STEP, np.array(step or self.initial[STEP], dtype=np.float32))

    def download_optimizer_state(self):
        """Copy the device optimizer state into ``optimizer.state`` if the device's is newer."""
        optimizer = self.optimizer
        record = _weights.optimizer_record(optimizer) if optimizer is not None else None
        if record is None or record.holder is not self:
            return
        step = float(np.array(self.exe.read_variable(STEP))) if self.has_step else None
        for name, slots in self.slots.items():
            param = self.tensors[name]
            values = {
                slot: torch.from_numpy(self._read_value(variable)).to(param.dtype) for slot, variable in slots.items()
            }
            if step is not None:
                values[_STEP_SLOT] = torch.tensor(step)
            if values:
                optimizer.state[param].update(values)
        record.host_current()


def _state_slots(variables, trained):
    """Trained parameter -> {slot: device variable} for every optimizer-state variable of a parameter."""
    trained = set(trained)
    slots = {name: {} for name in trained}
    for variable in variables:
        if not variable.startswith(_STATE_PREFIX):
            continue
        param, _, slot = variable[len(_STATE_PREFIX) :].rpartition(".")
        if param in trained:
            slots[param][slot] = variable
    return {name: found for name, found in slots.items() if found}


def _warn_host_edit(name):
    warnings.warn(
        f"'{name}' was modified on the host while the IPU held newer values from training that had not been "
        "copied back: the host value is uploaded and that training is discarded. Read the model's parameters "
        "(or call copyWeightsToHost()) before editing them on the host.",
        stacklevel=4,
    )
