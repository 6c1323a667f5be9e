"""Capture: ``torch.export`` a model, then lower its core-ATen graph to a popir forward graph.

``capture(model, args, kwargs)`` exports with ``strict=False`` (in the model's current train/eval mode),
runs the default core-ATen decompositions except the loss ops (so each loss stays one node) and detach
(whose decomposition, alias, would let gradients through), checks that every op has a lowering in
``_aten_table.TABLE`` (listing all unsupported ops at once, with the user's source lines), then interprets
the exported graph node by node into popir. Every popir node records the user's source line.

Randomness (dropout): the graph gets one extra input of kind ``buffer`` named ``RNG_SEED`` ("_rng_seed",
int32[2]); each random op draws from its own stream derived from it. The runtime owns the seed: it feeds
it and advances it between steps (capture registers no update for it).
"""

import contextlib
import contextvars
import functools
import inspect
import operator
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.fx.traceback import preserve_node_meta
from torch.utils import _pytree as pytree

import popir
import poptorch._losses  # noqa: F401  (registers the poptorch:: custom ops before export sees them)
from poptorch import _blocks, _decompositions, _fx_sources
from poptorch._aten_table import IGNORED_OPS, LOSS_OPS, TABLE, UNDECOMPOSED_OPS, popir_dtype
from poptorch._int_range import IndexBound, user_input_of
from poptorch._logging import logger
from poptorch._module_aliases import registered_once
from poptorch._poptorch_ops import NAME_SCOPE_META
from poptorch.errors import Error, UnsupportedOpError

RNG_SEED = "_rng_seed"

_TORCH_DIR = os.path.dirname(torch.__file__)
_POPTORCH_DIR = os.path.dirname(__file__)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')
# Keyword arguments that only place a tensor (device, memory layout): meaningless on the IPU.
# Path fragments of further files that are not the user's (Options.sourceLocationExcludes).
_EXCLUDED = contextvars.ContextVar("poptorch_source_excludes", default=())
_PLACEMENT_KWARGS = frozenset({"device", "layout", "pin_memory", "memory_format", "non_blocking"})
_USER_PATHS_KEPT = 4096  # source files whose user/library verdict is remembered


@dataclass
class Captured:
    """A captured model: the popir forward graph and how the user's call maps onto it.

    graph: forward graph. User tensors are inputs of kind "input", parameters kind "parameter" named by
        FQN, buffers kind "buffer" named by FQN (plus ``RNG_SEED`` when the model draws random numbers).
    input_names: graph input names of the user's tensor arguments, in flat order (args then kwargs).
    input_specs: (torch.Size, torch.dtype) of each user tensor as given (before narrowing).
    constant_args: flat position (index into ``flatten_call`` leaves) -> value of each non-tensor argument
        baked into the graph.
    parameters / frozen / buffers: FQNs in named_parameters() / requires_grad=False / named_buffers() order.
    tensors: FQN -> the host tensor behind each parameter and buffer input. Aliases of one tensor (tied
        weights, a submodule used twice) are one input, named by the first FQN torch lists.
    outputs: graph output names of the flattened user outputs, in order; out_spec rebuilds their structure.
    output_dtypes: torch dtypes of the outputs as eager torch returns them.
    input_mutations: user input name -> graph output name holding its in-place updated value.
    losses: final loss Values (outputs of identity_loss or of a torch loss that no other loss consumes).
    index_bounds: user input name -> ``_int_range.IndexBound``s of the index operands it feeds directly.
    """

    graph: popir.Graph
    input_names: list = field(default_factory=list)
    input_specs: list = field(default_factory=list)
    constant_args: dict = field(default_factory=dict)
    parameters: list = field(default_factory=list)
    frozen: set = field(default_factory=set)
    buffers: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    out_spec: object = None
    output_dtypes: list = field(default_factory=list)
    input_mutations: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    index_bounds: dict = field(default_factory=dict)


def flatten_call(args, kwargs):
    """The flat leaves of a call's (args, kwargs), in the order ``Captured`` positions refer to."""
    leaves, _ = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    return leaves


