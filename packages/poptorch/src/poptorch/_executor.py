"""``PoplarExecutor``: the wrapper ``trainingModel`` / ``inferenceModel`` return.

The first call captures the model on one micro-batch, builds the programs (``_training``), compiles them
for the simulated IPU (``_device``, through the executable cache), uploads weights and runs. Weights then
live on the device; the host copy is refreshed lazily: the user model's class is swapped for a subclass
whose parameter/buffer accessors first copy device weights back when a device holds newer ones.
"""

import inspect
import os
import time
import weakref

import numpy as np
import torch
import tqdm
from torch.utils import _pytree as pytree

import popsim
from poptorch import _cache, _device, _training
from poptorch._batching import Layout
from poptorch._int_range import check_input
from poptorch._logging import logger
from poptorch._optimizer_graph import LOSS_SCALING, STEP, hyper_name, state_name
from poptorch.errors import Error
from poptorch.optim import describe

BACKWARD_ERROR = (
    "backward() cannot be called explicitly on outputs of a PopTorch model. If you're using a trainingModel, "
    "the backwards pass is performed automatically when invoking the model. If you're using an inferenceModel, "
    "you should use a trainingModel instead."
)
PHASES = ("capture", "autodiff", "optimise", "compile")
_HOST_DTYPES = {torch.int64: torch.int32, torch.float64: torch.float32}


class _OutputTensor(torch.Tensor):
    """A model output: an ordinary tensor whose ``backward()`` explains that PopTorch runs it on the device."""

    def backward(self, *args, **kwargs):
        raise RuntimeError(BACKWARD_ERROR)

    def __repr__(self, *, tensor_contents=None):
        return repr(self.as_subclass(torch.Tensor))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Anything computed from an output is a plain tensor again.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _SharedWeights:
    """Per user model: its live wrappers, which device holds newer weights than the host, a training clock."""

    def __init__(self):
        self.executors = {}
        self.dirty = None
        self.generation = 0


_SHARED = weakref.WeakKeyDictionary()
_ACCESSORS = (
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "state_dict",
    "modules",
    "named_modules",
    "children",
    "named_children",
    "__getattr__",
)


def _sync_host(model):
    shared = _SHARED.get(model)
    if shared is not None and shared.dirty is not None:
        shared.dirty.copyWeightsToHost()


def _syncing(method):
    def accessor(self, *args, **kwargs):
        _sync_host(self)
        return method(self, *args, **kwargs)

    accessor.__name__ = method.__name__
    accessor.__doc__ = method.__doc__
    return accessor


def _hook_model(model):
    """Swap ``model``'s class for a subclass whose accessors sync weights from the device first."""
    cls = type(model)
    if getattr(cls, "_poptorch_original_class", None) is None:
        namespace = {name: _syncing(getattr(cls, name)) for name in _ACCESSORS}
        namespace["_poptorch_original_class"] = cls
        namespace["__qualname__"] = cls.__qualname__
        namespace["__module__"] = cls.__module__
        model.__class__ = type(cls.__name__, (cls,), namespace)
    return _SHARED.setdefault(model, _SharedWeights())


def _unhook_model(model):
    model.__class__ = type(model)._poptorch_original_class
    _SHARED.pop(model, None)


def _kind(training):
    return "trainingModel" if training else "inferenceModel"


def _host_tensor(array, dtype):
    """A device result as a torch tensor (int64 comes back as int32, float64 as float32)."""
    tensor = torch.from_numpy(np.array(array, order="C"))
    return tensor.to(_HOST_DTYPES.get(dtype, dtype))


