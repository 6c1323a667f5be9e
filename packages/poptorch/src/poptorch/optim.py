"""``poptorch.optim``: torch optimizers with PopTorch's extras, and how any accepted optimizer is described.

The Python ``step()`` of an optimizer never runs: a wrapped model reads the optimizer once through
``describe`` and compiles its update rule into the program (see ``_optimizer_graph``). In these classes,
hyper-parameters passed explicitly are *variable* (``setOptimizer`` changes them without recompiling)
and defaults are compiled in; for torch's own optimizers only ``lr`` is variable.
"""

import warnings
import weakref
from dataclasses import dataclass, field

import torch

from poptorch import _weights
from poptorch.errors import Error

EMPTY_STATE = "Cannot load optimizer state dictionary because it is empty."
NOT_IPU_STATE = "Only IPU optimizer states can be loaded onto the IPU."
_IPU_KEYS = ("ipu_state", "ipu_param")
# PopART's name for the automatic loss scaling factor in ipu_state; the optimizer attribute holding it.
LOSS_SCALE_FACTOR_KEY = "lossScaleUpdateFactor"
_FACTOR_ATTR = "_loss_scale_update_factor"
HOST_STEP_WARNING = (
    "optimizer.step() was called on an optimizer that a poptorch.trainingModel uses: the wrapped model already "
    "performs the optimizer step on the IPU at each call, so this step only applies gradients computed on the "
    "host, if any. Remove the optimizer.step() (and zero_grad() / backward()) calls from the training loop."
)
# Optimizer -> the wrappers that compile its update rule (a step() called by the user warns while any is alive).
_USERS = weakref.WeakKeyDictionary()

# Hyper-parameters of each rule, per parameter group; ``betas`` is split into beta1/beta2.
HYPER_PARAMETERS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "velocity_scaling"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum"),
    "lamb": ("lr", "beta1", "beta2", "eps", "weight_decay", "max_weight_norm"),
}
# Structural choices, compiled in: changing one needs a new executable.
_STRUCTURE = {"sgd": ("nesterov",), "rmsprop": ("centered",), "adam": (), "adamw": (), "lamb": ()}
_DTYPES = {None: "float32", torch.float32: "float32", torch.float16: "float16", torch.half: "float16"}


class VariableAttributes:
    """``optimizer.variable_attrs`` of a poptorch optimizer: which hyper-parameters are variable (``setOptimizer``
    changes them without recompiling) and which are compiled in as constants. Hyper-parameters passed to the
    constructor start variable, defaults constant; mark them otherwise before the model is compiled."""

    def __init__(self, variable, allowed):
        self._variable = set(variable)
        self._allowed = frozenset(allowed)

    def isConstant(self, attr):
        """True if ``attr`` is compiled in as a constant."""
        return attr not in self._variable

    def markAsConstant(self, attr):
        """Compile ``attr`` in as a constant."""
        self._check(attr)
        self._variable.discard(attr)

    def markAsVariable(self, attr):
        """Make ``attr`` changeable through ``setOptimizer`` without recompiling."""
        self._check(attr)
        self._variable.add(attr)

    def __contains__(self, attr):
        return attr in self._variable

    def _check(self, attr):
        if attr not in self._allowed:
            raise Error(f"Unknown attribute {attr}, allowed values: {sorted(self._allowed)}")


