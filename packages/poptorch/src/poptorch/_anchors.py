"""Anchored tensors (``Options.anchorTensor``): graph values read back after a run by their PopART names.

PopTorch names a parameter or buffer ``model.<fqn>`` (its wrapper holds the user's module as ``model``), the
gradient the optimizer applies to a parameter ``Gradient___model.<fqn>`` and the parameter's value after
the optimizer step ``UpdatedVar___model.<fqn>``, and its optimizer state after the step by PopART's
prefixes: ``Accl___`` (SGD's momentum buffer), ``Accl1___`` / ``Accl2___`` (Adam, AdamW and LAMB's first and
second moments; RMSprop's mean square and, centred, its mean gradient), ``Accl3___`` (RMSprop's momentum
buffer) and ``Step___`` (Adam, AdamW and LAMB's step count). With gradient accumulation, ``Accum___`` names
the accumulated gradient a step applies (before the mean). The model's inputs are ``input``, ``input/1``...
(in call order) and every value the forward pass computes is ``<module scope>/<Op>:<output>`` (without the
scope after ``Options.disableModuleNamescope()``), made unique with PopART's ``/<n>`` suffix; the ops are
the simulator's (``fc1/MatMul:0``, ``fc1/Add:0``), not always ONNX's. The optimizer's hyper-parameters
carry PopART's names: ``lossScaling_FLOAT``, per parameter SGD's
``scaledLearningRate0___specific___`` (lr x (1 - dampening) / loss scaling) and
``weightDecayScaleFactor0___specific___`` (1 - lr x (1 - dampening) x weight decay) when it has no
momentum, the other optimizers' ``learningRate___specific___`` and ``weightDecay___specific___``.

An anchored value becomes an extra output of the program computing it, so the device streams it to the host
(costed as a host transfer) every time that program runs; the output mode then picks what one call returns
from those runs.
"""

from dataclasses import dataclass, replace

import numpy as np

import popir
from poptorch._optimizer_graph import LOSS_SCALE_FACTOR, LOSS_SCALING, STEP, hyper_name, state_name
from poptorch._training import accumulator_name
from poptorch.enums import OutputMode
from poptorch.errors import Error

MODEL_PREFIX = "model."
GRADIENT = "Gradient___"
ACCUM = "Accum___"
INPUT = "input"
# PopART's hyper-parameter tensors: one per parameter ("specific") and the loss scaling of float32 weights.
SPECIFIC = "___specific___"
LOSS_SCALING_NAME = "lossScaling_FLOAT"
# Roles of the nodes that are not the forward pass (see popir's node annotations).
_NOT_FORWARD = ("backward", "optimizer")
# popir primitive -> PopART op type where camel-casing its name would not give it.
_OP_TYPES = {"matmul": "MatMul", "broadcast_to": "Expand", "where": "Where"}
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


@dataclass(frozen=True)
class Named:
    """An anchorable value: its program, and whether each micro-batch's run gives a value of its own (an
    input or activation) rather than every run of a step the same one (a parameter)."""

    program: str
    value: object  # a popir.Value, or a function making it (hyper-parameters, made only when anchored)
    per_micro_batch: bool = False


def named_values(captured, programs, options, spec=None, group_of=None):
    """PopART long name -> ``Named`` of every value that can be anchored (``spec`` and ``group_of``: the
    optimizer of a training model and each trained parameter's group)."""
    graph = programs.graphs[programs.micro_batch]
    named = _activations(captured, programs, options.module_namescope)
    for fqn in [*captured.parameters, *captured.buffers]:
        try:
            named[MODEL_PREFIX + fqn] = Named(programs.micro_batch, graph.input(fqn))
        except popir.IRError:  # an alias of another input: the graph holds the first name only
            continue
    for fqn, (program, gradient) in programs.gradients.items():
        named[GRADIENT + MODEL_PREFIX + fqn] = Named(program, gradient)
        step = programs.graphs[program]
        # A sharded update's value is one replica's: the host gives the anchor the joined weight (ShardedState).
        named[UPDATED + MODEL_PREFIX + fqn] = Named(program, step.updates[step.input(fqn)])
        if fqn not in programs.sharded:  # a sharded parameter's optimizer state: each replica holds only its shard
            named.update(_optimizer_state(fqn, program, step))
    named.update(_accumulators(programs, options))
    if spec is not None:
        named.update(_hyper_parameters(programs, spec, group_of))
    return named