class PoplarExecutor:
    """A model wrapped for the simulated IPU. Create it with ``trainingModel`` or ``inferenceModel``."""

    def __init__(self, model, options, training, optimizer=None):
        if isinstance(model, PoplarExecutor):
            model = model._model
        self._model = model
        self._training = training
        self._user_options = options._freeze()
        self._options = options.clone()._freeze()
        if not training and self._options.Training.gradient_accumulation != 1:
            raise Error("inferenceModel does not support gradient accumulation: set Training.gradientAccumulation(1)")
        self._layout = Layout(self._options, training)
        shared = _SHARED.get(model)
        previous = shared.executors.get(_kind(training)) if shared else None
        if previous is not None:
            raise RuntimeError(
                f"Model has already been wrapped in 'poptorch.{_kind(training)}'. Call model.destroy() on the "
                "model to unwrap it before wrapping it again."
            )
        self._shared = _hook_model(model)
        self._shared.executors[_kind(training)] = self
        if training and optimizer is None:
            from poptorch.optim import SGD

            optimizer = SGD(model.parameters(), lr=0.01)
        self._optimizer = optimizer
        self._spec = describe(optimizer) if training else None
        # Set by the legacy signatures: write the profile after compiling; sync the host after each call
        # (a legacy loss wraps the user model, so reading the user's own module cannot trigger a sync).
        self._write_profile = False
        self._sync_after_call = False
        self._reset()

    def _reset(self):
        self._exe = None
        self._programs = None
        self._captured = None
        self._attached = False
        self._uploaded_generation = None
        self._compiled_inputs = None
        self._cycles = None
        self._perf = None
        self._rng_seeded = False
        self._from_cache = False

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Capture and compile for these inputs without running."""
        self._check_arguments(args, kwargs)
        if self._exe is None:
            self._compile(args, kwargs)
        if not self._attached:
            self.attachToDevice()

    def isCompiled(self):
        """True once the model has been compiled (and not destroyed)."""
        return self._exe is not None

    def _compile(self, args, kwargs):
        from poptorch._capture import capture

        leaves, spec = pytree.tree_flatten((args, kwargs))
        names = _leaf_names(self._model, args, kwargs)
        micro = [self._micro_batch_example(name, leaf) for name, leaf in zip(names, leaves)]
        mb_args, mb_kwargs = pytree.tree_unflatten(micro, spec)
        show = self._options.show_compilation_progress_bar
        with tqdm.tqdm(total=len(PHASES), desc="Graph compilation", disable=not show, leave=False) as bar:

            def phase(name):
                bar.n = PHASES.index(name)
                bar.set_postfix_str(name)

            phase("capture")
            mode = self._model.training
            self._model.train(self._training)
            try:
                captured = capture(self._model, mb_args, mb_kwargs)
            finally:
                self._model.train(mode)
            if self._training:
                group_of = self._group_of()
                programs = _training.build_training(captured, self._spec, group_of, self._options, phase)
            else:
                phase("autodiff")
                programs = _training.build_inference(captured)
                phase("optimise")
            key = _cache.key(programs.graphs, self._options)
            cache = _cache.ExecutableCache.open(self._options)
            exe = cache.load(key) if cache else None
            cache_hit = exe is not None
            if exe is None:
                _training.optimise(programs)
                phase("compile")
                exe = _device.compile_programs(programs.graphs, self._options)
                if cache:
                    cache.store(key, exe)
            else:
                logger.info("Loaded the executable from the cache (%s)", key[:16])
                phase("compile")
            bar.n = bar.total
            bar.refresh()
        self._captured, self._programs, self._exe = captured, programs, exe
        self._from_cache = cache_hit
        if self._write_profile:
            directory = self._options.log_dir or "."
            os.makedirs(directory, exist_ok=True)
            exe.profile.to_json(os.path.join(directory, "profile.json"))
        self._compiled_inputs = (spec, [self._input_signature(leaf) for leaf in leaves])
        logger.debug("Compiled %s for %d input leaves", _kind(self._training), len(leaves))

    def _micro_batch_example(self, name, leaf):
        """One micro-batch of an input (what the model is captured on), after checking the input."""
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.numel() == 0:
            raise Error(f"Zero-sized tensors are unsupported (Got shape {list(leaf.shape)})")
        if leaf.requires_grad:
            raise Error(
                f"Input {name} requires grad: the device computes gradients itself. Pass tensor.detach() instead."
            )
        self._layout.split(name, leaf.detach().numpy())
        if leaf.ndim == 0:
            return leaf
        return leaf[: self._layout.micro_batch_shape(leaf)[0]].clone()

    @staticmethod
    def _input_signature(leaf):
        return (leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf

    def _group_of(self):
        names = {id(p): name for name, p in torch.nn.Module.named_parameters(self._model, remove_duplicate=False)}
        group_of = {}
        for index, group in enumerate(self._spec.groups):
            for p in group.params:
                if id(p) in names:
                    group_of[names[id(p)]] = index
        return group_of

    # -- arguments ------------------------------------------------------------------------------
    def _check_arguments(self, args, kwargs):
        params = _forward_parameters(self._model)
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        unexpected = [k for k in kwargs if k not in params and not takes_kwargs]
        if unexpected:
            raise Error(f"Unexpected arguments: {', '.join(unexpected)}.")
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind == p.VAR_POSITIONAL for p in params.values()) and len(args) > len(positional):
            raise Error(f"Too many positional arguments: forward takes {len(positional)}, got {len(args)}.")
        given = {p.name for p in positional[: len(args)]} | set(kwargs)
        missing = [
            p.name
            for p in params.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in given
        ]
        if missing:
            raise Error(f"Missing arguments: {', '.join(missing)}.")
        for value in pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor) and value.numel() == 0:
                raise Error(f"Zero-sized tensors are unsupported (Got shape {list(value.shape)})")

    def _check_compiled_inputs(self, args, kwargs, leaves, spec):
        compiled_spec, signatures = self._compiled_inputs
        if spec != compiled_spec:
            missing, unexpected = _dict_key_changes(compiled_spec, spec)
            if missing:
                raise Error(f"Missing arguments: {', '.join(missing)}.")
            if unexpected:
                raise Error(f"Unexpected arguments: {', '.join(unexpected)}.")
            raise Error(f"The structure of the inputs changed since compilation: expected {compiled_spec}, got {spec}")

        def name(position):
            # Built only to report a mismatch: naming every leaf costs more than checking it.
            return _leaf_names(self._model, args, kwargs)[position]

        for i, (leaf, expected) in enumerate(zip(leaves, signatures)):
            if isinstance(leaf, torch.Tensor):
                shape, dtype = expected
                if leaf.requires_grad:
                    raise Error(
                        f"Input {name(i)} requires grad: the device computes gradients itself. "
                        "Pass tensor.detach() instead."
                    )
                if leaf.dtype != dtype:
                    raise Error(f"Input {name(i)}: expected {dtype} but got {leaf.dtype}. Call destroy() to recompile.")
                if leaf.shape != shape:
                    raise Error(f"Input {name(i)}: expected {shape} but got {leaf.shape}. Call destroy() to recompile.")
            elif leaf != expected:
                raise Error(
                    f"Argument {name(i)} is not a tensor, so its value was compiled into the model: expected "
                    f"{expected!r} but got {leaf!r}. Call destroy() to recompile."
                )

    # -- running --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._check_arguments(args, kwargs)
        if self._exe is None:
            self._compile(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self._check_compiled_inputs(args, kwargs, leaves, spec)
        if not self._attached:
            self.attachToDevice()
        self._refresh_device_weights()
        outputs = self._run(leaves)
        if self._training:
            self._shared.generation += 1
            self._uploaded_generation = self._shared.generation
            self._shared.dirty = self
            if self._sync_after_call:
                self.copyWeightsToHost()
        return outputs

    def _refresh_device_weights(self):
        """Bring this device up to date when another wrapper of the model trained since our last upload."""
        shared = self._shared
        if shared.dirty is not None and shared.dirty is not self:
            shared.dirty.copyWeightsToHost()
        if self._uploaded_generation != shared.generation:
            self.copyWeightsToDevice()

    def _run(self, leaves):
        captured, layout, exe = self._captured, self._layout, self._exe
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        feeds_by_name = {}
        for name, tensor in zip(captured.input_names, tensors):
            check_input(name, tensor, captured.index_bounds.get(name, ()))
            dtype = self._programs.graphs[self._programs.micro_batch].input(name).dtype.numpy
            feeds_by_name[name] = layout.split(name, np.array(tensor.detach().numpy(), dtype=dtype, order="C"))
        per_output = {}
        perf = {k: [[] for _ in tensors] for k in ("input", "input_complete")}
        perf.update({k: [[] for _ in captured.outputs] for k in ("output", "output_complete")})
        cycles = 0
        runs_per_step = layout.ga * layout.r
        for index, (d, a, r) in enumerate(layout.micro_batches()):
            start = time.time()
            feeds = {name: np.array(split[d, a, r], order="C") for name, split in feeds_by_name.items()}
            fed = time.time()
            for lists in perf["input"]:
                lists.append(start)
            for lists in perf["input_complete"]:
                lists.append(fed)
            result = _run_on_device(exe, feeds, self._programs.micro_batch)
            cycles += exe.last_run_cycles or 0
            out_start = time.time()
            for name, value in result.items():
                per_output.setdefault(name, []).append(np.array(value))
            out_done = time.time()
            for lists in perf["output"]:
                lists.append(out_start)
            for lists in perf["output_complete"]:
                lists.append(out_done)
            if self._programs.step and (index + 1) % runs_per_step == 0:
                _run_on_device(exe, {}, self._programs.step)
                cycles += exe.last_run_cycles or 0
        self._cycles, self._perf = cycles, perf
        for input_name, output_name in captured.input_mutations.items():
            target = tensors[captured.input_names.index(input_name)]
            with torch.no_grad():
                target.copy_(torch.from_numpy(layout.all_runs(per_output[output_name])).reshape(target.shape))
        results = [
            _host_tensor(layout.combine(per_output[name]), dtype).as_subclass(_OutputTensor)
            for name, dtype in zip(captured.outputs, captured.output_dtypes)
        ]
        return pytree.tree_unflatten(results, captured.out_spec)

    # -- weights --------------------------------------------------------------------------------
    def _host_tensors(self):
        model = self._model
        tensors = dict(torch.nn.Module.named_parameters(model, remove_duplicate=False))
        tensors.update(torch.nn.Module.named_buffers(model, remove_duplicate=False))
        return tensors

    def _device_variables(self):
        return set(self._exe.variables)

    def copyWeightsToDevice(self):
        """Upload the host's parameters, buffers and optimizer state (overwriting unsynced device training)."""
        if self._exe is None:
            raise Error("The model must be compiled before weights can be copied to the device")
        if self._shared.dirty is self:
            self._shared.dirty = None
        variables = self._device_variables()
        for name, tensor in self._host_tensors().items():
            if name in variables:
                self._exe.write_variable(name, tensor.detach().cpu().numpy())
        if self._training:
            self._write_optimizer_state(variables)
        if _training.RNG_SEED in variables and not self._rng_seeded:
            seed = self._options.random_seed
            seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
            self._exe.write_variable(_training.RNG_SEED, np.array([seed & 0x7FFFFFFF, 0], dtype=np.int32))
            self._rng_seeded = True
        self._uploaded_generation = self._shared.generation

    def copyWeightsToHost(self):
        """Copy the device's parameters, buffers and optimizer state into the user model and optimizer."""
        if self._exe is None:
            return
        if self._shared.dirty is self:
            self._shared.dirty = None
        variables = self._device_variables()
        with torch.no_grad():
            for name, tensor in self._host_tensors().items():
                if name in variables:
                    value = torch.from_numpy(np.array(self._exe.read_variable(name)))
                    tensor.data.copy_(value.reshape(tensor.shape).to(tensor.dtype))
        if self._training:
            self._read_optimizer_state(variables)

    def _param_of(self):
        return dict(torch.nn.Module.named_parameters(self._model, remove_duplicate=False))

    def _write_optimizer_state(self, variables):
        exe, initial = self._exe, self._programs.initial
        for name, value in initial.items():
            if name in variables:
                exe.write_variable(name, value)
        self._write_hyper_parameters(variables)
        state = self._optimizer.state
        params = self._param_of()
        for name in self._programs.trained:
            param_state = state.get(params[name])
            if not param_state:
                continue
            for slot, value in param_state.items():
                var = state_name(name, slot)
                if slot == "step" and STEP in variables:
                    exe.write_variable(STEP, np.array(float(value), dtype=np.float32))
                elif var in variables and isinstance(value, torch.Tensor):
                    exe.write_variable(var, value.detach().cpu().numpy())

    def _write_hyper_parameters(self, variables):
        for index, group in enumerate(self._spec.groups):
            for hyper, value in group.values.items():
                name = hyper_name(index, hyper)
                if name in variables:
                    self._exe.write_variable(name, np.array(value, dtype=np.float32))
        if LOSS_SCALING in variables:
            self._exe.write_variable(LOSS_SCALING, np.array(self._spec.loss_scaling, dtype=np.float32))

    def _read_optimizer_state(self, variables):
        params = self._param_of()
        step = float(np.array(self._exe.read_variable(STEP))) if STEP in variables else None
        prefix = "_opt."
        for name in self._programs.trained:
            param = params[name]
            slots = {}
            for var in variables:
                if var.startswith(f"{prefix}{name}."):
                    slot = var[len(prefix) + len(name) + 1 :]
                    array = np.array(self._exe.read_variable(var))
                    slots[slot] = torch.from_numpy(array).to(param.dtype)
            if step is not None:
                slots["step"] = torch.tensor(step)
            if slots:
                self._optimizer.state[param].update(slots)

    # -- optimizer ------------------------------------------------------------------------------
    def setOptimizer(self, optimizer):
        """Use ``optimizer``'s hyper-parameters from the next call on (variable ones need no recompilation)."""
        if not self._training:
            raise Error("setOptimizer() is only available on a trainingModel")
        spec = describe(optimizer)
        if self._exe is not None:
            _check_compatible(self._spec, spec)
        self._optimizer, self._spec = optimizer, spec
        if self._exe is not None and self._attached:
            variables = self._device_variables()
            self._write_hyper_parameters(variables)
            if getattr(optimizer, "_poptorch_state_loaded", False):
                self._write_optimizer_state(variables)
                optimizer._poptorch_state_loaded = False

    # -- device ---------------------------------------------------------------------------------
    def attachToDevice(self):
        """Attach to the (simulated) device and upload weights."""
        if self._attached:
            raise Error("Device is already attached")
        if self._exe is None:
            raise Error("The model must be compiled before it can be attached")
        self._attached = True
        shared = self._shared
        if shared.dirty is not None and shared.dirty is not self:
            shared.dirty.copyWeightsToHost()
        self.copyWeightsToDevice()

    def detachFromDevice(self):
        """Copy weights to the host and release the device; the next call re-attaches."""
        if not self._attached:
            raise Error("Device is not attached")
        self.copyWeightsToHost()
        self._attached = False

    def isAttachedToDevice(self):
        """True while attached to the device."""
        return self._attached

    def destroy(self):
        """Sync weights and optimizer state to the host, free the executable and unwrap the model."""
        if self._exe is not None and self._shared.dirty is self:
            self.copyWeightsToHost()
        self._reset()
        shared = self._shared
        if shared.executors.get(_kind(self._training)) is self:
            del shared.executors[_kind(self._training)]
        if not shared.executors and _SHARED.get(self._model) is shared:
            _unhook_model(self._model)

    # -- introspection --------------------------------------------------------------------------
    def getPerfCounters(self):
        """Host-side timestamps (seconds) of the last call: input, input_complete, output, output_complete."""
        if self._perf is None:
            return {k: [] for k in ("input", "input_complete", "output", "output_complete")}
        return self._perf

    def cycleCount(self):
        """Simulated IPU cycles of the last call (needs Options.logCycleCount(True))."""
        if not self._options.log_cycle_count:
            raise Error("Cycle count logging is disabled. Please set option logCycleCount to True to enable.")
        if self._cycles is None:
            raise Error("Please run the model at least once before obtaining cycle count.")
        return self._cycles

    def isLoadedFromCache(self):
        """True when compiling was skipped because the executable cache held this model (not in PopTorch)."""
        return self._from_cache

    @property
    def profile(self):
        """The popsim profile of the compiled executable."""
        if self._exe is None:
            raise Error("The model has not been compiled yet")
        return self._exe.profile

    @property
    def options(self):
        """The (frozen) options this wrapper runs with."""
        return self._options

    @property
    def model(self):
        """The wrapped user model."""
        return self._model

    def __getattr__(self, name):
        if name.startswith("__") or name == "_model":
            raise AttributeError(name)
        return getattr(self._model, name)

    def __repr__(self):
        return f"PoplarExecutor({_kind(self._training)}, {self._model!r})"