class _PoptorchOptimizer:
    """Mixin for poptorch.optim classes: remembers which hyper-parameters the user passed explicitly."""

    def _remember_variables(self, explicit, group_keys):
        variable = {name for name, given in explicit.items() if given} | group_keys
        hyper = HYPER_PARAMETERS[_rule_of(self)[1]]
        allowed = {"betas" if name.startswith("beta") else name for name in hyper} | {"loss_scaling"}
        self.variable_attrs = VariableAttributes(variable, allowed)

    def __getstate__(self):
        """Pickled with the current state (copied back from the device if it is ahead) and PopTorch's extras
        (loss scaling, ...), which torch's own pickling leaves out."""
        _weights.sync_optimizer_state(self)
        state = super().__getstate__()
        state.update({k: v for k, v in vars(self).items() if k not in state and not k.startswith("_")})
        return state

    def state_dict(self):
        """torch's state dict plus PopTorch's ``ipu_state`` (the per-parameter state) and ``ipu_param`` (the
        hyper-parameters). Always current: a device holding a newer state copies it back first."""
        state = super().state_dict()
        state["ipu_state"] = {k: dict(v) for k, v in state["state"].items()}
        factor = loss_scale_factor(self)
        if factor is not None:
            state["ipu_state"][LOSS_SCALE_FACTOR_KEY] = torch.tensor(factor)
        state["ipu_param"] = _ipu_params(self)
        return state

    def load_state_dict(self, state_dict):
        """Load a state dict saved from a poptorch optimizer; the next call of the wrapped model uploads it."""
        if not state_dict:
            raise Error(EMPTY_STATE)
        if not all(key in state_dict for key in _IPU_KEYS):
            raise Error(NOT_IPU_STATE)
        factor = state_dict["ipu_state"].get(LOSS_SCALE_FACTOR_KEY)
        state_dict = {k: v for k, v in state_dict.items() if k not in _IPU_KEYS}
        _weights.check_loading_state(self, state_dict)
        super().load_state_dict(state_dict)
        if factor is not None:
            set_loss_scale_factor(self, float(factor))


def loss_scale_factor(optimizer):
    """The automatic loss scaling factor last read from the device (None before any step)."""
    return getattr(optimizer, _FACTOR_ATTR, None)


def set_loss_scale_factor(optimizer, factor):
    """Keep the automatic loss scaling factor with ``optimizer``: the next device it runs on starts from it."""
    setattr(optimizer, _FACTOR_ATTR, factor)


def use(optimizer, executor):
    """``executor`` runs ``optimizer``'s update rule on the device: a ``step()`` the user calls warns."""
    users = _USERS.get(optimizer)
    if users is None:
        users = _USERS[optimizer] = weakref.WeakSet()
        optimizer.register_step_pre_hook(_warn_host_step)
    users.add(executor)


def release(optimizer, executor):
    """``executor`` no longer uses ``optimizer``."""
    users = _USERS.get(optimizer)
    if users is not None:
        users.discard(executor)


def _warn_host_step(optimizer, args, kwargs):
    if _USERS.get(optimizer):
        # Above this hook: torch's step wrapper, then the user's call.
        warnings.warn(HOST_STEP_WARNING, stacklevel=3)


def _ipu_params(optimizer):
    """Every numeric hyper-parameter by ``<name>.group<index>``, plus the loss scaling, as tensors."""
    params = {"loss_scaling": torch.tensor(float(optimizer.loss_scaling))}
    for index, group in enumerate(optimizer.param_groups):
        for name, value in group.items():
            values = value if name == "betas" else (value,)
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                params[f"{name}.group{index}"] = torch.tensor(values if name == "betas" else value, dtype=torch.float32)
    return params


def _groups(params):
    """The parameters as a list, and the hyper-parameters set per group (explicit, hence variable)."""
    params = list(params)
    keys = set()
    for group in params:
        if isinstance(group, dict):
            keys |= {k for k in group if k != "params"}
    return params, keys


def _explicit(**kwargs):
    return {name: value is not None for name, value in kwargs.items()}


def _default(value, default):
    return default if value is None else value