@_fx_sources.forgotten_after()
def capture(model, args, kwargs=None):
    """Export ``model(*args, **kwargs)`` and lower it to popir; raises poptorch.Error with the user's line."""
    args, kwargs = tuple(args), dict(kwargs or {})
    root = _TensorOutputs(model)
    program = _export(root, args, kwargs)
    _check_supported(program)
    captured = _Lowering(model, program, args, kwargs).run()
    captured.out_spec = root.out_spec()
    return captured


class _TensorOutputs(torch.nn.Module):
    """Runs the user's model and hands export the flat leaves of its output, every leaf that is neither a
    tensor nor a plain Python value (a transformers ``Cache``, any object torch's pytree does not know)
    replaced by None, so export never fails on them. ``out_spec()`` rebuilds the output: containers pytree
    knows (tuples, lists, dicts, Hugging Face ``ModelOutput``s...) keep their class and fields. The user's
    parameters are under ``_WRAPPED``."""

    def __init__(self, model):
        super().__init__()
        self.wrapped = model
        specs = []  # a closure, not an attribute: export restores the module's attributes after tracing

        def forward(*args, **kwargs):
            result = model(*args, **kwargs)
            # A model returning nothing (it updates inputs or buffers in place) returns None, as PopTorch's.
            result = _DROPPED if result is None else pytree.tree_map(_returnable, result)
            leaves, spec = pytree.tree_flatten(result)
            specs[:] = [spec]
            return leaves

        self.out_spec = lambda: specs[0]

        # export names the graph inputs after forward's parameters: keep the user's names.
        forward.__signature__ = inspect.signature(model.forward)
        self.forward = forward


_WRAPPED = "wrapped."
_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))  # a None output stays an error, as before


class _Dropped:
    """Stands for an output leaf the IPU does not return: a pytree node with no leaves, rebuilt as None."""


_DROPPED = _Dropped()
pytree.register_pytree_node(
    _Dropped, lambda _: ([], None), lambda _leaves, _context: None, serialized_type_name="poptorch.DroppedOutput"
)


def _returnable(leaf):
    if isinstance(leaf, _PLAIN_LEAVES):
        return leaf
    log_once(
        f"the model returns a {type(leaf).__module__}.{type(leaf).__qualname__}, which is not a tensor or a "
        "container of tensors; the IPU model returns None in its place"
    )
    return _DROPPED


def _check_output_leaf(node, position):
    """A model's outputs are tensors (or numbers, returned as tensors); None, strings and other objects are
    refused with the fix rather than failing inside torch."""
    if isinstance(node, torch.fx.Node | int | float):
        return
    raise Error(
        f"The model's output {position} is {node!r} ({type(node).__name__}): a PopTorch model returns tensors, "
        "alone or in tuples, lists or dicts. Return a tensor there, or leave the value out of the outputs."
    )


def _export(model, args, kwargs):
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught, _decompositions.composite_ops_cached() as table_without:
            # torch.export deep-copies its own tree specs through a deprecated path; not the user's concern.
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            # preserve_node_meta keeps NameScope annotations on the exported nodes.
            with registered_once(model), _full_stack_traces(), poptorch._losses.CaptureCtcLoss(), preserve_node_meta():
                program = torch.export.export(model, args, kwargs, strict=False)
            _detach_grad_disabled_regions(program)
            return _decompositions.decompose(program, table_without(LOSS_OPS + UNDECOMPOSED_OPS))
    except Error:
        raise
    except Exception as exc:
        raise Error(_export_failure(exc)) from exc
    finally:
        _show_once(caught)


_SHOWN = set()


def _show_once(caught):
    """Show each distinct warning raised while exporting once per process. Without this, the warnings torch
    raises about the model (an LSTM's ``_flat_weights ... assigned during export``) repeat on every compile:
    catching warnings resets Python's own once-per-line registry."""
    for w in caught:
        key = (w.category, str(w.message))
        if key not in _SHOWN:
            _SHOWN.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def log_once(message):
    """Log ``message`` as a warning the first time it comes up in this process."""
    if message not in _SHOWN:
        _SHOWN.add(message)
        logger.warning(message)


