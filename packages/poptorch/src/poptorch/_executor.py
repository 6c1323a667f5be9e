"""``PoplarExecutor``: the wrapper ``trainingModel`` / ``inferenceModel`` return.

The first call captures the model on one micro-batch, builds the programs (``_training``), compiles them
for the simulated IPU (``_device``, through the executable cache), uploads weights and runs. Weights then
live on the device; the host copy is refreshed lazily: the user model's class is swapped for a subclass
whose parameter/buffer accessors first copy device weights back when a device holds newer ones. Which copy
of each tensor is current is tracked per tensor object (``_weights``), so tied weights, shared modules and
several wrappers of one model stay coherent (``_device_weights``).
"""

import copyreg
import functools
import inspect
import os
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch
import tqdm
from torch.utils import _pytree as pytree

import popsim
from poptorch import (
    _anchors,
    _auto_report,
    _blocks,
    _cache,
    _call_timeline,
    _device,
    _device_checks,
    _device_ids,
    _distributed,
    _executor_api,
    _fp_exceptions,
    _host_io_ops,
    _host_print,
    _interrupt,
    _logging,
    _optimizer_attributes,
    _overlapped_io,
    _recompute,
    _replication,
    _stochastic_rounding,
    _streaming,
    _synthetic_data,
    _training,
    _weights,
    optim,
)
from poptorch._batching import Layout
from poptorch._device_weights import DeviceWeights
from poptorch._gc_pause import paused
from poptorch._int_range import check_input
from poptorch._logging import logger
from poptorch.enums import ConnectionType
from poptorch.errors import Error, RecoverableError, UnrecoverableError
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
    """Per user model: its live wrappers (at most one training wrapper; any number of inference ones, as
    PopTorch's ``inferenceModel`` may wrap a model again)."""

    def __init__(self):
        self.executors = []


_SHARED = weakref.WeakKeyDictionary()
_ACCESSORS = (
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "state_dict",
    "load_state_dict",
    "modules",
    "named_modules",
    "children",
    "named_children",
    "__getattr__",
)


def _syncing(method):
    def accessor(self, *args, **kwargs):
        _weights.sync_host(self)
        return method(self, *args, **kwargs)

    accessor.__name__ = method.__name__
    accessor.__doc__ = method.__doc__
    return accessor


def _reduce_as(original):
    """``__reduce_ex__`` of a hooked model: pickle (``torch.save``) it, with current weights, as ``original``
    (loadable without poptorch)."""

    def __reduce_ex__(self, protocol):
        _weights.sync_host(self)
        reduced = super(type(self), self).__reduce_ex__(protocol)
        return (copyreg._reconstructor, (original, object, None), *reduced[2:])

    return __reduce_ex__


def _destroy_wrappers(self):
    """Destroy every PopTorch wrapper of this model (syncing weights to it first) and unwrap it."""
    shared = _SHARED.get(self)
    for executor in list(shared.executors) if shared else ():
        executor.destroy()


def _hook_model(model):
    """Swap ``model``'s class for a subclass whose accessors sync weights from the device first."""
    cls = type(model)
    if getattr(cls, "_poptorch_original_class", None) is None:
        namespace = {name: _syncing(getattr(cls, name)) for name in _ACCESSORS}
        namespace["_poptorch_original_class"] = cls
        namespace["__qualname__"] = cls.__qualname__
        namespace["__module__"] = cls.__module__
        namespace["__reduce_ex__"] = _reduce_as(cls)
        if not hasattr(cls, "destroy"):
            namespace["destroy"] = _destroy_wrappers
        model.__class__ = type(cls.__name__, (cls,), namespace)
    return _SHARED.setdefault(model, _SharedWeights())


def _unhook_model(model):
    model.__class__ = type(model)._poptorch_original_class
    _SHARED.pop(model, None)


def _kind(training):
    return "trainingModel" if training else "inferenceModel"