def _unique(name, taken):
    """``name``, or PopART's ``name/1``, ``name/2``... if taken."""
    unique, count = name, 0
    while unique in taken:
        count += 1
        unique = f"{name}/{count}"
    return unique


def _op_type(op):
    return _OP_TYPES.get(op) or "".join(part.capitalize() for part in op.split("_"))


def _activations(captured, programs, module_namescope=True):
    """The model's inputs and every value its forward pass computes (constants aside), by PopART's names
    (scoped by module unless ``disableModuleNamescope``)."""
    graph = programs.graphs[programs.micro_batch]
    named = {}
    for name in captured.input_names:
        named[_unique(INPUT, named)] = Named(programs.micro_batch, graph.input(name), per_micro_batch=True)
    for node in graph.nodes:
        if node.role in _NOT_FORWARD or node.op == "constant":
            continue
        scope = f"{node.module.replace('.', '/')}/" if node.module and module_namescope else ""
        for index, value in enumerate(node.outputs):
            name = _unique(f"{scope}{_op_type(node.op)}:{index}", named)
            named[name] = Named(programs.micro_batch, value, per_micro_batch=True)
    return named


def _accumulators(programs, options):
    """``Accum___`` of each trained parameter with gradient accumulation: the gradients its step sums (PopART's
    accumulator, before the mean), as the step reads it. Replicas share one accumulator here where PopART gives
    each its own, so it is named only without replication."""
    if options.Training.gradient_accumulation == 1 or programs.step is None:
        return {}
    if options.replication_factor * options.Distributed.numProcesses > 1:
        return {}
    step = programs.graphs[programs.step]
    return {
        ACCUM + MODEL_PREFIX + fqn: Named(programs.step, step.input(accumulator_name(fqn)))
        for fqn in programs.trained
        if fqn not in programs.sharded
    }


def _hyper(graph, spec, group_index, name):
    """A hyper-parameter as the step reads it: its device variable if variable (None if the step reads none),
    else its compiled-in value (a float)."""
    group = spec.groups[group_index]
    if name not in group.variable:
        return float(group.values[name])
    try:
        return graph.input(hyper_name(group_index, name))
    except popir.IRError:
        return None


def _loss_scaling(graph, spec):
    """The loss scaling the step divides the gradients by, as (the optimizer's: a Value or a float, automatic
    loss scaling's factor: a Value or None); None if the step reads no variable holding it."""
    try:
        scale = graph.input(LOSS_SCALING) if spec.loss_scaling_variable else spec.loss_scaling
    except popir.IRError:
        return None
    try:
        return scale, graph.input(LOSS_SCALE_FACTOR)
    except popir.IRError:
        return scale, None


def _in_graph(graph, compute):
    """A Named value made when anchored: ``compute()`` (floats and Values) as a float32 Value of ``graph``."""

    def make():
        value = compute()
        return value if isinstance(value, popir.Value) else graph.constant(np.array(value, dtype=np.float32))

    return make


def _hyper_parameters(programs, spec, group_of):
    """PopART's hyper-parameter tensors of the step, computed in the step program from the values it reads."""
    named = {}
    for fqn, (program, _) in programs.gradients.items():
        graph = programs.graphs[program]
        scaling = _loss_scaling(graph, spec)
        if scaling is None:
            continue
        scale = lambda scaling=scaling: scaling[0] if scaling[1] is None else scaling[1] * scaling[0]  # noqa: E731
        named[LOSS_SCALING_NAME] = Named(program, _in_graph(graph, scale))
        group = spec.groups[group_of[fqn]]
        hyper = {n: _hyper(graph, spec, group_of[fqn], n) for n in _HYPER_NAMES if n in group.values}
        if None in hyper.values():
            continue
        for name, rule in _RULES.get(spec.kind, ()):
            if rule is not _sgd_rule or _no_momentum(group):
                compute = lambda rule=rule, name=name, hyper=hyper, scale=scale: rule(name, hyper, scale())  # noqa: E731
                named[name + MODEL_PREFIX + fqn] = Named(program, _in_graph(graph, compute))
    return named


def _sgd_rule(name, hyper, scale):
    """PopART's SGD0 (no momentum) scaled learning rate and weight decay scale factor."""
    learning = hyper["lr"] * (1.0 - hyper["dampening"])
    if name.startswith(SCALED_LEARNING_RATE):
        return learning / scale
    return 1.0 - learning * hyper["weight_decay"]


def _plain_rule(name, hyper, scale):
    return hyper["lr"] if name.startswith(LEARNING_RATE) else hyper["weight_decay"]


