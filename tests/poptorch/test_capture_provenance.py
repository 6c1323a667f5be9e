"""Every captured popir node names its module path (NameScopes first), ATen op, source line and role."""

import torch

import poptorch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU())
        self.head = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x, y):
        with poptorch.NameScope("features"), poptorch.NameScope("conv"):
            h = self.body(x)
        out = self.head(h.flatten(1))
        return out, torch.nn.functional.cross_entropy(out, y)


def _train_graph():
    torch.manual_seed(0)
    model = _Net()
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=0.1))
    training(torch.randn(2, 1, 6, 6), torch.tensor([0, 2]))
    return training._programs.graphs["train"]


def test_nodes_carry_module_path_aten_op_source_line_and_role():
    nodes = _train_graph().nodes
    forward = {(n.module, n.aten) for n in nodes if n.role == "forward"}
    assert ("features/conv/body.0", "aten.convolution.default") in forward
    assert ("features/conv/body.1", "aten.relu.default") in forward
    assert ("head", "aten.addmm.default") in forward
    conv = next(n for n in nodes if n.module == "features/conv/body.0" and n.role == "forward")
    assert "test_capture_provenance.py:" in conv.source and "self.body(x)" in conv.source
    backward = {n.module for n in nodes if n.role == "backward"}
    assert {"features/conv/body.0", "head"} <= backward
    assert any(n.role == "optimizer" for n in nodes)
    assert {n.role for n in nodes} <= {"forward", "backward", "optimizer", None}


def test_gradient_accumulation_and_its_step_are_optimizer_work():
    torch.manual_seed(0)
    model = _Net()
    options = poptorch.Options()
    options.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1))
    training(torch.randn(4, 1, 6, 6), torch.tensor([0, 2, 1, 0]))
    graphs = training._programs.graphs
    accumulate = graphs["accumulate"]
    updates = [v.producer for s, v in accumulate.updates.items() if s.kind == "optimizer_state"]
    assert updates and all(n.role == "optimizer" for n in updates)
    assert {n.role for n in graphs["apply"].nodes} == {"optimizer"}
