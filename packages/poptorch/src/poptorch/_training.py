"""Turn a captured forward graph into the device programs of a wrapped model.

Inference: one program, ``inference``. Training with gradientAccumulation x replicationFactor == 1: one
fused program, ``train`` (forward, backward, optimizer step). Otherwise two programs sharing device
variables by name: ``accumulate`` (forward and backward, gradients added into ``_accum.<param>``
variables), run once per micro-batch, and ``apply`` (optimizer step from the reduced accumulators, which
it then resets). Replicas are simulated as extra micro-batches of the same step. With several processes
(``Options.Distributed``) every process runs its own replicas and the processes sum their accumulators
between ``accumulate`` and ``apply`` (``_distributed.all_reduce_sum``).
"""

from dataclasses import dataclass, field

import numpy as np

import popir
from poptorch import _blocks, _host_print
from poptorch._optimizer_graph import OptimizerBuilder, replica_shard
from poptorch.enums import MeanReductionStrategy, ReductionType
from poptorch.errors import Error

RNG_SEED = "_rng_seed"
ACCUMULATOR_PREFIX = "_accum."
# Micro-batches accumulated so far in the current step (MeanReductionStrategy.Running divides by it). Under
# ACCUMULATOR_PREFIX, so a step cut short resets it with the accumulators; "#" appears in no parameter name.
ACCUM_COUNT = ACCUMULATOR_PREFIX + "#micro_batches"
# Automatic loss scaling's count of large gradient elements over the step's micro-batches (reset likewise).
LARGE_COUNT = ACCUMULATOR_PREFIX + "#large_gradient_elements"
NO_LOSS = "Couldn't find a loss in graph!"
MANY_LOSSES = (
    "Multiple independent losses found in graph. Graph must have one final loss. "
    "Wrap final graph loss in poptorch.identity_loss."
)


def accumulator_name(param):
    """Device variable accumulating the gradient of ``param`` between optimizer steps."""
    return f"{ACCUMULATOR_PREFIX}{param}"


@dataclass
class Programs:
    """The graphs to compile, the per-micro-batch program, the step program (or None) and new variables."""

    graphs: dict
    micro_batch: str
    step: str | None = None
    initial: dict = field(default_factory=dict)
    trained: list = field(default_factory=list)
    # Trained parameter -> (program, the gradient its optimizer step applies), for anchors.
    gradients: dict = field(default_factory=dict)
    # Trained parameter -> replicas its optimizer state and update are sharded over (replicated tensor sharding).
    sharded: dict = field(default_factory=dict)
    # The micro-batch program's output holding the final loss (None if the model does not return it).
    loss: str | None = None


def build_inference(captured):
    """The single inference program."""
    _advance_rng(captured.graph)
    return Programs({"inference": captured.graph}, "inference")


def _advance_rng(graph):
    """Give each run fresh random numbers: the seed's second word counts runs."""
    try:
        seed = graph.input(RNG_SEED)
    except popir.IRError:
        return
    if seed not in graph.updates:
        graph.update(seed, seed + graph.constant(np.array([0, 1], dtype=np.int32)))


def the_loss(captured):
    """The one final loss of a captured training graph, else the PopTorch error."""
    if not captured.losses:
        raise Error(NO_LOSS)
    if len(captured.losses) > 1:
        raise Error(MANY_LOSSES)
    loss = captured.losses[0]
    if not loss.dtype.is_float:
        raise Error(f"The loss must be a floating point tensor, got {loss.dtype}")
    if loss.shape:
        # Eager torch refuses backward() of a non-scalar ("grad can be implicitly created only for scalar
        # outputs"); summing it silently would train on a loss the user did not write.
        raise Error(
            f"The final loss must be a scalar, got shape {list(loss.shape)}{_where(loss)}: reduce it (a torch loss "
            "with reduction='mean' or 'sum', or poptorch.identity_loss(x, reduction='mean'))"
        )
    return loss


def _refuse_written_parameters(graph, candidates):
    """A parameter to train that the forward pass writes in place (``with torch.no_grad(): w.clamp_(...)``):
    eager steps from the written value with the gradient at it, which the update (from the parameter as read,
    and reaching none when the forward reads only the written value) does not model: refused rather than
    losing the write or the step."""
    for name in candidates:
        written = graph.updates.get(graph.input(name))
        if written is not None:
            raise Error(
                f"The model's forward pass writes the trained parameter {name} in place{_where(written)}, which "
                "the IPU model cannot combine with the optimizer's update: make the change outside forward (on "
                "the host between steps, then copyWeightsToDevice()), or use the changed value without writing "
                "the parameter"
            )


def _where(value):
    source = value.producer.source if value.producer is not None else None
    return f" (at {source})" if source else ""