def _detach_grad_disabled_regions(program):
    """Inline every ``torch.no_grad()`` block of forward and detach its results, so no gradient flows back
    through it (as in eager torch). Export keeps such a block as one ``wrap_with_set_grad_enabled(False, ...)``
    node; the decompositions that follow would inline it themselves, dropping both the grad mode and the
    user's source lines of the ops inside."""
    gm = program.graph_module
    graph = gm.graph
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    blocks = [node for node in graph.nodes if node.target is hop and not node.args[0]]
    if not blocks:  # nothing to inline: the graph module's code stays as export generated it
        return
    for node in blocks:
        results = _inline_body(gm, node)
        # Each result the block hands out (a getitem of the block node) reaches its users detached.
        for user in list(node.users):
            source = user if results is None else results[user.args[1]]
            with graph.inserting_after(user):
                detached = graph.call_function(torch.ops.aten.detach.default, (source,))
            detached.meta = dict(user.meta)
            user.replace_all_uses_with(detached, delete_user_cb=lambda use, d=detached: use is not d)
            if results is not None:
                graph.erase_node(user)
        if results is not None:
            submodule = node.args[1]
            graph.erase_node(node)
            if not submodule.users:
                graph.erase_node(submodule)
                delattr(gm, submodule.target)
    gm.recompile()


def _inline_body(gm, node):
    """Copy the ops of a grad-mode block's body in front of ``node``, keeping their source lines; returns
    the copies of its results. A block holding a nested block (a get_attr) is left whole: None."""
    body = getattr(gm, node.args[1].target).graph
    if any(b.op == "get_attr" for b in body.nodes):
        return None
    env = dict(zip([b for b in body.nodes if b.op == "placeholder"], node.args[2:]))
    with gm.graph.inserting_before(node):
        for b in body.nodes:
            if b.op == "call_function":
                env[b] = gm.graph.node_copy(b, env.__getitem__)
            elif b.op == "output":
                return [env[r] for r in b.args[0]]


def _export_failure(exc):
    where = _user_frame_of_traceback(exc.__traceback__)
    summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "data-dependent" in str(exc) or "GuardOnDataDependent" in type(exc).__name__:
        what = (
            "the model's Python code depends on tensor values (data-dependent control flow, .item(), "
            "int()/float()/bool() of a tensor), which the IPU cannot compile"
        )
    else:
        what = "the model could not be captured with torch.export"
    return f"{what}{f' at {where}' if where else ''}: {summary}"


