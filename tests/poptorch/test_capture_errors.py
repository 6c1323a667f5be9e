"""Capture errors name the user's source line: unsupported ops (all at once), .item(), data-dependent code."""

import pytest
import torch
from torch import nn

import poptorch.errors
from poptorch._capture import capture


class TwoUnsupported(nn.Module):
    def forward(self, x):
        y = torch.nonzero(x > 0).float().sum()  # line: nonzero
        z = torch.linalg.det(x)  # line: det
        return y + z


def test_all_unsupported_ops_are_listed_at_once_with_source_lines():
    with pytest.raises(poptorch.errors.UnsupportedOpError) as info:
        capture(TwoUnsupported(), (torch.randn(3, 3),))
    message = str(info.value)
    assert "nonzero" in message and "test_capture_errors.py" in message
    assert "torch.nonzero(x > 0)" in message
    assert "torch.linalg.det(x)" in message
    lines = [line for line in message.splitlines() if "test_capture_errors.py:" in line]
    assert len({line.split("test_capture_errors.py:")[1].split(":")[0] for line in lines}) == 2


class UnsupportedInNoGrad(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = torch.linalg.det(x)  # line: det under no_grad
        return y + x.sum()


def test_ops_inside_a_no_grad_block_keep_the_users_line():
    with pytest.raises(poptorch.errors.UnsupportedOpError) as info:
        capture(UnsupportedInNoGrad(), (torch.randn(3, 3),))
    assert "torch.linalg.det(x)  # line: det under no_grad" in str(info.value)


def test_unsupported_error_is_a_poptorch_error():
    assert issubclass(poptorch.errors.UnsupportedOpError, poptorch.errors.Error)


class ItemInArithmetic(nn.Module):
    def forward(self, x):
        scale = x.max().item()
        return x * scale


class DataDependentBranch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class IntOfTensor(nn.Module):
    def forward(self, x):
        return x[: int(x.abs().max())]


@pytest.mark.parametrize(
    ("model", "code"),
    [
        (DataDependentBranch(), "if x.sum() > 0:"),
        (IntOfTensor(), "return x[: int(x.abs().max())]"),
    ],
)
def test_data_dependent_python_names_the_users_line(model, code):
    with pytest.raises(poptorch.errors.Error) as info:
        capture(model, (torch.randn(4),))
    message = str(info.value)
    assert "depends on tensor values" in message
    assert "test_capture_errors.py" in message and code in message


def test_item_is_reported_with_its_line():
    with pytest.raises(poptorch.errors.Error) as info:
        capture(ItemInArithmetic(), (torch.randn(4),))
    message = str(info.value)
    assert ".item()" in message or "depends on tensor values" in message
    assert "scale = x.max().item()" in message


class BadShapes(nn.Module):
    def forward(self, x):
        return x @ x


def test_other_export_failures_are_poptorch_errors_with_the_line():
    with pytest.raises(poptorch.errors.Error) as info:
        capture(BadShapes(), (torch.randn(2, 3),))
    assert "return x @ x" in str(info.value)


class MaskRead(nn.Module):
    def forward(self, x):
        return x[x > 0]


def test_lowering_errors_name_the_line():
    with pytest.raises(poptorch.errors.Error) as info:
        capture(MaskRead(), (torch.randn(3, 3),))
    assert "torch.where" in str(info.value) and "return x[x > 0]" in str(info.value)


def _positive_entries(x):
    return x[x > 0]  # the op is made here, in a helper that is not a forward


class HelperMaskRead(nn.Module):
    def forward(self, x):
        return _positive_entries(x) * 2


def test_errors_name_the_innermost_frame_and_the_model_line_that_led_there():
    with pytest.raises(poptorch.errors.Error) as info:
        capture(HelperMaskRead(), (torch.randn(3, 3),))
    message = str(info.value)
    assert "return x[x > 0]  # the op is made here" in message
    assert "(from " in message and "return _positive_entries(x) * 2" in message