def build_training(captured, spec, group_of, options, on_phase=lambda phase: None, own_counts=(), sharded=None):
    """Training programs for ``captured`` with the optimizer ``spec``.

    ``group_of`` maps each trained parameter's name to its parameter-group index (parameters outside the
    optimizer are not trained). ``on_phase`` is told when autodiff and the optimizer update start. The
    parameters in ``own_counts`` (grouped over replicas) count their own micro-batches for a Running mean.
    The step updates each parameter of ``sharded`` ({name: replicas}) on one replica's shard of it.
    """
    graph = captured.graph
    loss = the_loss(captured)
    candidates = [name for name in captured.parameters if name not in captured.frozen and name in group_of]
    _refuse_written_parameters(graph, candidates)
    sharded = dict(sharded or {})
    builder = OptimizerBuilder(spec, options.Training.automatic_loss_scaling_settings, sharded)
    on_phase("autodiff")
    printed = _host_print.gradient_requests(graph)
    grads = popir.autodiff.grad(
        graph,
        loss,
        [graph.input(n) for n in candidates] + [value for _, _, value in printed],
        seed=builder.loss_seed(graph, loss),
        unreached="none",
    )
    grads, printed_grads = grads[: len(candidates)], grads[len(candidates) :]
    for (index, title, value), gradient in zip(printed, printed_grads):
        _host_print.record_gradient(graph, index, title, gradient if gradient is not None else value * 0.0)
    # As in torch, a parameter no gradient reaches (unused, or used only under torch.no_grad() or detach())
    # has no .grad, so the optimizer leaves it and its state alone: no weight decay, no momentum step.
    grads = {name: g for name, g in zip(candidates, grads) if g is not None}
    trained = [name for name in candidates if name in grads]
    sharded = {name: replicas for name, replicas in sharded.items() if name in grads}
    params = {name: graph.input(name) for name in trained}
    placements = _blocks.update_placements(grads, options.execution_strategy)
    loss_output = next((name for name, v in graph.outputs.items() if v is loss), None)
    _advance_rng(graph)
    on_phase("optimise")
    micro_batches = options.replication_factor * options.Training.gradient_accumulation
    processes = options.Distributed.numProcesses
    # Several processes sum their accumulators between the two programs, so they need the split form.
    if micro_batches == 1 and processes == 1:
        with graph.annotate(role="optimizer"):
            builder.apply(graph, params, grads, group_of, placements=placements)
        if placements:
            _blocks.order_updates(graph)
        gradients = {name: ("train", grads[name]) for name in trained}
        return Programs({"train": graph}, "train", None, builder.initial, trained, gradients, loss=loss_output)

    initial = {}
    apply = popir.Graph(f"{graph.name}_apply")
    step_params, reduced, gradients, resets = {}, {}, {}, []
    mean = options.Training.accumulation_and_replication_reduction_type == ReductionType.Mean
    running = mean and options.Training.mean_reduction_strategy == MeanReductionStrategy.Running
    shared_counts = {}  # placement -> the Running mean's micro-batch count of the accumulators placed there

    def step_gradient(summed):
        return _mean_of_sum(summed, micro_batches * processes, running, processes) if mean else summed

    # Accumulating and resetting the gradients is optimizer work in profiles.
    with graph.annotate(role="optimizer"), apply.annotate(role="optimizer"):
        for name in trained:
            p, g = params[name], grads[name]
            # The optimizer's accum_type, when given, is the accumulator's dtype (PopART's accumType).
            acc_dtype = popir.as_dtype(spec.accumulator_dtype) if spec.accumulator_dtype else g.dtype
            acc = graph.add_input(accumulator_name(name), p.shape, acc_dtype.value, kind="optimizer_state")
            initial[acc.name] = np.zeros(p.shape, dtype=acc_dtype.numpy)
            # Running: the accumulator holds the mean so far, acc + (g - acc) / n, so it never exceeds the
            # gradients' range; Post: it holds the sum, divided once by the step.
            # Accumulated in its gradient's phase, or pipeline stage's backward pass, as PopART accumulates it.
            placement = _blocks.accumulation_placement(g)
            count = None
            if running and name in own_counts:
                count = _running_count(graph, apply, initial, running_count_name(name), placement)
            elif running:
                if placement not in shared_counts:
                    shared = _running_count(graph, apply, initial, shared_count_name(placement), placement)
                    shared_counts[placement] = shared
                count = shared_counts[placement]
            with graph.placed(placement):
                g = _cast(g, acc_dtype)
                graph.update(acc, acc + (g - acc) / _cast(count, g.dtype) if running else acc + g)
            step_params[name] = apply.add_input(name, p.shape, p.dtype.value, kind="parameter")
            step_acc = apply.add_input(acc.name, p.shape, acc_dtype.value, kind="optimizer_state")
            reduced[name] = step_gradient(step_acc)
            gradients[name] = ("apply", reduced[name])
            if name in sharded:  # the replica updates its shard of the weight from its shard of the gradient
                reduced[name] = step_gradient(replica_shard(step_acc, sharded[name]))
            resets.append((step_acc, placement))
        large_counts = None
        if builder.automatic_loss_scaling:
            large_counts = _large_counts(builder, graph, apply, initial, grads, micro_batches * processes)
        builder.apply(apply, step_params, reduced, group_of, large_counts)
        _reset_accumulators(apply, resets)
    if placements:
        _blocks.order_updates(graph)
    initial.update(builder.initial)
    graphs = {"accumulate": graph, "apply": apply}
    return Programs(graphs, "accumulate", "apply", initial, trained, gradients, sharded, loss_output)