def _no_momentum(group):
    """The rule PopART's SGD0 names belong to: a momentum of 0 compiled in."""
    return "momentum" not in group.variable and group.values.get("momentum", 0.0) == 0.0


SCALED_LEARNING_RATE = "scaledLearningRate0"
LEARNING_RATE = "learningRate"
_HYPER_NAMES = ("lr", "dampening", "weight_decay")
_PLAIN = ((LEARNING_RATE + SPECIFIC, _plain_rule), ("weightDecay" + SPECIFIC, _plain_rule))
_RULES = {
    "sgd": ((SCALED_LEARNING_RATE + SPECIFIC, _sgd_rule), ("weightDecayScaleFactor0" + SPECIFIC, _sgd_rule)),
    "adam": _PLAIN,
    "adamw": _PLAIN,
    "lamb": _PLAIN,
    "rmsprop": _PLAIN,
}


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
        named[prefix + MODEL_PREFIX + fqn] = Named(program, value)
    if "exp_avg" in slots and STEP in updated:
        named[STEP_PREFIX + MODEL_PREFIX + fqn] = Named(program, updated[STEP])
    return named


def resolve(requests, options):
    """The model's anchors from ``Options.anchorTensor`` requests (mode None: the model's output mode)."""
    anchors = []
    for short_name, long_name, mode, period in requests:
        if mode is None or mode == OutputMode.Default:
            mode, period = options.output_mode, options.output_return_period
        anchors.append(Anchor(short_name, long_name, mode, period if mode == OutputMode.EveryN else 1))
    return anchors


def _known_name(long_name, named):
    """``long_name`` as ``named`` spells it: PopTorch 3.x names a parameter's tensors without the ``model.``
    scope (``Gradient___fc2.bias``) where older releases wrote ``Gradient___model.fc2.bias``; both are taken."""
    if long_name in named:
        return long_name
    head, sep, fqn = long_name.rpartition("___")
    scoped = head + sep + MODEL_PREFIX + fqn
    return scoped if scoped in named else long_name


class Anchors:
    """A compiled model's anchorable tensor names and its anchors, each an output of its program."""

    def __init__(self, names, anchors, runs):
        self.names = names
        self._anchors = anchors
        # short name -> which runs give its values: "step" (the step program's), "micro_batch" (each of the
        # per-micro-batch program's), "first" (the first micro-batch's of each step).
        self._runs = runs

    @classmethod
    def of(cls, captured, programs, options, spec=None, group_of=None):
        """Name the anchorable values of ``programs`` and make each anchored one an output of its program;
        an unknown long name is an error. ``spec`` and ``group_of``: a training model's optimizer and the
        parameter group of each trained parameter."""
        named = named_values(captured, programs, options, spec, group_of)
        anchors = [
            replace(a, long_name=_known_name(a.long_name, named)) for a in resolve(options.anchored_tensors, options)
        ]
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
            found = named[anchor.long_name]
            value = found.value() if callable(found.value) else found.value
            programs.graphs[found.program].output(OUTPUT_PREFIX + anchor.long_name, value)
        runs = {a.short_name: _runs(named[a.long_name], programs) for a in anchors}
        return cls(sorted(named), anchors, runs)

    def read(self, per_output, layout):
        """short name -> each anchor's value after one call (``per_output``: every run's outputs), as its
        output mode selects. A parameter read by the micro-batch program gives one value per step (training)
        or per device iteration (inference): every replica and accumulated micro-batch reads the same one;
        an input or activation gives one per micro-batch."""
        values = {}
        for anchor in self._anchors:
            stride = layout.ga * layout.r if self._runs[anchor.short_name] == _FIRST else 1
            values[anchor.short_name] = _select(per_output[OUTPUT_PREFIX + anchor.long_name][::stride], anchor)
        return values


_FIRST, _EACH, _STEP = "first", "micro_batch", "step"


def _runs(found, programs):
    if found.program != programs.micro_batch:
        return _STEP
    return _EACH if found.per_micro_batch else _FIRST


def _select(runs, anchor):
    if anchor.mode == OutputMode.Final:
        return runs[-1]
    if anchor.mode == OutputMode.Sum:
        return np.sum(runs, axis=0)
    if anchor.mode == OutputMode.EveryN:
        runs = runs[anchor.period - 1 :: anchor.period]
    # As PopART's anchor arrays: one leading dimension over the values, dropped when there is only one.
    return runs[0] if len(runs) == 1 else np.stack(runs)