def _user_frame_of_traceback(tb):
    frames = [f for f in traceback.extract_tb(tb) if _is_user_file(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"


def _is_user_file(path):
    """Code of the user or of a library they use (transformers...): neither torch, poptorch nor generated."""
    if path.startswith("<"):  # <string>, <eval_with_key>: code torch generated
        return False
    if not os.path.isabs(path):  # resolved against the working directory, which may change: not kept
        return _is_user_path.__wrapped__(os.path.abspath(path), _EXCLUDED.get())
    return _is_user_path(path, _EXCLUDED.get())


@functools.lru_cache(maxsize=_USER_PATHS_KEPT)
def _is_user_path(path, excluded):
    """``_is_user_file`` of an absolute path, for the excluded fragments ``excluded``. Export asks it of
    every frame of every traced op (thousands of times per model, of the same few dozen files), hence
    kept: the answer depends only on the path, the fragments and the two fixed install directories."""
    path = os.path.normpath(path)
    if any(fragment in path for fragment in excluded):
        return False
    return not (path.startswith(_TORCH_DIR) or path.startswith(_POPTORCH_DIR))


class _EveryUserFrame:
    """Stands in for torch.fx's set of stack-trace anchors during export: it holds every frame of user or
    library code, so a node's recorded stack keeps helper functions (a mask utility), not only ``forward``s."""

    def __contains__(self, frame):
        return _is_user_file(frame[0])


@contextlib.contextmanager
def _full_stack_traces():
    saved = torch.fx.proxy._STACK_TRACE_ANCHORS
    torch.fx.proxy._STACK_TRACE_ANCHORS = _EveryUserFrame()
    try:
        yield
    finally:
        torch.fx.proxy._STACK_TRACE_ANCHORS = saved


def _frame_text(m):
    return f"{m['file']}:{m['line']}: {m['code'].strip()}"


@contextlib.contextmanager
def excluding_sources(fragments):
    """Inside: files whose path contains one of ``fragments`` are not the user's source lines either
    (``Options.sourceLocationExcludes``)."""
    token = _EXCLUDED.set(tuple(fragments))
    try:
        yield
    finally:
        _EXCLUDED.reset(token)


def source_line(node):
    """Where an exported fx node was made: the innermost frame of user or library code as ``file:line:
    code``, followed by the model-level line that led there when that is another one (None if unknown).

    Nodes made by decompositions may carry no stack trace; they take the line of the nearest user that has one.
    """
    pending, seen = [node], set()
    while pending:
        current = pending.pop(0)
        frames = list(_FRAME.finditer(current.meta.get("stack_trace") or ""))
        # The stack starts where the model was called; the model's own code starts at the first forward.
        start = next((i for i, m in enumerate(frames) if m["func"] == "forward"), 0)
        frames = [m for m in frames[start:] if _is_user_file(m["file"])]
        if frames:
            # The model-level line: in the outermost forward (decorators around it are not the model).
            outer = next((m for m in frames if m["func"] == "forward"), frames[0])
            inner, outer = _frame_text(frames[-1]), _frame_text(outer)
            return inner if inner == outer else f"{inner} (from {outer})"
        seen.add(current)
        pending.extend(u for u in current.users if u not in seen)
    return None


def module_path(node):
    """The module that made an exported fx node, as a dotted path from the model (``layer1.0.conv2``; "" for
    the model itself), after the enclosing NameScopes joined by "/"."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    path = path.removeprefix(_WRAPPED) if path != _WRAPPED[:-1] else ""
    scope = (node.meta.get("custom") or {}).get(NAME_SCOPE_META)
    return "/".join(p for p in (scope, path) if p)


def _is_foldable(node):
    """A factory op (arange, full, scalar_tensor, ...): no tensor inputs and deterministic, so foldable."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return not any(isinstance(a, torch.fx.Node) for a in leaves) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_symbolic(node):
    return node.target is torch.ops.aten.sym_size.int or (
        getattr(node.target, "__module__", None) in ("_operator", "operator") and node.target is not operator.getitem
    )


def _check_supported(program):
    problems = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target in TABLE or node.target in IGNORED_OPS:
            continue
        if _is_foldable(node) or _is_symbolic(node):
            continue
        name = node.target.name() if hasattr(node.target, "name") else str(node.target)
        if node.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            name += " (Tensor.item(): reading a tensor value in Python)"
        problems.append(f"  {name} at {source_line(node) or 'an unknown line'}")
    if problems:
        raise UnsupportedOpError(f"{len(problems)} unsupported operation(s) in the model:\n" + "\n".join(problems))


class _Lowering:
    """fx-Interpreter over the exported graph: fx nodes -> popir Values (the ``ctx`` of every lowering)."""

    def __init__(self, model, program, args, kwargs):
        self.model = model
        self.program = program
        self.args, self.kwargs = args, kwargs
        self.graph = popir.Graph(type(model).__name__)
        self.node = None
        self.env = {}
        self._seed = None
        self._streams = 0
        self.index_bounds = {}
        self._placement = None  # the (stage, IPU) of the block under way (poptorch._blocks)

    # -- services for the lowerings -----------------------------------------------------------------
    def random_seed(self):
        """An int32[2] seed for one random op: the RNG_SEED input offset by a per-op stream number."""
        if self._seed is None:
            self._seed = self.graph.add_input(RNG_SEED, (2,), "int32", kind="buffer")
        stream = self._streams
        self._streams += 1
        if stream == 0:
            return self._seed
        return self._seed + self.graph.constant(np.array([0, stream], dtype=np.int32))

    def bound_index(self, index, size, what, negative=False, allowed=()):
        """Have each call check that the user input feeding ``index`` (if any) holds valid indices for an
        axis of ``size``: [0, size), or [-size, size) when ``negative`` indices wrap; ``allowed`` are extra
        values the op accepts (an ignore_index)."""
        source = user_input_of(index)
        if source is not None:
            bound = IndexBound(-size if negative else 0, size, what, source_line(self.node), tuple(allowed))
            self.index_bounds.setdefault(source.name, []).append(bound)

    # -- driver ----------------------------------------------------------------------------------------
    def run(self):
        captured = Captured(graph=self.graph)
        self._add_state_inputs(captured)
        self._bind_inputs(captured)
        for node in self.program.graph.nodes:
            if node.op == "call_function":
                self.env[node] = self._lower(node)
            elif node.op == "output":
                self._bind_outputs(captured, node.args[0])
        captured.out_spec = self.program.call_spec.out_spec
        captured.index_bounds = self.index_bounds
        captured.losses = [self._loss_value(n) for n in _final_losses(self.program.graph, self._user_output_nodes())]
        _blocks.fill_placements(self.graph)
        return captured

    def _add_state_inputs(self, captured):
        self.state = {}
        for fqn, p in self.model.named_parameters():
            self.state[id(p)] = self.graph.add_input(fqn, p.shape, popir_dtype(p.dtype), kind="parameter")
            captured.parameters.append(fqn)
            captured.tensors[fqn] = p
            if not p.requires_grad:
                captured.frozen.add(fqn)
        for fqn, b in self.model.named_buffers():
            self.state[id(b)] = self.graph.add_input(fqn, b.shape, popir_dtype(b.dtype), kind="buffer")
            captured.buffers.append(fqn)
            captured.tensors[fqn] = b

    def _state_input(self, kind, target):
        target = target.removeprefix(_WRAPPED)
        tensor = self.model.get_parameter(target) if kind == InputKind.PARAMETER else self.model.get_buffer(target)
        return self.state[id(tensor)]

    def _bind_inputs(self, captured):
        placeholders = {n.name: n for n in self.program.graph.nodes if n.op == "placeholder"}
        leaves = flatten_call(self.args, self.kwargs)
        user_specs = [s for s in self.program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        position = dict(
            zip(
                (s.arg.name for s in user_specs if isinstance(s.arg, TensorArgument)),
                (i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)),
            )
        )
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                captured.constant_args[i] = leaf
        for spec in self.program.graph_signature.input_specs:
            node = placeholders[spec.arg.name] if isinstance(spec.arg, TensorArgument) else None
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self.env[node] = self._state_input(spec.kind, spec.target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                tensor = self.program.constants[spec.target]
                self.env[node] = _constant(self.graph, tensor)
            elif spec.kind == InputKind.USER_INPUT and node is not None:
                leaf = leaves[position[node.name]]
                self.env[node] = self.graph.add_input(node.name, leaf.shape, popir_dtype(leaf.dtype))
                captured.input_names.append(node.name)
                captured.input_specs.append((leaf.shape, leaf.dtype))
            elif spec.kind != InputKind.USER_INPUT:
                raise Error(f"models with {spec.kind.name.lower()} inputs ({spec.target}) are not supported")
        for node in placeholders.values():
            self.env.setdefault(node, node.meta.get("val"))

    def _lower(self, node):
        self.node = node
        where = source_line(node)
        if node.target in IGNORED_OPS:
            return None
        args, kwargs = pytree.tree_map_only(torch.fx.Node, self._read, (node.args, node.kwargs))
        kwargs = {k: v for k, v in kwargs.items() if k not in _PLACEMENT_KWARGS}
        try:
            self._placement = _blocks.placement_of(node) or self._placement
        except Error as exc:
            raise type(exc)(f"{exc} (at {where or 'an unknown line'})", location=where) from None
        annotations = {"module": module_path(node), "aten": str(node.target), "role": "forward"}
        with self.graph.annotate(source=where, placement=self._placement, **annotations):
            try:
                if node.target in TABLE:
                    return TABLE[node.target](self, *args, **kwargs)
                if _is_foldable(node):
                    return _constant(self.graph, node.target(*args, **kwargs))
                raise Error(f"{node.target} has no lowering")
            except Error as exc:
                raise type(exc)(f"{exc} (at {where or 'an unknown line'})", location=where) from None
            except popir.IRError as exc:
                raise Error(
                    f"could not lower {node.target} at {where or 'an unknown line'}: {exc}", location=where
                ) from exc

    def _read(self, node):
        value = self.env[node]
        if value is None and node.op == "call_function":
            raise Error(
                f"the result {node.name} of {node.args[0].target if node.args else node.target} "
                f"is not available on the IPU (used at {source_line(node) or 'an unknown line'})"
            )
        return value

    def _bind_outputs(self, captured, results):
        for spec, node in zip(self.program.graph_signature.output_specs, results):
            value = self.env[node] if isinstance(node, torch.fx.Node) else node
            if spec.kind == OutputKind.USER_OUTPUT:
                _check_output_leaf(node, len(captured.outputs))
                name = f"output_{len(captured.outputs)}"
                meta = node.meta.get("val") if isinstance(node, torch.fx.Node) else torch.tensor(node)
                if not isinstance(value, popir.Value):
                    value = _constant(self.graph, torch.as_tensor(meta if value is None else value))
                self.graph.output(name, value)
                captured.outputs.append(name)
                captured.output_dtypes.append(meta.dtype)
            elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION):
                kind = InputKind.BUFFER if spec.kind == OutputKind.BUFFER_MUTATION else InputKind.PARAMETER
                state = self._state_input(kind, spec.target)
                self.graph.update(state, _fit(value, state))
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                name = f"mutated_{spec.target}"
                target = self.graph.input(spec.target)
                self.graph.output(name, _fit(value, target))
                captured.input_mutations[spec.target] = name
            else:
                raise Error(f"exported output of kind {spec.kind.name} is not supported")

    def _user_output_nodes(self):
        out = next(n for n in self.program.graph.nodes if n.op == "output")
        return [
            node
            for spec, node in zip(self.program.graph_signature.output_specs, out.args[0])
            if spec.kind == OutputKind.USER_OUTPUT and isinstance(node, torch.fx.Node)
        ]

    def _loss_value(self, node):
        value = self.env[node]
        return value[0] if isinstance(value, (tuple, list)) else value


def _fit(value, like):
    """``value`` with the dtype and shape of graph input ``like`` (for state updates)."""
    if value.dtype != like.dtype:
        value = value.graph.apply("cast", (value,), {"dtype": like.dtype})[0]
    if value.shape != like.shape:
        value = value.graph.apply("reshape", (value,), {"shape": like.shape})[0]
    return value


def _constant(graph, tensor):
    tensor = torch.as_tensor(tensor).detach().cpu()
    return graph.constant(tensor.numpy(), dtype=popir_dtype(tensor.dtype))


def _final_losses(fx_graph, user_outputs):
    """Final loss nodes: loss ops no other loss op depends on, each extended to the user output it feeds.

    A loss that only flows through single-loss arithmetic into a user output (``loss * 0.5``,
    ``kl_div(...) / batch``) is represented by that output, so training minimises what the user returns.
    """
    loss_nodes = [n for n in fx_graph.nodes if n.op == "call_function" and n.target in LOSS_OPS]
    depends = {}
    for node in fx_graph.nodes:
        inputs = node.all_input_nodes
        depends[node] = set().union(*(depends[a] | ({a} if a in loss_nodes else set()) for a in inputs))
    final = [n for n in loss_nodes if not any(n in depends[m] for m in loss_nodes)]
    outputs = set(user_outputs)
    return list(dict.fromkeys(_follow_to_output(n, depends, loss_nodes, outputs) for n in final))


def _follow_to_output(loss, depends, loss_nodes, outputs):
    current, reached = loss, loss if loss in outputs else None
    while True:
        users = [u for u in current.users if u.op == "call_function"]
        if len(users) != 1:
            break
        user = users[0]
        loss_inputs = [a for a in user.all_input_nodes if a in loss_nodes or depends[a] & set(loss_nodes)]
        if loss_inputs != [current]:
            break
        current = user
        if current in outputs:
            reached = current
    return reached or loss