def _reset_accumulators(apply, resets):
    """Zero each accumulator of ``resets`` ([(accumulator, placement)]) after the step has read it, as PopART
    zeroes an accumulator in place on its own IPU: the zeros are made on the accumulator's placement, at the
    end of the step (not live through the update), and never cross an IPU-Link."""
    for accumulator, placement in resets:
        with apply.placed(placement):
            apply.update(accumulator, _zeros(apply, accumulator.shape, accumulator.dtype))


def _large_counts(builder, graph, apply, initial, grads, micro_batches):
    """Automatic loss scaling over a step's micro-batches (as PopART accumulates its histograms): each counts
    its large gradient elements into variables the step reads and resets, one per placement of the tracked
    gradients, counted and reset on its own IPU, so only the step's sum of them crosses an IPU-Link. Replicas
    run as micro-batches of the shared counts and processes sum them with the accumulators, so every replica
    takes the same decision from the counts over all ``micro_batches`` (of every replica and process)."""
    larges, elements = builder.count_large_gradients_by_placement(grads)
    total = None
    for placement, large in larges.items():
        name = large_count_name(placement)
        count = graph.add_input(name, (), "float32", kind="optimizer_state")
        initial[name] = np.zeros((), dtype=np.float32)
        with graph.placed(placement):
            graph.update(count, count + large)
        step_count = apply.add_input(name, (), "float32", kind="optimizer_state")
        total = step_count if total is None else total + step_count
        with apply.placed(placement):
            apply.update(step_count, apply.constant(np.float32(0)))
    return total, elements * micro_batches


def large_count_name(placement):
    """Device variable counting automatic loss scaling's large gradient elements produced on ``placement``
    (None in a model without blocks)."""
    return LARGE_COUNT if placement is None else f"{LARGE_COUNT}.stage{placement[0]}.ipu{placement[1]}"


def summed_over_processes(programs):
    """The device variables the processes sum between ``accumulate`` and ``apply``: the gradient
    accumulators and automatic loss scaling's count of large gradient elements."""
    names = [accumulator_name(name) for name in programs.trained]
    return names + [name for name in programs.initial if name.startswith(LARGE_COUNT)]


def _mean_of_sum(summed, micro_batches, running, processes):
    """The mean gradient from an accumulator the processes have summed: each held the sum of its
    micro-batches' gradients (Post) or their running mean (Running)."""
    count = processes if running else micro_batches
    return summed * (1.0 / count) if count > 1 else summed


def running_count_name(param):
    """Device variable counting the micro-batches of ``param``'s own Running mean (a grouped parameter's
    group runs only some of the micro-batches)."""
    return f"{ACCUM_COUNT}.{param}"


def shared_count_name(placement):
    """Device variable counting the micro-batches of a Running mean for the accumulators on ``placement`` (a
    (stage or phase, IPU) pair, or None in a model without blocks): PopART keeps one counter per IPU and
    pipeline stage, beside the accumulators that read it, so no count crosses an IPU-Link."""
    return ACCUM_COUNT if placement is None else f"{ACCUM_COUNT}.stage{placement[0]}.ipu{placement[1]}"


def _running_count(graph, apply, initial, name, placement):
    """The micro-batch count ``name`` of a Running mean: counted up by ``graph`` and reset by ``apply``, both
    on ``placement`` (that of the accumulators reading it); returns the count including the current
    micro-batch."""
    count = graph.add_input(name, (), "float32", kind="optimizer_state")
    initial[name] = np.zeros((), dtype=np.float32)
    with graph.placed(placement):
        counted = count + graph.constant(np.float32(1))
    graph.update(count, counted)
    step_count = apply.add_input(name, (), "float32", kind="optimizer_state")
    with apply.placed(placement):
        apply.update(step_count, apply.constant(np.float32(0)))
    return counted


def _cast(value, dtype):
    return value if value.dtype == dtype else popir.ops.cast(value, dtype=dtype.value)


def _zeros(graph, shape, dtype):
    zero = graph.constant(np.zeros((), dtype=dtype.numpy))
    return popir.ops.broadcast_to(zero, shape=shape) if shape else zero


def optimise(programs):
    """Run popir's optimisation passes over every program."""
    programs.graphs = {name: popir.passes.optimize(graph) for name, graph in programs.graphs.items()}
    return programs
