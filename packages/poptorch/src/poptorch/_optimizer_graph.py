"""Optimizer update rules as popir: SGD, Adam, AdamW, RMSprop (torch's formulas) and LAMB.

``OptimizerBuilder.apply`` appends, to a program graph, the update of every trained parameter from its
(already reduced) gradient, and ``graph.update``s the parameters and the optimizer state. Variable
hyper-parameters are scalar ``optimizer_state`` inputs named ``hyper_name(group, name)``, written by the
executor; constant ones are compiled in and vanish when they are 0 (no weight decay, no momentum...).
"""

import numpy as np

from popir import DType, IRError
from poptorch.errors import Error

STEP = "_opt.step"
LOSS_SCALING = "_opt.loss_scaling"
# Automatic loss scaling multiplies the optimizer's loss scaling by this device variable (PopART's
# lossScaleUpdateFactor, starting at 1), halved or doubled after each step.
LOSS_SCALE_FACTOR = "_opt.loss_scale_update_factor"
# Gradient elements from binEdgeLocation times float16's maximum are "large"; more large elements than
# thresholdUpperCountProportion of all tracked elements halve the factor, else it doubles.
FP16_MAX = float(np.finfo(np.float16).max)
# Steps left before automatic loss scaling next updates its factor (with an updatePeriod above 1).
ALS_COUNTDOWN = "_opt.loss_scale_update_countdown"
# PopART's default tracked tensors: the float16 outputs of the backward pass's matmuls and convolutions.
_TRACKED_OPS = ("matmul", "conv")
# PopART clips the factor so the final scale stays at most 2**15, the largest power of 2 float16 holds.
ALS_MAX_SCALE = 2.0**15


def hyper_name(group_index, name):
    """Device variable holding a variable hyper-parameter of a parameter group."""
    return f"_opt.group{group_index}.{name}"


def state_name(param, slot):
    """Device variable holding optimizer state ``slot`` (torch's name, e.g. exp_avg) of parameter ``param``."""
    return f"_opt.{param}.{slot}"


# Replicated tensor sharding: per norm over a sharded tensor, the replica's partial sum of squares and the sum
# over every replica (the all-reduce).
SHARD_PREFIX = "_rts."


def partial_norm_name(index):
    return f"{SHARD_PREFIX}#partial_norm.{index}"


def summed_norm_name(index):
    return f"{SHARD_PREFIX}#summed_norm.{index}"


