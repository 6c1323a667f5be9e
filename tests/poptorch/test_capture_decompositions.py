"""capture()'s cached set of composite operators and decomposition table give the graph torch.export's own
rebuild-every-time path gives, and a newly registered operator is seen."""

import torch
import torch._export.utils as export_utils
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


def _ops(program):
    return [(n.op, str(n.target)) for n in program.graph_module.graph.nodes]


def _torch_rebuilt_table(model, args):
    """The export torch does when every table and composite set is worked out afresh."""
    table = torch.export.default_decompositions()
    for op in LOSS_OPS + UNDECOMPOSED_OPS:
        table.pop(op, None)
    return torch.export.export(_TensorOutputs(model), args, strict=False).run_decompositions(table)


def test_cached_tables_give_torchs_graph_on_every_capture():
    torch.manual_seed(0)
    model, args = Mixed(), (torch.randn(2, 1, 4, 4), torch.tensor([1, 3]))
    expected = _ops(_torch_rebuilt_table(model, args))
    for _ in range(2):  # the second capture reads the cache the first one filled
        assert _ops(_export(_TensorOutputs(model), args, {})) == expected


def test_an_operator_registered_after_a_capture_is_seen():
    _export(_TensorOutputs(nn.Linear(2, 2)), (torch.randn(1, 2),), {})  # fills the cache
    lib = torch.library.Library("poptorch_decomp_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    with _decompositions.composite_ops_cached():
        seen = exported_program._collect_all_valid_cia_ops()
    assert torch.ops.poptorch_decomp_test.twice.default in seen
    assert seen == export_utils._collect_all_valid_cia_ops()


def test_torchs_lookup_is_restored_after_the_block_even_on_error():
    original = exported_program._collect_all_valid_cia_ops
    try:
        with _decompositions.composite_ops_cached():
            assert exported_program._collect_all_valid_cia_ops is not original
            raise ValueError
    except ValueError:
        pass
    assert exported_program._collect_all_valid_cia_ops is original


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