class SGD(_PoptorchOptimizer, torch.optim.SGD):
    """torch.optim.SGD plus ``loss_scaling``, ``velocity_scaling``, ``use_combined_accum``, accumulation types and
    ``max_grad_norm``."""

    def __init__(
        self,
        params,
        lr=None,
        momentum=None,
        dampening=None,
        weight_decay=None,
        nesterov=None,
        maximize=None,
        foreach=None,
        differentiable=None,
        loss_scaling=None,
        velocity_scaling=None,
        use_combined_accum=None,
        accum_type=None,
        velocity_accum_type=None,
        max_grad_norm=None,
    ):
        params, group_keys = _groups(params)
        super().__init__(
            params,
            maximize=bool(maximize),
            lr=_default(lr, 0.01),
            momentum=_default(momentum, 0.0),
            dampening=_default(dampening, 0.0),
            weight_decay=_default(weight_decay, 0.0),
            nesterov=bool(nesterov),
        )
        self.loss_scaling = _default(loss_scaling, 1.0)
        # PopTorch's two SGD variants differ only in float16 stability; both compute torch's rule, as here.
        self.use_combined_accum = bool(use_combined_accum)
        self.max_grad_norm = max_grad_norm
        self.accum_type = accum_type
        self.velocity_accum_type = velocity_accum_type
        for group in self.param_groups:
            group.setdefault("velocity_scaling", _default(velocity_scaling, 1.0))
        self._remember_variables(
            _explicit(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                loss_scaling=loss_scaling,
                velocity_scaling=velocity_scaling,
            ),
            group_keys,
        )


class Adam(_PoptorchOptimizer, torch.optim.Adam):
    """torch.optim.Adam plus ``loss_scaling``, ``max_grad_norm`` and state accumulation types."""

    def __init__(
        self,
        params,
        lr=None,
        betas=None,
        eps=None,
        weight_decay=None,
        amsgrad=False,
        foreach=None,
        maximize=None,
        capturable=None,
        differentiable=None,
        fused=None,
        loss_scaling=None,
        accum_type=None,
        first_order_momentum_accum_type=None,
        second_order_momentum_accum_type=None,
        max_grad_norm=None,
    ):
        if amsgrad:
            raise ValueError("Adam amsgrad=True is not supported on the IPU.")
        params, group_keys = _groups(params)
        super().__init__(
            params,
            maximize=bool(maximize),
            lr=_default(lr, 0.001),
            betas=_default(betas, (0.9, 0.999)),
            eps=_default(eps, 1e-8),
            weight_decay=_default(weight_decay, 0.0),
        )
        _adaptive_extras(
            self,
            loss_scaling,
            accum_type,
            first_order_momentum_accum_type,
            second_order_momentum_accum_type,
            max_grad_norm,
        )
        self._remember_variables(
            _explicit(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, loss_scaling=loss_scaling),
            group_keys,
        )


class AdamW(_PoptorchOptimizer, torch.optim.AdamW):
    """torch.optim.AdamW plus ``loss_scaling``, ``bias_correction``, ``max_grad_norm`` and accumulation types."""

    def __init__(
        self,
        params,
        lr=None,
        betas=None,
        eps=None,
        weight_decay=None,
        amsgrad=False,
        foreach=None,
        maximize=None,
        capturable=None,
        differentiable=None,
        fused=None,
        loss_scaling=None,
        bias_correction=True,
        accum_type=None,
        first_order_momentum_accum_type=None,
        second_order_momentum_accum_type=None,
        max_grad_norm=None,
    ):
        if amsgrad:
            raise ValueError("AdamW amsgrad=True is not supported on the IPU.")
        params, group_keys = _groups(params)
        super().__init__(
            params,
            maximize=bool(maximize),
            lr=_default(lr, 0.001),
            betas=_default(betas, (0.9, 0.999)),
            eps=_default(eps, 1e-8),
            weight_decay=_default(weight_decay, 0.01),
        )
        self.bias_correction = bool(bias_correction)
        _adaptive_extras(
            self,
            loss_scaling,
            accum_type,
            first_order_momentum_accum_type,
            second_order_momentum_accum_type,
            max_grad_norm,
        )
        self._remember_variables(
            _explicit(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, loss_scaling=loss_scaling),
            group_keys,
        )


