"""capture()'s cached set of composite operators and decomposition table give the graph torch.export's own
rebuild-every-time path gives, and a newly registered operator is seen."""

import functools

import pytest
import torch
import torch._export.utils as export_utils
import torch.export.decomp_utils as decomp_utils
import torch.export.exported_program as exported_program
import torch.nn.functional as F
from torch import nn

from poptorch import _decompositions
from poptorch._aten_table import LOSS_OPS, UNDECOMPOSED_OPS
from poptorch._capture import _export, _TensorOutputs


class Mixed(nn.Module):
    """Ops whose decomposition depends on the table: linear and layer norm (composites), batch norm, a loss."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)
        self.norm, self.fc = nn.LayerNorm(12), nn.Linear(12, 4)

    def forward(self, x, labels):
        x = F.relu(self.bn(self.conv(x))).flatten(1)
        out = self.fc(F.gelu(self.norm(x)))
        return out, F.cross_entropy(out, labels)


class Composites(nn.Module):
    """Composite operators the retrace meets: attention (decomposed by its C++ kernel), matmul and upsampling
    (preserved), an LSTM and a custom composite operator that calls another composite (linear)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.lstm, self.fc = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 8)

    def forward(self, x):
        y = self.lstm(self.layer(x))[0] @ self.fc.weight
        y = torch.ops.poptorch_decomp_test.linear_twice(y, self.fc.weight)
        return F.interpolate(y[:, None], scale_factor=2.0, mode="nearest")


def _define_linear_twice():
    if not hasattr(torch.ops.poptorch_decomp_test, "linear_twice"):
        lib = torch.library.Library("poptorch_decomp_test", "FRAGMENT")
        lib.define("linear_twice(Tensor x, Tensor w) -> Tensor")
        lib.impl("linear_twice", lambda x, w: F.linear(x, w) * 2, "CompositeImplicitAutograd")
        _define_linear_twice.lib = lib  # the registration lives as long as the library object


def _ops(program):
    return [(n.op, str(n.target)) for n in program.graph_module.graph.nodes]


def _torch_rebuilt_table(model, args):
    """The export torch does when every table and composite set is worked out afresh."""
    table = torch.export.default_decompositions()
    for op in LOSS_OPS + UNDECOMPOSED_OPS:
        table.pop(op, None)
    return torch.export.export(_TensorOutputs(model), args, strict=False).run_decompositions(table)


@pytest.mark.parametrize(
    "model, args",
    [
        (Mixed, lambda: (torch.randn(2, 1, 4, 4), torch.tensor([1, 3]))),
        (Composites, lambda: (torch.randn(2, 3, 8),)),
    ],
    ids=["mixed", "composites"],
)
def test_cached_tables_give_torchs_graph_on_every_capture(model, args, monkeypatch):
    """Same operators as torch's own path; and the same nodes and source lines as a capture whose retrace
    overrides every composite."""
    _define_linear_twice()
    torch.manual_seed(0)
    model, args = model(), args()
    expected = _ops(_torch_rebuilt_table(model, args))
    captures = [_export(_TensorOutputs(model), args, {}) for _ in range(2)]  # the second reads the cache
    assert [_ops(p) for p in captures] == [expected] * 2
    monkeypatch.setattr(_decompositions, "_split_overriding_only_what_changes", _decompositions._split_table)
    every = _export(_TensorOutputs(model), args, {})
    assert [_nodes(p) for p in captures] == [_nodes(every)] * 2


def _nodes(program):
    """Each node's operator, arguments and innermost source frame (the outer ones are this test's)."""
    return [
        (n.op, str(n.target), str(n.args), (n.meta.get("stack_trace") or "").strip().splitlines()[-2:])
        for n in program.graph_module.graph.nodes
    ]