def shard_size(size, replicas):
    """Elements of each replica's shard of a tensor of ``size`` elements: ceil(size / replicas), as PopART
    (the last shards end with zero padding)."""
    return -(-size // replicas)


def replica_shard(value, replicas):
    """Elements 0, replicas, 2 x replicas... of ``value`` flattened (``shard_size`` of them), where the host
    places a replica's shard of a gradient before its optimizer step (see ``_replication.ShardedState``):
    spread over the tiles like the whole tensor, so the shard's update needs no exchange."""
    size = value.type.size
    flat = _op("reshape", value, shape=(size,)) if value.ndim != 1 else value
    return _op("slice", flat, starts=(0,), stops=(size,), steps=(replicas,))


def with_replica_shard(whole, shard, replicas):
    """``whole`` with ``shard`` at the elements ``replica_shard`` reads, so a step updates the whole weight
    variable in place from the shard it computed: the shard's elements are copied into the variable, on the
    tiles that hold them, and the rest of the weight is left as it is."""
    size = whole.type.size
    flat = _op("reshape", whole, shape=(size,)) if whole.ndim != 1 else whole
    updated = _op("slice_update", flat, shard, starts=(0,), stops=(size,), steps=(replicas,))
    return _op("reshape", updated, shape=whole.shape) if whole.ndim != 1 else updated


def _op(name, *inputs, **attrs):
    """Apply a popir primitive by its registry name."""
    return inputs[0].graph.apply(name, inputs, attrs)[0]


def _is_zero(h):
    return not hasattr(h, "graph") and h == 0


def _each_placed(graph, placements, grads, transform, unless_dtype=None):
    """{name: ``transform``(gradient)}, each made in its parameter's placement (``placements``), so it runs in
    the phase of its gradient; a gradient of dtype ``unless_dtype`` is left as it is."""
    out = {}
    for name, g in grads.items():
        with graph.annotate(placement=placements.get(name)):
            out[name] = g if g.dtype == unless_dtype else transform(g)
    return out


def _is_one(h):
    return not hasattr(h, "graph") and h == 1


def _scalar(graph, h):
    return h if hasattr(h, "graph") else graph.constant(np.array(h, dtype=np.float32))


class OptimizerBuilder:
    """Builds one OptimizerSpec's update rule into graphs; records the initial value of every new variable."""

    def __init__(self, spec, automatic_loss_scaling=None, sharded=()):
        """``automatic_loss_scaling``: PopART's settings by name (``Training.automatic_loss_scaling_settings``),
        or None when disabled."""
        self.spec = spec
        self.automatic_loss_scaling = automatic_loss_scaling
        self.initial = {}
        # Parameters whose update each replica computes on its shard only (replicated tensor sharding), and the
        # replicas: ``apply`` takes the shard from the whole weight it is given, the gradient it is given is the
        # shard, and norms over them are all-reduced.
        self.sharded = dict(sharded)
        self.norms = 0  # sums of squares over sharded tensors, all-reduced over the replicas

    # -- variables ------------------------------------------------------------------------------
    def _variable(self, graph, name, shape, dtype, fill):
        try:
            return graph.input(name)
        except IRError:
            self.initial.setdefault(name, np.full(shape, fill, dtype=np.dtype(dtype)))
            return graph.add_input(name, shape, dtype, kind="optimizer_state")

    def hyper(self, graph, group_index, name):
        """A hyper-parameter: a scalar Value if variable, else its float value."""
        group = self.spec.groups[group_index]
        if name not in group.variable:
            return group.values[name]
        return self._variable(graph, hyper_name(group_index, name), (), "float32", group.values[name])

    def loss_scaling(self, graph):
        """The loss scaling factor: a Value if variable or automatic, else a float."""
        scale = self._base_loss_scaling(graph)
        if self.automatic_loss_scaling:
            return self._variable(graph, LOSS_SCALE_FACTOR, (), "float32", 1.0) * scale
        return scale

    def _base_loss_scaling(self, graph):
        """The optimizer's own loss scaling: a Value if variable, else a float."""
        if self.spec.loss_scaling_variable:
            return self._variable(graph, LOSS_SCALING, (), "float32", self.spec.loss_scaling)
        return self.spec.loss_scaling

    def loss_seed(self, graph, loss):
        """The cotangent that starts backpropagation: loss_scaling (1 unless set) in the loss's shape."""
        scale = self.loss_scaling(graph)
        if _is_one(scale):
            return None
        value = _op("cast", _scalar(graph, scale), dtype=loss.dtype.value)
        return _op("broadcast_to", value, shape=loss.shape) if loss.shape else value

    def _state(self, graph, name, param, slot, fill, dtype_attr):
        dtype = self.spec.state_dtypes.get(dtype_attr) or self.spec.state_dtypes.get("accum_type", "float32")
        if dtype == "float32" and param.dtype != DType.float32:
            dtype = param.dtype.value
        value = self._variable(graph, state_name(name, slot), param.shape, dtype, fill)
        return value, (_op("cast", value, dtype="float32") if value.dtype != DType.float32 else value)

    def _store(self, graph, variable, new):
        graph.update(variable, _op("cast", new, dtype=variable.dtype.value) if new.dtype != variable.dtype else new)

    def _step(self, graph):
        step = self._variable(graph, STEP, (), "float32", 0.0)
        return step, step + 1.0

    # -- the update -----------------------------------------------------------------------------
    def apply(self, graph, params, grads, group_of, large_counts=None, placements=None):
        """Update each parameter Value in ``params`` (by name) from ``grads[name]``; ``group_of[name]`` its group.
        With automatic loss scaling, ``large_counts`` is (large elements, elements) over the step's micro-batches
        if they were counted elsewhere, else ``grads`` are counted here. ``placements`` ({name: placement}) puts
        a parameter's update in a phase and on an IPU."""
        placements = placements or {}
        scale = self.loss_scaling(graph)
        if self.automatic_loss_scaling:
            self._update_loss_scale_factor(graph, *(large_counts or self.count_large_gradients(grads)))
        grads = _each_placed(graph, placements, grads, lambda g: _op("cast", g, dtype="float32"), DType.float32)
        if not _is_one(scale):
            grads = _each_placed(graph, placements, grads, lambda g: g / scale)
        if self.spec.max_grad_norm is not None:
            grads = self._clip(graph, grads)
        step, t = self._step(graph) if self._needs_step() else (None, None)
        rule = getattr(self, f"_{self.spec.kind}")

        def own(name):  # a parameter's update belongs to its module in profiles ("fc1.weight" -> "fc1")
            return graph.annotate(module=name.rpartition(".")[0], placement=placements.get(name))

        shards = []  # the sharded parameters' weight and gradient shards
        # The sharded parameters last, one after another: each one's write-back then shares an exchange phase
        # with the next one's gradient slice (or the step's final copies).
        for name in sorted(params, key=lambda name: name in self.sharded):
            p = params[name]
            with own(name):
                p32 = replica_shard(p, self.sharded[name]) if name in self.sharded else p
                shards += [p32, grads[name]] if name in self.sharded else []
                p32 = _op("cast", p32, dtype="float32") if p.dtype != DType.float32 else p32
                new = rule(graph, group_of[name], name, p32, grads[name], t)
                new = _op("cast", new, dtype=p.dtype.value) if p.dtype != DType.float32 else new
                # A shard is written back as soon as it is updated: it dies there, instead of living beside the
                # next parameters' shards (an exchange phase each: a few syncs for less peak tile memory).
                graph.update(p, with_replica_shard(p, new, self.sharded[name]) if name in self.sharded else new)
        if step is not None:
            graph.update(step, t)
        _sink_before_first_reader(graph, shards)

    def count_large_gradients(self, grads):
        """Automatic loss scaling's statistics: (a float32 Value counting the elements of the tracked float16
        gradients at or above the bin edge, the number of tracked elements)."""
        counts, elements = self.count_large_gradients_by_placement(grads)
        upper = None
        for count in counts.values():
            upper = count if upper is None else upper + count
        return upper, elements

    def count_large_gradients_by_placement(self, grads):
        """As ``count_large_gradients``, the large elements counted apart on each placement (a (stage or phase,
        IPU) pair, or None) of the tracked gradients' producers, each on its own IPU as PopART's histograms
        are: ({placement: float32 Value}, the number of tracked elements)."""
        tracked = _tracked_gradients(grads.values())
        if not tracked:
            raise Error(
                "Automatic loss scaling tracks the float16 gradients that the backward pass's matmuls and "
                "convolutions produce, and this model has none: train a float16 model (model.half()) or disable "
                "Training.setAutomaticLossScaling"
            )
        graph = tracked[0].graph
        counts = {}
        for g in tracked:
            placement = g.producer.placement
            with graph.placed(placement):
                edge = _scalar(graph, self.automatic_loss_scaling["binEdgeLocation"] * FP16_MAX)
                large = _op("cast", _op("ge", _op("abs", _op("cast", g, dtype="float32")), edge), dtype="float32")
                count = _op("reduce_sum", large, axes=None, keepdims=False)
                counts[placement] = count if placement not in counts else counts[placement] + count
        return counts, sum(int(np.prod(g.shape)) for g in tracked)

    def _update_loss_scale_factor(self, graph, upper, elements):
        """PopART's rule: halve the factor if more than the threshold proportion of elements are large, else
        double it; clip it so the final scale stays within float16's powers of 2. With an update period P, only
        the first step of every P (counted from compilation) updates it, from that step's gradients."""
        settings = self.automatic_loss_scaling
        too_large = _op("gt", upper, _scalar(graph, settings["thresholdUpperCountProportion"] * elements))
        factor = self._variable(graph, LOSS_SCALE_FACTOR, (), "float32", 1.0)
        new = _op("where", too_large, factor * 0.5, factor * 2.0)
        limit = _scalar(graph, ALS_MAX_SCALE) / _scalar(graph, self._base_loss_scaling(graph))
        new = _op("minimum", new, limit)
        period = settings["updatePeriod"]
        if period > 1:
            countdown = self._variable(graph, ALS_COUNTDOWN, (), "float32", 0.0)
            due = _op("eq", countdown, _scalar(graph, 0.0))
            new = _op("where", due, new, factor)
            graph.update(countdown, _op("where", due, _scalar(graph, float(period - 1)), countdown - 1.0))
        graph.update(factor, new)

    def _needs_step(self):
        kind = self.spec.kind
        if kind in ("adam", "adamw", "lamb"):
            return True
        if kind == "sgd":
            return any(not _is_zero(g.values["dampening"]) or "dampening" in g.variable for g in self.spec.groups)
        return False

    def _sum_of_squares(self, graph, values, sharded):
        """The sum of the squares of every element of ``values``: those in ``sharded`` are a replica's shards,
        whose partial sum is all-reduced over the replicas (a device variable the host fills, see
        ``_replication.ShardedState``); the others are whole on every replica."""
        squares = [_op("reduce_sum", v * v, axes=None, keepdims=False) for v in values]
        whole = [s for s, shard in zip(squares, sharded) if not shard]
        partial = [s for s, shard in zip(squares, sharded) if shard]
        if partial:
            index = self.norms
            self.norms += 1
            graph.update(self._variable(graph, partial_norm_name(index), (), "float32", 0.0), _total(partial))
            whole.append(self._variable(graph, summed_norm_name(index), (), "float32", 0.0))
        return _total(whole)

    def _norm(self, graph, name, x):
        return _op("sqrt", self._sum_of_squares(graph, [x], [name in self.sharded]))

    def _clip(self, graph, grads):
        """Global-norm clipping exactly as torch.nn.utils.clip_grad_norm_."""
        total = self._sum_of_squares(graph, list(grads.values()), [name in self.sharded for name in grads])
        coef = _scalar(graph, float(self.spec.max_grad_norm)) / (_op("sqrt", total) + 1e-6)
        coef = _op("minimum", coef, _scalar(graph, 1.0))
        return {name: g * coef for name, g in grads.items()}

    def _sgd(self, graph, gi, name, p, g, t):
        lr, momentum, wd = (self.hyper(graph, gi, n) for n in ("lr", "momentum", "weight_decay"))
        if not _is_zero(wd):
            g = g + p * wd
        if not _is_zero(momentum):
            g = self._momentum(graph, gi, name, p, g, t, momentum)
        return p - g * lr

    def _momentum(self, graph, gi, name, p, g, t, momentum):
        """The gradient through torch's momentum buffer (stored in place) for a non-zero momentum."""
        vs, dampening = self.hyper(graph, gi, "velocity_scaling"), self.hyper(graph, gi, "dampening")
        buf_var, buf = self._state(graph, name, p, "momentum_buffer", 0.0, "velocity_accum_type")
        scaled_g = g if _is_one(vs) else g * vs
        new_buf = buf * momentum + (scaled_g if _is_zero(dampening) else scaled_g * (1.0 - _scalar(graph, dampening)))
        if t is not None:
            # torch starts the buffer at the first gradient, undamped.
            new_buf = _op("where", _op("eq", t, _scalar(graph, 1.0)), scaled_g, new_buf)
        off = None
        if hasattr(momentum, "graph"):
            # A variable momentum may be 0: torch then uses the plain gradient and leaves the buffer as it is
            # (or creates none, so a momentum set later starts from that step's gradient, as from 0 here).
            # The stored buffer is selected once and the step reads it back, so the buffer's update is one
            # fused expression and the parameter's another.
            off = _op("eq", momentum, _scalar(graph, 0.0))
            new_buf = _op("where", off, buf, new_buf)
        self._store(graph, buf_var, new_buf)
        velocity = new_buf if _is_one(vs) else new_buf / vs
        moved = g + velocity * momentum if self.spec.groups[gi].structure["nesterov"] else velocity
        return moved if off is None else _op("where", off, g, moved)

    def _adam_moments(self, graph, gi, name, p, g, t):
        h = lambda name: self.hyper(graph, gi, name)  # noqa: E731
        b1, b2 = h("beta1"), h("beta2")
        m_var, m = self._state(graph, name, p, "exp_avg", 0.0, "first_order_momentum_accum_type")
        v_var, v = self._state(graph, name, p, "exp_avg_sq", 0.0, "second_order_momentum_accum_type")
        new_m = m + (g - m) * (1.0 - _scalar(graph, b1))
        new_v = v * b2 + g * g * (1.0 - _scalar(graph, b2))
        self._store(graph, m_var, new_m)
        self._store(graph, v_var, new_v)
        if not self.spec.bias_correction:
            return new_m, new_v, None, None
        bc1 = 1.0 - _op("pow", _scalar(graph, b1), t)
        bc2 = 1.0 - _op("pow", _scalar(graph, b2), t)
        return new_m, new_v, bc1, bc2

    def _adam(self, graph, gi, name, p, g, t):
        lr, wd, eps = (self.hyper(graph, gi, n) for n in ("lr", "weight_decay", "eps"))
        if self.spec.kind == "adamw":
            if not _is_zero(wd):
                p = p * (1.0 - _scalar(graph, lr) * wd)
        elif not _is_zero(wd):
            g = g + p * wd
        m, v, bc1, bc2 = self._adam_moments(graph, gi, name, p, g, t)
        if bc1 is None:
            return p - (m / (_op("sqrt", v) + eps)) * lr
        step_size = _scalar(graph, lr) / bc1
        denom = _op("sqrt", v) / _op("sqrt", bc2) + eps
        return p - (m / denom) * step_size

    _adamw = _adam

    def _rmsprop(self, graph, gi, name, p, g, t):
        h = lambda name: self.hyper(graph, gi, name)  # noqa: E731
        lr, alpha, eps, wd, momentum = h("lr"), h("alpha"), h("eps"), h("weight_decay"), h("momentum")
        tf = self.spec.use_tf_variant
        if not _is_zero(wd):
            g = g + p * wd
        sq_var, sq = self._state(graph, name, p, "square_avg", 1.0 if tf else 0.0, "second_order_momentum_accum_type")
        new_sq = sq * alpha + g * g * (1.0 - _scalar(graph, alpha))
        self._store(graph, sq_var, new_sq)
        if self.spec.groups[gi].structure["centered"]:
            ga_var, ga = self._state(graph, name, p, "grad_avg", 0.0, "first_order_momentum_accum_type")
            new_ga = ga + (g - ga) * (1.0 - _scalar(graph, alpha))
            self._store(graph, ga_var, new_ga)
            new_sq = new_sq - new_ga * new_ga
        avg = _op("sqrt", new_sq + eps) if tf else _op("sqrt", new_sq) + eps
        if _is_zero(momentum):
            return p - (g / avg) * lr
        buf_var, buf = self._state(graph, name, p, "momentum_buffer", 0.0, "first_order_momentum_accum_type")
        new_buf = buf * momentum + ((g / avg) * lr if tf else g / avg)
        self._store(graph, buf_var, new_buf)
        return p - new_buf if tf else p - new_buf * lr

    def _lamb(self, graph, gi, name, p, g, t):
        lr, wd, eps, max_norm = (self.hyper(graph, gi, n) for n in ("lr", "weight_decay", "eps", "max_weight_norm"))
        m, v, bc1, bc2 = self._adam_moments(graph, gi, name, p, g, t)
        if bc1 is not None:
            m, v = m / bc1, v / bc2
        update = m / (_op("sqrt", v) + eps)
        if not _is_zero(wd):
            update = update + p * wd
        r1 = _op("minimum", self._norm(graph, name, p), _scalar(graph, max_norm))
        r2 = self._norm(graph, name, update)
        zero = _scalar(graph, 0.0)
        either_zero = _op("logical_or", _op("eq", r1, zero), _op("eq", r2, zero))
        trust = _op("where", either_zero, _scalar(graph, 1.0), r1 / _op("maximum", r2, _scalar(graph, 1e-30)))
        return p - update * (trust * lr)


def _tracked_gradients(grads):
    """The float16 outputs of backward matmuls and convolutions the parameters' gradients are computed from."""
    tracked, seen, stack = {}, set(), list(grads)
    while stack:
        node = stack.pop().producer
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.role == "backward" and str(node.op).startswith(_TRACKED_OPS):
            tracked.update({id(v): v for v in node.outputs if v.dtype == DType.float16})
        stack.extend(node.inputs)
    return list(tracked.values())


def _sink_before_first_reader(graph, values):
    """Move the nodes that make ``values`` (the sharded parameters' weight and gradient shards, the gradients'
    sliced out of their accumulators before any update runs) to just before their first reader, so a replica
    holds one parameter's shards at a time, and a weight's only once its gradient's is spent, rather than every
    one from the start of the step. A stable sort: every node still follows its operands and precedes its
    readers."""
    nodes = graph.nodes
    index = {id(node): i for i, node in enumerate(nodes)}
    movable, stack = set(), [v.producer for v in values]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in movable:
            movable.add(id(node))
            stack.extend(v.producer for v in node.inputs)
    readers = {}
    for node in nodes:
        for v in node.inputs:
            readers.setdefault(v.id, []).append(node)
    kept = {v.id for v in (*graph.outputs.values(), *graph.updates.values())}
    slot = {}
    for node in reversed(nodes):
        if id(node) not in movable:
            slot[id(node)] = index[id(node)]
            continue
        used = [slot[id(r)] for v in node.outputs for r in readers.get(v.id, ())]
        ends = any(v.id in kept for v in node.outputs)
        slot[id(node)] = index[id(node)] if ends or not used else min(used)
    graph.nodes = sorted(nodes, key=lambda node: (slot[id(node)], index[id(node)]))


def _total(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total