class RMSprop(_PoptorchOptimizer, torch.optim.RMSprop):
    """torch.optim.RMSprop plus ``loss_scaling``, ``use_tf_variant``, ``max_grad_norm`` and accumulation types."""

    def __init__(
        self,
        params,
        lr=None,
        alpha=None,
        eps=None,
        weight_decay=None,
        momentum=None,
        centered=None,
        foreach=None,
        maximize=None,
        differentiable=None,
        loss_scaling=None,
        accum_type=None,
        first_order_momentum_accum_type=None,
        second_order_momentum_accum_type=None,
        use_tf_variant=False,
        max_grad_norm=None,
    ):
        params, group_keys = _groups(params)
        super().__init__(
            params,
            maximize=bool(maximize),
            lr=_default(lr, 0.01),
            alpha=_default(alpha, 0.99),
            eps=_default(eps, 1e-8),
            weight_decay=_default(weight_decay, 0.0),
            momentum=_default(momentum, 0.0),
            centered=bool(centered),
        )
        self.use_tf_variant = bool(use_tf_variant)
        _adaptive_extras(
            self,
            loss_scaling,
            accum_type,
            first_order_momentum_accum_type,
            second_order_momentum_accum_type,
            max_grad_norm,
        )
        self._remember_variables(
            _explicit(
                lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, loss_scaling=loss_scaling
            ),
            group_keys,
        )