def _host_tensor(array, dtype):
    """A device result (an array this call owns) as a torch tensor (int64 comes back as int32, float64 as
    float32)."""
    tensor = torch.from_numpy(np.asarray(array, order="C"))
    return tensor.to(_HOST_DTYPES.get(dtype, dtype))


class PoplarExecutor(_executor_api.ExecutorQueries):
    """A model wrapped for the simulated IPU. Create it with ``trainingModel`` or ``inferenceModel``."""

    def __init__(self, model, options, training, optimizer=None):
        if isinstance(model, PoplarExecutor):
            model = model._model
        self._model = model
        self._training = training
        self._user_options = options._freeze()
        self._options = options._for_model(training)
        # Parameter FQN -> (CommGroupType, shards, VariableRetrievalMode), as PopTorch's: set by each
        # parameter's replicaGrouping() or directly, before compiling.
        self.per_replica_params = {}
        if not training and self._options.Training.gradient_accumulation != 1:
            raise Error("inferenceModel does not support gradient accumulation: set Training.gradientAccumulation(1)")
        if not training and self._options.Training.automatic_loss_scaling:
            raise Error(
                "inferenceModel has no loss to scale: automatic loss scaling is for training; "
                "set Training.setAutomaticLossScaling(False) in the inference options"
            )
        self._layout = Layout(self._options, training)
        shared = _SHARED.get(model)
        if training and shared and any(e._training for e in shared.executors):
            raise RuntimeError(
                f"Model has already been wrapped in 'poptorch.{_kind(training)}'. Call model.destroy() on the "
                "model to unwrap it before wrapping it again. (destroy() is a method of both the wrapped model "
                "and the PoplarExecutor the first wrapping returned.)"
            )
        self._shared = _hook_model(model)
        self._shared.executors.append(self)
        if training and optimizer is None:
            from poptorch.optim import SGD

            optimizer = SGD(model.parameters(), lr=0.01)
        self._optimizer = optimizer
        self._spec = describe(optimizer) if training else None
        if training:
            optim.use(optimizer, self)
        # Set by the legacy signatures: write the profile after compiling; sync the host after each call
        # (a legacy loss wraps the user model, so reading the user's own module cannot trigger a sync).
        self._write_profile = False
        self._sync_after_call = False
        self._report_dir, self._profile_ran = None, True  # set by each compile: profiles to write again
        self._reset()

    def _reset(self):
        self._exe = None
        self._shared_gradients = []
        self._all_reduce_cycles = 0
        self._replica_buffers = None
        self._programs = None
        self._captured = None
        self._device = None
        self._attached = False
        self._compiled_inputs = None
        self._cycles = None
        self._timed_call = None  # (CallRuns, its cycles) of the latest call
        self._host_write_cycles = 0  # hyper-parameters setOptimizer wrote since the last call, costed in the next
        self._perf = None
        self._from_cache = False
        self._anchors = None
        self._anchor_memory = {}

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Capture and compile for these inputs without running."""
        self._check_arguments(args, kwargs)
        args, kwargs = _bind_positionally(self._model, args, kwargs)
        if self._exe is None:
            with _executor_api.compile_hooks():
                self._compile(args, kwargs)
        if not self._attached and self._options.connection_type == ConnectionType.Always:
            self.attachToDevice()

    def isCompiled(self):
        """True once the model has been compiled (and not destroyed)."""
        return self._exe is not None

    @paused  # the collector's walks over every object would cost about a tenth of the compile
    def _compile(self, args, kwargs, exported=None):
        from poptorch._capture import capture, excluding_sources

        started = time.perf_counter()
        report_dir = _auto_report.report_directory()  # checked first: a bad setting fails before compiling
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
            if self._options.Distributed.numProcesses > 1:
                # Every process starts from process 0's weights, buffers and optimizer state.
                _distributed.join(self._options)
                _distributed.broadcast_host_tensors([*self._model.parameters(), *self._model.buffers()])
                _distributed.broadcast_optimizer_state(self._optimizer if self._training else None)
            mode = self._model.training
            self._model.train(self._training)
            try:
                with (
                    excluding_sources(self._options.source_location_excludes),
                    _executor_api.running_on_ipu(self._training, self._options),
                    _host_io_ops.collecting_host_callbacks() as host_ops,
                    _blocks.recording(self._options.execution_strategy),
                ):
                    with _replication.per_replica_parameters(
                        self._model, self.per_replica_params, _replication.global_replicas(self._options)
                    ) as stand_ins:
                        captured = capture(self._model, mb_args, mb_kwargs)
                    captured.tensors = {name: stand_ins.get(t, t) for name, t in captured.tensors.items()}
            finally:
                self._model.train(mode)
            self._multi_ipu = _blocks.plan(captured.graph, self._options, self._training)
            _device_ids.check(self._options, self._multi_ipu.num_ipus)
            self._overlapped_io = _overlapped_io.resolve(captured)
            io_tiles = _device.io_tile_memory(captured.graph, self._overlapped_io, self._options)
            if self._training:
                group_of = self._group_of(captured)
                own_counts = _replication.grouped_names(self.per_replica_params, self._options)
                sizes = {name: captured.graph.input(name).type.size for name in captured.parameters if name in group_of}
                replicas = _replication.global_replicas(self._options)
                sharded = _streaming.sharded_parameters(sizes, self._options, replicas)
                programs = _training.build_training(
                    captured, self._spec, group_of, self._options, phase, own_counts, sharded
                )
            else:
                phase("autodiff")
                programs = _training.build_inference(captured)
                phase("optimise")
            optimizer = (self._spec, group_of) if self._training else ()
            self._anchors = _anchors.Anchors.of(captured, programs, self._options, *optimizer)
            if self._options.Precision.stochastic_rounding:
                programs.graphs = {n: _stochastic_rounding.apply(g) for n, g in programs.graphs.items()}
            if self._options.Precision.floating_point_exceptions:
                _fp_exceptions.instrument(programs.graphs)
            key = _cache.key(programs.graphs, self._options)
            cache = _cache.ExecutableCache.open(self._options) if exported is None else None
            exe = cache.load(key, programs.graphs) if cache else exported and exported.executable_for(key)
            cache_hit = exe is not None
            if exe is None:
                _training.optimise(programs)
                if self._training:
                    _recompute.apply(programs.graphs, programs.micro_batch, self._options.recomputation, programs.loss)
                _logging.log_programs(programs.graphs)
                phase("compile")
                exe = _device.compile_programs(programs.graphs, self._options, self._multi_ipu.num_ipus)
                if cache:
                    cache.store(key, exe)
            else:
                logger.info("Loaded the executable from the cache (%s)", key[:16])
                phase("compile")
            bar.n = bar.total
            bar.refresh()
        _device.check_pipeline_memory(exe, programs.micro_batch, self._multi_ipu, self._options, self._training)
        if io_tiles:
            exe.profile.programs[programs.micro_batch]["io_tiles"] = io_tiles
        exe.host_callbacks = {name: op.run_arrays for name, op in host_ops.items()}  # this model's poptorch.CPU ops
        self._captured, self._programs, self._exe = captured, programs, exe
        graph = programs.graphs[programs.micro_batch]
        self._input_dtypes = [graph.input(name).dtype.numpy for name in captured.input_names]  # each run's feeds
        distributed = self._training and self._options.Distributed.numProcesses > 1
        self._shared_gradients = _training.summed_over_processes(programs) if distributed else []
        self._all_reduce_cycles = _replication.all_reduce_cycles(
            exe, programs, self._options, self.per_replica_params, self._spec
        )
        self._replica_buffers = _replication.ReplicaBuffers.of(captured, programs, self._options)
        self._device = DeviceWeights(exe, captured, programs, self._options.random_seed)
        self._device.grouped = _replication.GroupedParameters.of(
            self.per_replica_params, captured, programs, self._options, self._device.slots
        )
        self._device.sharded = _replication.ShardedState.of(programs, self._device.slots)
        if self._training:
            optim.use(self._optimizer, self)  # again after a destroy()
            self._device.set_optimizer(self._optimizer, self._spec)
            relax = self._options.relax_optimizer_attributes_checks
            self._attribute_checks = _optimizer_attributes.AttributeChecks(self._optimizer, relax)
        self._from_cache = cache_hit
        self._key = key
        self._report_dir = report_dir
        self._profile_ran = False
        self._save_profiles()
        self._compiled_inputs = (spec, [self._input_signature(leaf) for leaf in leaves])
        _executor_api.record_compile_time(self, started)
        logger.debug("Compiled %s for %d input leaves", _kind(self._training), len(leaves))

    def _save_profiles(self):
        """Write the profile files the options and POPLAR_ENGINE_OPTIONS ask for: at compile time (the
        compiled programs), and again after the first call, which adds what running showed (the call's
        timeline, pipeline schedule, phases and overlapped I/O)."""
        profile = self._exe.profile
        name = self._options.model_name or ("training" if self._training else "inference")
        if self._write_profile or self._options.profile_dir:
            directory = self._options.log_dir or "."
            if self._options.profile_dir:
                directory = os.path.join(self._options.profile_dir, name)
            os.makedirs(directory, exist_ok=True)
            profile.to_json(os.path.join(directory, "profile.json"))
        if self._report_dir is not None:
            logger.info("Profile report written to %s", _auto_report.write(profile, self._report_dir, name))

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
        # The device narrows 64-bit types to 32 bits.
        _device.check_input_fits(name, self._layout.micro_batch_shape(leaf), min(leaf.element_size(), 4), self._options)
        if leaf.ndim == 0:
            return leaf
        return leaf[: self._layout.micro_batch_shape(leaf)[0]].clone()

    @staticmethod
    def _input_signature(leaf):
        return _TensorSignature(leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf

    def _group_of(self, captured):
        """Parameter-group index of each captured parameter the optimizer trains (matched by tensor identity)."""
        self._check_optimizer_groups()
        name_of = {id(tensor): name for name, tensor in captured.tensors.items()}
        group_of = {}
        for index, group in enumerate(self._spec.groups):
            for position, p in enumerate(group.params):
                if id(p) not in name_of:
                    raise Error(
                        f"Parameter {position} of the optimizer's parameter group {index} (shape {list(p.shape)}) "
                        "is not a parameter of the wrapped model, so it would never be trained: build the "
                        "optimizer from the wrapped model's parameters()."
                    )
                group_of[name_of[id(p)]] = index
        return group_of

    def _check_optimizer_groups(self):
        """Raise if the optimizer's parameter groups changed since it was described (add_param_group...)."""
        groups = self._optimizer.param_groups
        if len(groups) != len(self._spec.groups) or any(
            len(group["params"]) != len(spec.params) or any(a is not b for a, b in zip(group["params"], spec.params))
            for group, spec in zip(groups, self._spec.groups)
        ):
            raise Error(
                "The optimizer's parameter groups changed after it was given to poptorch (add_param_group() or "
                "an edited 'params' list): the compiled model would not train the new parameters. Before the "
                "first call, call setOptimizer(optimizer); after it, call destroy() and wrap the model again."
            )

    # -- arguments ------------------------------------------------------------------------------
    def _check_arguments(self, args, kwargs):
        forward = _forward_of(self._model)
        unexpected = [k for k in kwargs if k not in forward.parameters and not forward.takes_kwargs]
        if unexpected:
            raise Error(f"Unexpected arguments: {', '.join(unexpected)}.")
        positional = forward.positional
        if not forward.takes_varargs and len(args) > len(positional):
            raise Error(f"Too many positional arguments: forward takes {len(positional)}, got {len(args)}.")
        given = {*positional[: len(args)], *kwargs}
        missing = [name for name in forward.required if name not in given]
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
            compiled_text = _structure_text(self._model, compiled_spec, signatures)
            given_text = _structure_text(self._model, spec, [self._input_signature(leaf) for leaf in leaves])
            raise Error(
                f"The structure of the inputs changed since compilation: the model was compiled for forward"
                f"({compiled_text}) and is now called with forward({given_text}). Pass the arguments with the "
                "structure they had, or call destroy() to recompile."
            )

        def name(position):
            # Built only to report a mismatch: naming every leaf costs more than checking it.
            return _leaf_names(self._model, args, kwargs)[position]

        for i, (leaf, expected) in enumerate(zip(leaves, signatures)):
            if isinstance(leaf, torch.Tensor) != isinstance(expected, _TensorSignature):
                raise Error(_kind_change(name(i), leaf, expected))
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
        args, kwargs = _bind_positionally(self._model, args, kwargs)
        if self._exe is None:
            with _executor_api.compile_hooks():
                self._compile(args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._compiled_inputs[0]:  # dict inputs whose keys arrive in another order
            args, kwargs = _in_compiled_order((args, kwargs), self._compiled_inputs[0])
            leaves, spec = pytree.tree_flatten((args, kwargs))
        self._check_compiled_inputs(args, kwargs, leaves, spec)
        if self._options.connection_type == ConnectionType.Never:
            raise Error(
                "Options.connectionType(ConnectionType.Never) compiles without a device: this model cannot run. "
                "Use ConnectionType.Always or OnDemand to run it."
            )
        if not self._attached:
            self.attachToDevice()
        if self._training:
            self._check_optimizer_groups()
        self._device.prepare()
        outputs = self._run(leaves)
        if not self._profile_ran:
            self._profile_ran = True
            self._save_profiles()
        if self._sync_after_call:
            self.copyWeightsToHost()
        return outputs

    def _run(self, leaves):
        captured, layout = self._captured, self._layout
        self._device.grouped.check_unchanged(self.per_replica_params)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        feeds_by_name = {}
        for name, tensor, dtype in zip(captured.input_names, tensors, self._input_dtypes):
            check_input(name, tensor, captured.index_bounds.get(name, ()))
            # A view of the user's tensor when it already has the device's dtype and layout: each run's feed
            # is copied onto the device before the call returns.
            feeds_by_name[name] = layout.split(name, np.asarray(tensor.detach().numpy(), dtype=dtype, order="C"))
        synthetic = self._options.enable_synthetic_data
        if synthetic:
            feeds_by_name = _synthetic_data.inputs(feeds_by_name, self._options.random_seed)
        perf = {k: [[] for _ in tensors] for k in ("input", "input_complete")}
        perf.update({k: [[] for _ in captured.outputs] for k in ("output", "output_complete")})
        per_output = self._run_device_iterations(feeds_by_name, perf)
        self._perf = perf
        self._anchor_memory = {
            name: torch.from_numpy(np.array(value)) for name, value in self._anchors.read(per_output, layout).items()
        }
        if self._options.log_cycle_count:
            # At DEBUG, as PopTorch documents (POPTORCH_LOG_LEVEL=DEBUG shows it).
            logger.debug("Simulated cycle count of the last call: %d", self._cycles)
        for input_name, output_name in captured.input_mutations.items() if not synthetic else ():
            target = tensors[captured.input_names.index(input_name)]
            with torch.no_grad():
                target.copy_(torch.from_numpy(layout.all_runs(per_output[output_name])).reshape(target.shape))
        transfer = _synthetic_data.outputs if synthetic else np.asarray
        results = [
            _host_tensor(transfer(layout.combine(per_output[name])), dtype).as_subclass(_OutputTensor)
            for name, dtype in zip(captured.outputs, captured.output_dtypes)
        ]
        return pytree.tree_unflatten(results, captured.out_spec)

    def _run_device_iterations(self, feeds_by_name, perf):
        """Run every micro-batch and optimizer step of one call; returns the outputs per micro-batch.

        Ctrl-C finishes the step under way and stops there; whatever stops the call, the device's new
        weights are recorded (so the host reads them) and a step cut short leaves no partial gradients.
        """
        exe, programs, layout = self._exe, self._programs, self._layout
        per_output, runs_per_step = {}, layout.ga * layout.r
        run_cycles = []  # for the host-side latency figures; the cycle count is the call's timeline
        micro_batch_cycles = []  # each run's own cycles (run_cycles adds a step's optimizer run to its last)
        step_runs = []  # each step's gradient reduction and optimizer run
        batches = list(layout.micro_batches())
        ran = done = 0
        try:
            with (
                _interrupt.deferred_keyboard_interrupt() as interrupted,
                self._replica_buffers.call(exe, self._device.uploaded),
            ):
                for index, (d, a, r) in enumerate(batches):
                    start = time.time()
                    feeds = {name: np.asarray(split[d, a, r], order="C") for name, split in feeds_by_name.items()}
                    _append_time(perf, ("input",), start)
                    _append_time(perf, ("input_complete",), time.time())
                    ran = index + 1
                    with self._replica_buffers.replica(exe, r), self._device.grouped.replica(exe, r):
                        result = _run_on_device(exe, feeds, programs.micro_batch, programs.graphs[programs.micro_batch])
                    run_cycles.append(exe.last_run_cycles or 0)
                    micro_batch_cycles.append(run_cycles[-1])
                    _append_time(perf, ("output",), time.time())
                    for name, value in result.items():  # arrays the run returned for this call alone
                        per_output.setdefault(name, []).append(np.asarray(value))
                    _append_time(perf, ("output_complete",), time.time())
                    if ran % runs_per_step == 0:
                        if self._shared_gradients:
                            _distributed.all_reduce_sum(exe, self._shared_gradients, self._device.grouped)
                        if programs.step:
                            step, step_result = programs.graphs[programs.step], {}
                            updated = [s.name for s in step.updates]
                            run = lambda into=step_result: into.update(_run_on_device(exe, {}, programs.step))  # noqa: E731
                            sharded_step = functools.partial(self._device.sharded.step, exe, run, updated)
                            self._device.grouped.step(exe, sharded_step, updated)
                            step_result.update(self._device.sharded.joined_outputs(exe))
                            for name, value in step_result.items():  # anchors the step streams to the host
                                per_output.setdefault(name, []).append(np.array(value))
                            step_cycles = self._all_reduce_cycles + (exe.last_run_cycles or 0)
                            step_runs.append(step_cycles)
                            run_cycles[-1] += step_cycles
                        done = ran
                        if interrupted() and done < len(batches):
                            raise KeyboardInterrupt
        except BaseException as exc:
            if ran:
                self._device.after_run(self._training)
            if ran > done:
                self._device.discard_partial_step()
            if isinstance(exc, KeyboardInterrupt):
                message = _interrupted_message(done // runs_per_step, len(batches) // runs_per_step)
                raise KeyboardInterrupt(message) from None
            raise
        self._device.after_run(self._training)
        call = _call_timeline.CallRuns(
            batches[:done],
            micro_batch_cycles[:done],
            runs_per_step,
            step_runs,
            self._training and layout.ga > 1,
            self._host_write_cycles,
        )
        self._cycles = self._call_cycles(call)
        self._host_write_cycles = 0
        _executor_api.record_run(self, run_cycles, feeds, result)
        return per_output

    def _call_cycles(self, call):
        """The cycles of ``call`` on its timeline (``_call_timeline.call_cycles``), laid out again only when
        its runs or their cycles differ from the previous call's: the layout and the profile entries it
        writes depend on nothing else that can change after compiling."""
        if self._timed_call is None or self._timed_call[0] != call:
            args = (self._exe, self._programs, self._multi_ipu, self._options, self._overlapped_io, call)
            self._timed_call = (call, _call_timeline.call_cycles(*args))
        return self._timed_call[1]

    # -- weights --------------------------------------------------------------------------------
    def copyWeightsToDevice(self):
        """Upload the host's parameters, buffers and optimizer state (overwriting unsynced device training)."""
        if self._exe is None:
            raise Error("The model must be compiled before weights can be copied to the device")
        self._device.upload_all()

    def copyWeightsToHost(self):
        """Copy the device's parameters, buffers and optimizer state into the user model and optimizer."""
        if self._device is not None:
            self._device.download()

    def load_state_dict(self, state_dict, strict=True):
        """Load ``state_dict`` into the wrapped model and upload it to the device (as PopTorch does)."""
        result = self._model.load_state_dict(state_dict, strict)
        if self._attached:
            self.copyWeightsToDevice()
        return result

    # -- optimizer ------------------------------------------------------------------------------
    def setOptimizer(self, optimizer):
        """Use ``optimizer`` from the next call on: its variable hyper-parameters need no recompilation, and
        a state it holds (``optimizer.load_state_dict``) replaces the device's."""
        if not self._training:
            raise Error("setOptimizer() is only available on a trainingModel")
        spec = describe(optimizer)
        if self._exe is not None:
            _check_compatible(self._spec, spec)
            self._attribute_checks.check(optimizer)
        optim.release(self._optimizer, self)
        optim.use(optimizer, self)
        self._optimizer, self._spec = optimizer, spec
        if self._device is not None:
            self._host_write_cycles += self._device.set_optimizer(optimizer, spec)

    # -- device ---------------------------------------------------------------------------------
    def attachToDevice(self):
        """Attach to the (simulated) device and upload weights."""
        if self._attached:
            raise Error("Device is already attached")
        if self._exe is None:
            raise Error("The model must be compiled before it can be attached")
        self._attached = True
        self._device.attach()
        self._device.prepare()

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
        self.copyWeightsToHost()
        self._reset()
        if self._training:
            optim.release(self._optimizer, self)
        shared = self._shared
        shared.executors[:] = [e for e in shared.executors if e is not self]
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

    def __reduce__(self):
        """Pickled (``torch.save``) as the recipe that wraps the model again, with the host's current weights
        and optimizer state; the loaded wrapper compiles on its first call."""
        self.copyWeightsToHost()
        optimizer = self._optimizer if self._training else None
        args = (self._model, self._user_options.clone(), self._training, optimizer)
        return PoplarExecutor, args, {"per_replica_params": dict(self.per_replica_params)}

    def __getattr__(self, name):
        if name.startswith("__") or name == "_model":
            raise AttributeError(name)
        value = getattr(self._model, name)
        if isinstance(value, torch.nn.Parameter):
            return _replication.GroupingView(value, name, self.per_replica_params, self.isCompiled)
        return value

    def __repr__(self):
        return f"PoplarExecutor({_kind(self._training)}, {self._model!r})"


def _append_time(perf, keys, when):
    for key in keys:
        for lists in perf[key]:
            lists.append(when)


def _interrupted_message(done, total):
    return (
        f"Interrupted after {done} of {total} device iterations of this call. The device's weights and optimizer "
        "state include exactly those iterations (reading the model on the host copies them back); this call's "
        "outputs are lost."
    )


def _run_on_device(exe, feeds, program, graph=None):
    try:
        result = exe.run(feeds, program=program)
    except popsim.EngineFault as exc:
        raise UnrecoverableError(
            f"The simulated IPU hit an unrecoverable fault: {exc}. Its memory can no longer be trusted: destroy "
            "the model (model.destroy()) and wrap it again",
            type="poplar_unrecoverable_runtime_error",
        ) from exc
    except popsim.Error as exc:
        where = None
        if graph is not None and isinstance(exc, popsim.IndexRangeError):
            where = _device.locate_index_error(exe, graph, feeds)
        detail = f"\nThe failing op: {where}" if where else ""
        raise RecoverableError(
            f"The simulated IPU failed while running the model: {exc}{detail}",
            recovery_action="IPU_RESET",
            type="popsim_runtime_error",
        ) from exc
    _fp_exceptions.check(result)
    _device_checks.check(result)
    _host_print.emit(result)
    return result


_SIGNATURES = weakref.WeakKeyDictionary()


class _Forward:
    """``model.forward``'s signature and what each call's argument check needs of it."""

    def __init__(self, forward):
        self.signature = inspect.signature(forward)
        params = self.parameters = self.signature.parameters
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self.takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.positional = [p.name for p in params.values() if p.kind in kinds]
        self.only_positional = len(self.positional) == len(params)  # no *args, keyword-only or **kwargs
        self.required = [
            p.name for p in params.values() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]


def _forward_of(model):
    """``_Forward`` of ``model.forward``, computed once per forward function."""
    forward = model.forward
    key = getattr(forward, "__func__", forward)
    cached = _SIGNATURES.get(key)
    if cached is None:
        cached = _SIGNATURES[key] = _Forward(forward)
    return cached


def _forward_parameters(model):
    """The parameters of ``model.forward``'s signature."""
    return _forward_of(model).parameters


def _bind_positionally(model, args, kwargs):
    """(args, kwargs) with each argument forward takes by position moved into ``args`` and every argument
    left out given its default, so passing an argument by keyword or by position, or leaving an optional one
    at its default or passing that default (``None``), is one and the same call, as PopTorch's argument
    parser makes it."""
    forward = _forward_of(model)
    if not kwargs and forward.only_positional and len(args) == len(forward.positional):
        return args, kwargs  # already bound: every argument given by position
    try:
        bound = forward.signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs  # _check_arguments has reported what it can; let the call go on as given
    bound.apply_defaults()
    return bound.args, bound.kwargs


def _in_compiled_order(value, spec):
    """``value`` with each dict's keys in the order of the same dict in the compiled input structure
    ``spec`` (a pytree spec), when it has the same keys: PopTorch matches dict inputs by key."""
    if spec.type is dict and isinstance(value, dict) and set(value) == set(spec.context):
        return {key: _in_compiled_order(value[key], spec.child(i)) for i, key in enumerate(spec.context)}
    if spec.type in (tuple, list) and isinstance(value, spec.type) and len(value) == spec.num_children:
        return spec.type(_in_compiled_order(v, spec.child(i)) for i, v in enumerate(value))
    return value


class _TensorSignature(NamedTuple):
    """What a tensor input is checked against after compilation (other inputs keep their value)."""

    shape: torch.Size
    dtype: torch.dtype


class _Shown:
    """A leaf shown by its description when a call's structure is printed."""

    def __init__(self, signature):
        if isinstance(signature, _TensorSignature):
            self.text = f"Tensor{list(signature.shape)} {str(signature.dtype).replace('torch.', '')}"
        else:
            self.text = repr(signature)

    def __repr__(self):
        return self.text


def _structure_text(model, spec, signatures):
    """A call's arguments as ``x=Tensor[2] float32, y=(Tensor[3] int64,)``."""
    args, kwargs = pytree.tree_unflatten([_Shown(s) for s in signatures], spec)
    names = list(_forward_parameters(model))
    shown = [f"{names[i] if i < len(names) else f'args[{i}]'}={value!r}" for i, value in enumerate(args)]
    return ", ".join(shown + [f"{key}={value!r}" for key, value in kwargs.items()])


def _kind_change(name, leaf, expected):
    """The error for an argument that was a tensor at compilation and is not now, or the other way round."""
    if isinstance(expected, _TensorSignature):
        return (
            f"Input {name} was a tensor ({list(expected.shape)}, {expected.dtype}) when the model was compiled, "
            f"but got {leaf!r}. Pass a tensor of that shape and dtype, or call destroy() "
            "to recompile."
        )
    return (
        f"Argument {name} was {expected!r} when the model was compiled, so that value is compiled into the "
        f"model, but got a tensor. Pass {expected!r} again, or call destroy() and call the model with the tensor "
        "to recompile with it as an input."
    )


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
            raise ValueError(
                f"{attr} is already compiled: the model was compiled with {attr}={old.state_dtypes.get(attr)} and "
                f"the new optimizer asks for {dtype}. Keep {attr} as it was, or call destroy() and wrap the model "
                "again to change it."
            )
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
