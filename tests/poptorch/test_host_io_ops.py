"""PopTorch's host-transfer and host-code ops: set_overlap_for_input / _output (OverlapMode), CPU host
callbacks, MultiConv and ctc_beam_search_decoder. Each runs as PopTorch's does on the CPU; on the simulated
IPU what is modelled works and the rest is refused as not modelled."""

import pytest
import torch

import poptorch


def _options():
    return poptorch.Options().showCompilationProgressBar(False)


class _Overlapped(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x, extra):
        x, extra = poptorch.set_overlap_for_input((x, {"e": extra}), self.mode)
        out = self.fc(x) + extra["e"]
        return poptorch.set_overlap_for_output(out, self.mode)


def test_no_overlap_marks_tensors_and_runs_as_eager():
    model = _Overlapped(poptorch.OverlapMode.NoOverlap)
    x, extra = torch.randn(4, 3), torch.randn(4, 2)
    torch.testing.assert_close(poptorch.inferenceModel(model, _options())(x, extra), model(x, extra))


@pytest.mark.parametrize(
    "mode", [poptorch.OverlapMode.OverlapAccumulationLoop, poptorch.OverlapMode.OverlapDeviceIterationLoop]
)
def test_overlapping_modes_run_on_the_cpu_and_are_refused_on_the_ipu(mode):
    model = _Overlapped(mode)
    x, extra = torch.randn(4, 3), torch.randn(4, 2)
    assert model(x, extra).shape == (4, 2)
    refused = r"set_overlap_for_input\(\.\.\., OverlapMode\.Overlap\w+\) is not modelled by the simulated IPU"
    with pytest.raises(poptorch.Error, match=refused):
        poptorch.inferenceModel(model, _options())(x, extra)


def test_overlap_needs_tensors_and_a_mode():
    with pytest.raises(poptorch.Error, match="only set overlap for torch.tensor"):
        poptorch.set_overlap_for_input([torch.ones(1), 3], poptorch.OverlapMode.NoOverlap)
    with pytest.raises(poptorch.Error, match="must be a poptorch.OverlapMode"):
        poptorch.set_overlap_for_output(torch.ones(1), "no_overlap")


class _WithHostOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cpu = poptorch.CPU(self.double, "Double")

    def double(self, x):
        return x * 2.0

    def forward(self, x):
        return self.cpu(x + 1.0)


def test_a_host_callback_runs_on_the_cpu_and_is_refused_on_the_ipu():
    model = _WithHostOp()
    torch.testing.assert_close(model(torch.ones(2)), torch.full((2,), 4.0))
    with pytest.raises(poptorch.Error, match=r"poptorch.CPU\('Double'\) is not modelled"):
        poptorch.inferenceModel(model, _options())(torch.ones(2))


class _Convs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(1, 2, 3), torch.nn.Conv2d(1, 2, 3)

    def forward(self, x):
        with poptorch.MultiConv().planType(poptorch.MultiConvPlanType.Parallel).availableMemoryProportions(0.5):
            return self.a(x) + self.b(x)


def test_multiconv_is_a_no_op_on_the_cpu_and_refused_on_the_ipu():
    model, x = _Convs(), torch.randn(1, 1, 5, 5)
    torch.testing.assert_close(model(x), model.a(x) + model.b(x))
    with pytest.raises(poptorch.Error, match="poptorch.MultiConv is not modelled"):
        poptorch.inferenceModel(model, _options())(x)
    with pytest.raises(poptorch.Error, match="MultiConvPlanType"):
        poptorch.MultiConv().planType("parallel")


def test_ctc_beam_search_decoder_is_refused_clearly():
    probs, lengths = torch.randn(5, 2, 4).log_softmax(2), torch.tensor([5, 4])
    with pytest.raises(poptorch.Error, match="ctc_beam_search_decoder is not modelled"):
        poptorch.ctc_beam_search_decoder(probs, lengths, beam_width=3)
    with pytest.raises(poptorch.Error, match="lengths must be a torch.tensor"):
        poptorch.ctc_beam_search_decoder(probs, [5, 4])