def test_an_operator_registered_after_a_capture_is_seen():
    _export(_TensorOutputs(nn.Linear(2, 2)), (torch.randn(1, 2),), {})  # fills the cache
    lib = torch.library.Library("poptorch_decomp_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    with _decompositions.composite_ops_cached():
        seen = exported_program._collect_all_valid_cia_ops()
    assert torch.ops.poptorch_decomp_test.twice.default in seen
    assert seen == export_utils._collect_all_valid_cia_ops()


def test_the_composite_set_is_torchs_walk_including_python_only_composite_kernels():
    """The set read from the dispatcher's registrations and the looked-up overloads is exactly the one torch
    walks every operator for: C++ composites, operators whose composite kernel Python registered (aten's
    nearest upsampling; a custom operator's), and none that may not be preserved (in-place, aliasing)."""
    if not hasattr(torch.ops.poptorch_decomp_test, "python_composite"):
        lib = torch.library.Library("poptorch_decomp_test", "FRAGMENT")
        lib.define("python_composite(Tensor x) -> Tensor")
        lib.impl("python_composite", lambda x: x * 3, "CPU")
        test_the_composite_set_is_torchs_walk_including_python_only_composite_kernels.lib = lib
        composite = torch._C.DispatchKey.CompositeImplicitAutograd
        torch.ops.poptorch_decomp_test.python_composite.default.py_impl(composite)(lambda x: x * 3)
    ours = _decompositions._collect_cia_ops()
    assert ours == exported_program._collect_all_valid_cia_ops()
    aten = torch.ops.aten
    assert {aten.upsample_nearest2d.default, torch.ops.poptorch_decomp_test.python_composite.default} <= ours
    assert aten.linear.default in ours and aten.add_.Tensor not in ours


def test_the_table_built_from_the_cached_set_is_torchs_default_table(monkeypatch):
    """default_decompositions() inside the block (its aten composites read from the cached set rather than
    walked) holds the same operators with the same decompositions as torch's own."""
    monkeypatch.setattr(_decompositions, "_tables", {})
    monkeypatch.setattr(_decompositions, "_cia_ops", {})
    with _decompositions.composite_ops_cached() as table_without:
        ours = table_without(())
    theirs = torch.export.default_decompositions()
    assert ours.keys() == set(theirs.keys())

    def same(fn):  # torch's stand-in for a C++ composite kernel: a partial of a new closure each time
        return (fn.func.__qualname__, fn.keywords["kernel"]) if isinstance(fn, functools.partial) else fn

    assert all(same(ours[op]) == same(theirs[op]) for op in ours)
    assert torch.ops.aten.linear.default in ours and torch.ops.aten.upsample_nearest2d.vec not in ours


def test_torchs_lookup_is_restored_after_the_block_even_on_error():
    original = exported_program._collect_all_valid_cia_ops
    try:
        with _decompositions.composite_ops_cached():
            assert exported_program._collect_all_valid_cia_ops is not original
            raise ValueError
    except ValueError:
        pass
    assert exported_program._collect_all_valid_cia_ops is original
    assert (
        decomp_utils._collect_all_valid_cia_ops_for_aten_namespace
        is export_utils._collect_all_valid_cia_ops_for_aten_namespace
    )


def test_the_second_capture_reuses_the_composite_set_the_first_one_worked_out(monkeypatch):
    """Torch's walk adds the namespaces it looks up to torch.ops (a new fingerprint); the set is found again
    under it afterwards rather than walked for anew."""
    monkeypatch.setattr(_decompositions, "_cia_ops", {})
    walks = []

    def walk():
        walks.append(1)
        getattr(torch.ops, f"poptorch_decomp_walk_{len(walks)}")  # looked up: now one of torch.ops' namespaces
        return set()

    monkeypatch.setattr(_decompositions, "_collect_cia_ops", walk)
    for _ in range(2):
        with _decompositions.composite_ops_cached():
            pass
    assert walks == [1]


def test_the_retrace_overrides_only_the_composites_whose_override_can_change_the_graph(monkeypatch):
    """Kept: the graph's own composites (linear), preserved ones (matmul, upsampling) and those torch gives a
    Python decomposition. Dropped: composites absent from the graph that would only run their own C++
    kernel (attention). A run_decompositions outside ``decompose`` keeps every override."""
    seen = []
    original = exported_program._decompose_exported_program

    def recording(program, **kwargs):
        seen.append(kwargs["cia_to_decomp"])
        return original(program, **kwargs)

    monkeypatch.setattr(exported_program, "_decompose_exported_program", recording)
    program = torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),), strict=False)
    with _decompositions.composite_ops_cached() as table_without:
        _decompositions.decompose(program, table_without([torch.ops.aten.matmul.default]))
        program.run_decompositions(table_without([torch.ops.aten.matmul.default]))
    kept, every = seen
    aten = torch.ops.aten
    assert {aten.linear.default, aten.matmul.default, aten.upsample_nearest2d.vec} <= kept.keys()
    assert aten.scaled_dot_product_attention.default in every.keys() - kept.keys()
    assert all(kept[op] is every[op] for op in kept)
    assert all(_decompositions._runs_own_composite_kernel(op, fn) for op, fn in every.items() if op not in kept)
    assert exported_program._split_decomp_table_to_cia_and_python_decomp is _decompositions._split_table