def _run_on_device(exe, feeds, program):
    try:
        return exe.run(feeds, program=program)
    except popsim.Error as exc:
        raise Error(f"The simulated IPU failed while running the model: {exc}") from exc


_SIGNATURES = weakref.WeakKeyDictionary()


def _forward_parameters(model):
    """The parameters of ``model.forward``'s signature, computed once per forward function."""
    forward = model.forward
    key = getattr(forward, "__func__", forward)
    cached = _SIGNATURES.get(key)
    if cached is None:
        cached = _SIGNATURES[key] = inspect.signature(forward).parameters
    return cached


def _leaf_names(model, args, kwargs):
    """A readable name per flattened input leaf: the forward argument's name plus its path inside it."""
    positional = list(_forward_parameters(model))
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 0:
            base = positional[head.idx] if head.idx < len(positional) else f"args[{head.idx}]"
        else:
            base = head.key
        names.append(f"{base}{rest}")
    return names


def _dict_key_changes(compiled, given):
    """Keys of dict inputs that disappeared / appeared between two pytree specs."""
    missing, unexpected = [], []

    def walk(a, b):
        if a.type is dict and b.type is dict:
            missing.extend(k for k in a.context if k not in b.context)
            unexpected.extend(k for k in b.context if k not in a.context)
            pairs = [
                (a.children_specs[a.context.index(k)], b.children_specs[b.context.index(k)])
                for k in a.context
                if k in b.context
            ]
        elif a.type is b.type and a.num_children == b.num_children:
            pairs = zip(a.children_specs, b.children_specs)
        else:
            return
        for x, y in pairs:
            walk(x, y)

    walk(compiled, given)
    return missing, unexpected


def _check_compatible(old, new):
    """Raise unless ``new`` only changes variable hyper-parameters of the compiled ``old``."""
    for attr, dtype in new.state_dtypes.items():
        if old.state_dtypes.get(attr) != dtype:
            raise ValueError(f"{attr} is already compiled")
    if old.kind != new.kind or len(old.groups) != len(new.groups):
        raise Error("setOptimizer() needs an optimizer of the same type and parameter groups: call destroy() first")
    for index, (a, b) in enumerate(zip(old.groups, new.groups)):
        for name, value in a.values.items():
            if name not in a.variable and b.values[name] != value:
                raise Error(
                    f"Optimizer attribute {name} of parameter group {index} was compiled in as a constant "
                    f"({value}) and cannot change to {b.values[name]}: pass it explicitly to a poptorch.optim "
                    "optimizer to make it variable, or call destroy() to recompile."
                )
    if old.structure_key() != new.structure_key():
        raise Error("setOptimizer() changes a compiled-in optimizer setting: call destroy() to recompile")
