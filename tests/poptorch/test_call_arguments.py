"""How a wrapped model takes its arguments after compilation, as PopTorch's argument parser does: an optional
argument left at its default or passed as that default, dict inputs matched by key, keyword or positional
arguments alike; and a model that returns nothing."""

import pytest
import torch

import poptorch


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


class _Optional(torch.nn.Module):
    def forward(self, x, y=None, scale=2.0):
        out = x * scale
        return out if y is None else out + y


def test_an_optional_argument_left_at_its_default_or_passed_as_it_is_the_same_call():
    x, y = torch.randn(3), torch.randn(3)
    model = _Optional()
    executor = poptorch.inferenceModel(model, _opts())
    for call in ((x,), (x, None), (x, None, 2.0)):
        torch.testing.assert_close(executor(*call), model(*call))
    torch.testing.assert_close(executor(x, scale=2.0, y=None), model(x))
    with pytest.raises(poptorch.Error, match="Argument y was None when the model was compiled"):
        executor(x, y)


def test_arguments_by_keyword_or_by_position_are_the_same_call():
    x, y = torch.randn(3), torch.randn(3)
    model = _Optional()
    executor = poptorch.inferenceModel(model, _opts())
    expected = model(x, y)
    for args, kwargs in (((x, y), {}), ((x,), {"y": y}), ((), {"y": y, "x": x})):
        torch.testing.assert_close(executor(*args, **kwargs), expected)


class _DictInput(torch.nn.Module):
    def forward(self, inputs):
        return inputs["a"] * 2 - inputs["b"], inputs["nested"]["c"]


def test_dict_inputs_are_matched_by_key_whatever_their_order():
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(2)
    model = _DictInput()
    executor = poptorch.inferenceModel(model, _opts())
    executor({"a": a, "b": b, "nested": {"c": c}})
    for inputs in ({"b": b, "a": a, "nested": {"c": c}}, {"nested": {"c": c}, "b": b, "a": a}):
        for ours, eager in zip(executor(inputs), model(inputs)):
            torch.testing.assert_close(ours, eager)


class _Accumulate(torch.nn.Module):
    def forward(self, x, total):
        total.add_(x * 2)


def test_a_model_returning_nothing_returns_none_and_updates_its_inputs_in_place():
    x, total = torch.randn(3), torch.zeros(3)
    executor = poptorch.inferenceModel(_Accumulate(), _opts())
    assert executor(x, total) is None
    torch.testing.assert_close(total, x * 2)
    assert executor(x, total) is None
    torch.testing.assert_close(total, x * 4)
