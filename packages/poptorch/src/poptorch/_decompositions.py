"""The decomposition table capture hands ``run_decompositions``, and the composite operators torch.export
looks up, kept per set of registered operators instead of rebuilt on every capture.

torch.export works out which operators are functional composites (CompositeImplicitAutograd) each time it
builds a decomposition table and again each time it decomposes, walking every operator namespace and querying
the dispatcher once per namespace: about 0.4 s of CPU a capture, most of a small model's capture. The answer
depends only on which operators are registered, so it is kept under a fingerprint of the dispatcher's
composite registrations and the operator namespaces: registering a new operator (a user's custom op) changes
the fingerprint and the set is worked out afresh, as torch would.

``run_decompositions`` then overrides the Python kernels of every composite operator for the length of its
retrace (a dozen kernel registrations per operator, about 0.1 s for some 500 operators), although most of
them are not in the graph and would only decompose into their own C++ composite kernel, as the dispatcher
does when no override is there. ``decompose`` keeps only the overrides that can change the graph: those of
the graph's own operators, of the preserved composites (left out of the table) and of those decomposed by a
Python decomposition of torch's table.
"""

import contextlib
import contextvars
import functools

import torch
import torch._export.utils as _export_utils
import torch.export.decomp_utils as _decomp_utils
import torch.export.exported_program as _exported_program

_COMPOSITE = "CompositeImplicitAutograd"
# The modules whose ``_collect_all_valid_cia_ops`` export calls (each imported it by name).
_USERS = (_exported_program, _decomp_utils)
_split_table = _exported_program._split_decomp_table_to_cia_and_python_decomp  # torch's own split
# Torch's stand-in for an operator without a Python composite kernel of its own (aten.linear has none).
_OWN_KERNEL = _export_utils._get_decomp_for_cia(torch.ops.aten.linear.default)
_GRAPH_OPS = contextvars.ContextVar("poptorch_decomposed_graph_ops", default=None)  # set by decompose()
_cia_ops = {}  # fingerprint -> frozenset of torch's answer
_tables = {}  # (fingerprint, operators left out) -> the decomposition table


def _fingerprint():
    """What torch's answer depends on: the composite kernels the dispatcher holds and the operator namespaces."""
    registrations = torch._C._dispatch_get_registrations_for_dispatch_key(_COMPOSITE)
    return tuple(sorted(registrations)), tuple(sorted(torch.ops._dir))


def _collect_cia_ops():
    """The set torch's ``_collect_all_valid_cia_ops`` returns, without its walk over every operator of every
    namespace (which materialises each overload of each operator: about 0.2 s of a process's first capture).
    An operator is composite when the dispatcher holds a C++ composite kernel for it, which the dispatcher
    lists by name, or when Python registered one on its overload object, which only an overload already
    looked up can hold; of those, torch keeps the ones it may preserve."""
    ops = {_overload(name) for name in torch._C._dispatch_get_registrations_for_dispatch_key(_COMPOSITE)}
    python_kernel = torch._C.DispatchKey.CompositeImplicitAutograd
    for namespace in list(torch.ops):
        operators = getattr(torch.ops, namespace)
        if not isinstance(operators, torch._ops._OpNamespace):
            continue
        for packet in [getattr(operators, name) for name in list(operators)]:
            looked_up = [getattr(packet, name) for name in list(packet._dir)]
            ops.update(op for op in looked_up if python_kernel in op.py_kernels)
    return {op for op in ops if _export_utils._is_preservable_cia_op(op)}


def _overload(qualified):
    """The OpOverload a dispatcher name ("aten::add.Tensor", "aten::relu") names; looking it up adds its
    namespace to ``torch.ops`` as torch's walk does."""
    namespace, name = qualified.split("::")
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _cached_cia_ops():
    """(fingerprint, torch's set of composite operators). Looking up the operators adds the namespaces the
    dispatcher names to ``torch.ops``: the set is kept under the fingerprint after the lookup too, so the
    next capture finds it."""
    fingerprint = _fingerprint()
    if fingerprint not in _cia_ops:
        ops = frozenset(_collect_cia_ops())
        _cia_ops[fingerprint] = ops
        fingerprint = _fingerprint()
        _cia_ops[fingerprint] = ops
    return fingerprint, _cia_ops[fingerprint]


@contextlib.contextmanager
def composite_ops_cached():
    """Within the block torch.export reads its set of composite operators from the cache (one dispatcher query
    instead of a walk per namespace); returns a function giving the decomposition table without some ops."""
    fingerprint, ops = _cached_cia_ops()
    aten = frozenset(op for op in ops if _export_utils._is_aten_op(op))
    saved = [module._collect_all_valid_cia_ops for module in _USERS]
    saved_aten = _decomp_utils._collect_all_valid_cia_ops_for_aten_namespace  # default_decompositions' walk
    for module in _USERS:
        module._collect_all_valid_cia_ops = lambda: set(ops)  # callers may change their copy
    _decomp_utils._collect_all_valid_cia_ops_for_aten_namespace = lambda: set(aten)
    _exported_program._split_decomp_table_to_cia_and_python_decomp = _split_overriding_only_what_changes
    try:
        yield lambda dropped: _table(fingerprint, dropped)
    finally:
        for module, original in zip(_USERS, saved):
            module._collect_all_valid_cia_ops = original
        _decomp_utils._collect_all_valid_cia_ops_for_aten_namespace = saved_aten
        _exported_program._split_decomp_table_to_cia_and_python_decomp = _split_table


def decompose(program, table):
    """``program.run_decompositions(table)``, its retrace overriding only the composite operators whose
    override changes the graph (see ``_split_overriding_only_what_changes``)."""
    ops = {n.target for n in program.graph_module.graph.nodes if n.op == "call_function"}
    token = _GRAPH_OPS.set(frozenset(ops))
    try:
        return program.run_decompositions(table)
    finally:
        _GRAPH_OPS.reset(token)


def _split_overriding_only_what_changes(decomp_table):
    """Torch's split of a table into (composite operator -> its override, the rest), without the overrides
    of operators that are not in the graph being decomposed and would only run their own C++ composite
    kernel. The dispatcher runs that same kernel without an override, and the operators the graph's own
    nodes call are called with autograd already dispatched past (by those nodes' overrides), so the
    retraced graph is the same. Outside ``decompose`` (graph unknown) every override is kept."""
    cia_to_decomp, python_table = _split_table(decomp_table)
    graph_ops = _GRAPH_OPS.get()
    if graph_ops is None:
        return cia_to_decomp, python_table
    kept = {op: fn for op, fn in cia_to_decomp.items() if op in graph_ops or not _runs_own_composite_kernel(op, fn)}
    return kept, python_table


def _runs_own_composite_kernel(op, fn):
    """Whether ``fn`` is torch's stand-in that calls ``op``'s own C++ CompositeImplicitAutograd kernel."""
    return (
        isinstance(fn, functools.partial)
        and fn.func.__name__ == _OWN_KERNEL.func.__name__
        and fn.keywords.get("kernel") is op
    )


def _table(fingerprint, dropped):
    """torch.export's default decompositions without the operators ``dropped``, as a fresh dict (export
    consumes the table it is given)."""
    key = (fingerprint, tuple(dropped))
    if key not in _tables:
        table = torch.export.default_decompositions()
        for op in dropped:
            table.pop(op, None)
        _tables[key] = dict(table)
    return dict(_tables[key])