class LAMB(_PoptorchOptimizer, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al. 2019) with PopTorch's ``max_weight_norm`` and ``bias_correction``.

    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w;  w -= lr * min(||w||, max_weight_norm) / ||update||
    * update, with a trust ratio of 1 where either norm is 0.
    """

    def __init__(
        self,
        params,
        lr=None,
        betas=None,
        eps=None,
        weight_decay=None,
        bias_correction=True,
        loss_scaling=None,
        max_weight_norm=None,
        accum_type=None,
        first_order_momentum_accum_type=None,
        second_order_momentum_accum_type=None,
        max_grad_norm=None,
    ):
        defaults = {
            "lr": _default(lr, 0.001),
            "betas": _default(betas, (0.9, 0.999)),
            "eps": _default(eps, 1e-8),
            "weight_decay": _default(weight_decay, 0.01),
            "max_weight_norm": _default(max_weight_norm, 65500.0),
        }
        params, group_keys = _groups(params)
        super().__init__(params, defaults)
        self.bias_correction = bool(bias_correction)
        _adaptive_extras(
            self,
            loss_scaling,
            accum_type,
            first_order_momentum_accum_type,
            second_order_momentum_accum_type,
            max_grad_norm,
        )
        self._remember_variables(
            _explicit(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                loss_scaling=loss_scaling,
                max_weight_norm=max_weight_norm,
            ),
            group_keys,
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step on the host from the parameters' ``.grad`` (as PopTorch's LAMB runs on the CPU); a
        wrapped model runs the same rule on the device. State slots and step count match the device's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trained = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        scale = 1.0
        if self.max_grad_norm is not None and trained:
            # Global-norm clipping as on the device (torch.nn.utils.clip_grad_norm_), without editing .grad.
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for _, p in trained]))
            scale = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for group, p in trained:
            p.sub_(self._update(group, p, p.grad * scale))
        return loss

    def _update(self, group, p, grad):
        """lr * trust ratio * update for one parameter, advancing its state."""
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.bias_correction:
            step = float(state["step"])
            m, v = m / (1 - beta1**step), v / (1 - beta2**step)
        update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
        r1, r2 = p.norm().clamp(max=group["max_weight_norm"]), update.norm()
        trust = 1.0 if r1 == 0 or r2 == 0 else float(r1 / r2)
        return update * (group["lr"] * trust)


def _adaptive_extras(opt, loss_scaling, accum_type, first, second, max_grad_norm):
    opt.loss_scaling = _default(loss_scaling, 1.0)
    opt.accum_type = accum_type
    opt.first_order_momentum_accum_type = first
    opt.second_order_momentum_accum_type = second
    opt.max_grad_norm = max_grad_norm


@dataclass
class GroupSpec:
    """One parameter group: its parameters, hyper-parameter values and which of them are variable."""

    params: list
    values: dict
    variable: frozenset
    structure: dict


@dataclass
class OptimizerSpec:
    """What the compiled update rule depends on. ``structure_key()`` changes force recompilation."""

    kind: str
    groups: list
    loss_scaling: float
    loss_scaling_variable: bool
    max_grad_norm: float | None
    bias_correction: bool = True
    use_tf_variant: bool = False
    state_dtypes: dict = field(default_factory=dict)
    # The gradient accumulators' dtype when the optimizer's accum_type is given, else None (the gradients').
    accumulator_dtype: str | None = None

    def structure_key(self):
        """Everything compiled in: kind, options, structural and constant hyper-parameter values."""
        groups = [
            (
                len(g.params),
                sorted(g.structure.items()),
                sorted((k, v) for k, v in g.values.items() if k not in g.variable),
                sorted(g.variable),
            )
            for g in self.groups
        ]
        constant_ls = None if self.loss_scaling_variable else self.loss_scaling
        return repr(
            (
                self.kind,
                groups,
                constant_ls,
                self.loss_scaling_variable,
                self.max_grad_norm,
                self.bias_correction,
                self.use_tf_variant,
                sorted(self.state_dtypes.items()),
                self.accumulator_dtype,
            )
        )


_KINDS = (
    (torch.optim.AdamW, "adamw"),
    (torch.optim.Adam, "adam"),
    (torch.optim.SGD, "sgd"),
    (torch.optim.RMSprop, "rmsprop"),
    (LAMB, "lamb"),
)
_OURS = (SGD, Adam, AdamW, RMSprop, LAMB)


def _rule_of(optimizer):
    """(The supported class ``optimizer`` is an instance of, its update rule), or (None, None)."""
    return next(((cls, kind) for cls, kind in _KINDS if isinstance(optimizer, cls)), (None, None))


def _kind_of(optimizer):
    cls, kind = _rule_of(optimizer)
    if kind is None:
        raise Error(f"Unsupported optimizer {type(optimizer).__name__}: use SGD, Adam, AdamW, RMSprop or LAMB.")
    if type(optimizer) not in _OURS and type(optimizer) is not cls:
        warnings.warn(
            f"Poptorch does not run Python optimizer code directly: {type(optimizer).__name__} is compiled "
            f"as {cls.__name__}, any custom behaviour is ignored.",
            stacklevel=4,
        )
    return kind


def describe(optimizer):
    """The OptimizerSpec of a torch or poptorch optimizer."""
    kind = _kind_of(optimizer)
    ours = isinstance(optimizer, _PoptorchOptimizer)
    explicit = optimizer.variable_attrs if ours else {"lr"}
    groups = []
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError("Adam amsgrad=True is not supported on the IPU.")
        if group.get("maximize"):
            raise Error("maximize=True is not supported by poptorch optimizers.")
        values = {}
        for name in HYPER_PARAMETERS[kind]:
            if name in ("beta1", "beta2"):
                values[name] = float(group["betas"][0 if name == "beta1" else 1])
            else:
                values[name] = float(group.get(name, 1.0 if name == "velocity_scaling" else 0.0))
        variable = {
            n for n in HYPER_PARAMETERS[kind] if n in explicit or (n.startswith("beta") and "betas" in explicit)
        }
        structure = {name: bool(group.get(name, False)) for name in _STRUCTURE[kind]}
        groups.append(GroupSpec(list(group["params"]), values, frozenset(variable), structure))
    dtypes = {}
    for attr in (
        "accum_type",
        "velocity_accum_type",
        "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
    ):
        value = getattr(optimizer, attr, None)
        if value not in _DTYPES:
            raise Error(f"{attr} must be torch.float32 or torch.float16, not {value}")
        dtypes[attr] = _DTYPES[value]
    return OptimizerSpec(
        kind=kind,
        groups=groups,
        loss_scaling=float(getattr(optimizer, "loss_scaling", 1.0)),
        loss_scaling_variable="loss_scaling" in explicit,
        max_grad_norm=getattr(optimizer, "max_grad_norm", None),
        bias_correction=getattr(optimizer, "bias_correction", True),
        use_tf_variant=getattr(optimizer, "use_tf_variant", False),
        state_dtypes=dtypes,
        accumulator_dtype=None if getattr(optimizer, "accum_type", None) is None else dtypes["accum_type"],
    )
