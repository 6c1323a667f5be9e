"""The decomposition table capture hands ``run_decompositions``, and the composite operators torch.export
looks up, kept per set of registered operators instead of rebuilt on every capture.

torch.export works out which operators are functional composites (CompositeImplicitAutograd) each time it
builds a decomposition table and again each time it decomposes, walking every operator namespace and querying
the dispatcher once per namespace: about 0.4 s of CPU a capture, most of a small model's capture. The answer
depends only on which operators are registered, so it is kept under a fingerprint of the dispatcher's
composite registrations and the operator namespaces: registering a new operator (a user's custom op) changes
the fingerprint and the set is worked out afresh, as torch would.
"""

import contextlib

import torch
import torch.export.decomp_utils as _decomp_utils
import torch.export.exported_program as _exported_program

_COMPOSITE = "CompositeImplicitAutograd"
# The modules whose ``_collect_all_valid_cia_ops`` export calls (each imported it by name).
_USERS = (_exported_program, _decomp_utils)
_collect_cia_ops = _exported_program._collect_all_valid_cia_ops  # torch's own walk
_cia_ops = {}  # fingerprint -> frozenset of torch's answer
_tables = {}  # (fingerprint, operators left out) -> the decomposition table


def _fingerprint():
    """What torch's answer depends on: the composite kernels the dispatcher holds and the operator namespaces."""
    registrations = torch._C._dispatch_get_registrations_for_dispatch_key(_COMPOSITE)
    return tuple(sorted(registrations)), tuple(sorted(torch.ops._dir))


def _cached_cia_ops():
    """(fingerprint, torch's set of composite operators). Torch's walk itself looks up every namespace the
    dispatcher names, which adds them to ``torch.ops``: the set is kept under the fingerprint after the walk
    too, so the next capture finds it."""
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
    saved = [module._collect_all_valid_cia_ops for module in _USERS]
    for module in _USERS:
        module._collect_all_valid_cia_ops = lambda: set(ops)  # callers may change their copy
    try:
        yield lambda dropped: _table(fingerprint, dropped)
    finally:
        for module, original in zip(_USERS, saved):
            module._collect_all_valid_cia_ops = original


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
