"""Anchored tensors (``Options.anchorTensor``): graph values read back after a run by their PopART names.

PopTorch names a parameter or buffer ``model.<fqn>`` (its wrapper holds the user's module as ``model``), the
gradient the optimizer applies to a parameter ``Gradient___model.<fqn>`` and the parameter's value after
the optimizer step ``UpdatedVar___model.<fqn>``, and its optimizer state after the step by PopART's
prefixes: ``Accl___`` (SGD's momentum buffer), ``Accl1___`` / ``Accl2___`` (Adam, AdamW and LAMB's first and
second moments; RMSprop's mean square and, centred, its mean gradient), ``Accl3___`` (RMSprop's momentum
buffer) and ``Step___`` (Adam, AdamW and LAMB's step count). An anchored value becomes an extra output of the program
computing it, so the device streams it to the host (costed as a host transfer) every time that program
runs; the output mode then picks what one call returns from those runs.
"""

from dataclasses import dataclass

import numpy as np

import popir
from poptorch._optimizer_graph import STEP, state_name
from poptorch.enums import OutputMode
from poptorch.errors import Error

MODEL_PREFIX = "model."
GRADIENT = "Gradient___"
UPDATED = "UpdatedVar___"
STEP_PREFIX = "Step___"
# PopART's prefix of each optimizer state slot (torch's name); a momentum buffer is Accl___ (SGD) or, next to
# RMSprop's square_avg, Accl3___.
STATE_PREFIXES = {"exp_avg": "Accl1___", "exp_avg_sq": "Accl2___", "square_avg": "Accl1___", "grad_avg": "Accl2___"}
MOMENTUM = "momentum_buffer"
SGD_MOMENTUM_PREFIX = "Accl___"
RMSPROP_MOMENTUM_PREFIX = "Accl3___"
# Graph outputs carrying anchors; "#" appears in no user output name.
OUTPUT_PREFIX = "#anchor:"
NOT_COMPILED = "Model must be compiled before calling getTensorNames"
NOT_FOUND = "No tensor with name {} found."


@dataclass(frozen=True)
class Anchor:
    """One ``anchorTensor`` request, its output mode resolved against the model's."""

    short_name: str
    long_name: str
    mode: OutputMode
    period: int


def named_values(captured, programs):
    """PopART long name -> (program name, Value) of every value that can be anchored."""
    graph = programs.graphs[programs.micro_batch]
    named = {}
    for fqn in [*captured.parameters, *captured.buffers]:
        try:
            named[MODEL_PREFIX + fqn] = (programs.micro_batch, graph.input(fqn))
        except popir.IRError:  # an alias of another input: the graph holds the first name only
            continue
    for fqn, (program, gradient) in programs.gradients.items():
        named[GRADIENT + MODEL_PREFIX + fqn] = (program, gradient)
        step = programs.graphs[program]
        # A sharded update's value is one replica's: the host gives the anchor the joined weight (ShardedState).
        named[UPDATED + MODEL_PREFIX + fqn] = (program, step.updates[step.input(fqn)])
        if fqn not in programs.sharded:  # a sharded parameter's optimizer state: each replica holds only its shard
            named.update(_optimizer_state(fqn, program, step))
    return named


def _optimizer_state(fqn, program, step):
    """PopART long name -> (program, value after the step) of the optimizer state of parameter ``fqn``."""
    updated = {state.name: value for state, value in step.updates.items()}
    slots = {
        slot: updated[state_name(fqn, slot)] for slot in (*STATE_PREFIXES, MOMENTUM) if state_name(fqn, slot) in updated
    }
    named = {}
    for slot, value in slots.items():
        prefix = STATE_PREFIXES.get(slot)
        if prefix is None:
            prefix = RMSPROP_MOMENTUM_PREFIX if "square_avg" in slots else SGD_MOMENTUM_PREFIX
        named[prefix + MODEL_PREFIX + fqn] = (program, value)
    if "exp_avg" in slots and STEP in updated:
        named[STEP_PREFIX + MODEL_PREFIX + fqn] = (program, updated[STEP])
    return named


def resolve(requests, options):
    """The model's anchors from ``Options.anchorTensor`` requests (mode None: the model's output mode)."""
    anchors = []
    for short_name, long_name, mode, period in requests:
        if mode is None or mode == OutputMode.Default:
            mode, period = options.output_mode, options.output_return_period
        anchors.append(Anchor(short_name, long_name, mode, period if mode == OutputMode.EveryN else 1))
    return anchors


class Anchors:
    """A compiled model's anchorable tensor names and its anchors, each an output of its program."""

    def __init__(self, names, anchors, per_micro_batch):
        self.names = names
        self._anchors = anchors
        # short name -> whether its program is the per-micro-batch one (else the per-step one).
        self._per_micro_batch = per_micro_batch

    @classmethod
    def of(cls, captured, programs, options):
        """Name the anchorable values of ``programs`` and make each anchored one an output of its program;
        an unknown long name is an error."""
        named = named_values(captured, programs)
        anchors = resolve(options.anchored_tensors, options)
        for anchor in anchors:
            if anchor.long_name not in named:
                raise Error(
                    f"anchorTensor({anchor.short_name!r}, {anchor.long_name!r}): the model has no tensor named "
                    f"{anchor.long_name!r}. getTensorNames() lists the names: {', '.join(sorted(named)) or 'none'}"
                )
            if anchor.mode == OutputMode.EveryN and options.device_iterations % anchor.period:
                raise Error(
                    f"anchorTensor({anchor.short_name!r}): OutputMode.EveryN({anchor.period}) needs a period dividing "
                    f"the {options.device_iterations} device iterations of each call (one value per iteration)"
                )
            program, value = named[anchor.long_name]
            programs.graphs[program].output(OUTPUT_PREFIX + anchor.long_name, value)
        per_micro_batch = {a.short_name: named[a.long_name][0] == programs.micro_batch for a in anchors}
        return cls(sorted(named), anchors, per_micro_batch)

    def read(self, per_output, layout):
        """short name -> each anchor's value after one call (``per_output``: every run's outputs), as its
        output mode selects. A micro-batch program gives one value per step (training) or per device
        iteration (inference): every replica and accumulated micro-batch reads the same parameters."""
        values = {}
        for anchor in self._anchors:
            stride = layout.ga * layout.r if self._per_micro_batch[anchor.short_name] else 1
            values[anchor.short_name] = _select(per_output[OUTPUT_PREFIX + anchor.long_name][::stride], anchor)
        return values


def _select(runs, anchor):
    if anchor.mode == OutputMode.Final:
        return runs[-1]
    if anchor.mode == OutputMode.Sum:
        return np.sum(runs, axis=0)
    if anchor.mode == OutputMode.EveryN:
        runs = runs[anchor.period - 1 :: anchor.period]
    # As PopART's anchor arrays: one leading dimension over the values, dropped when there is only one.
    return runs[0] if len(runs) == 1 else np.stack(runs)
