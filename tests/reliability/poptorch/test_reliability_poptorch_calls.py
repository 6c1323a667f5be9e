"""Catalogue: bad calls of a wrapped model. Each case asserts the clear error (or the right result) and that
the model still runs afterwards with unchanged weights."""

import pytest
import torch

import poptorch

error = pytest.mark.outcome("clear error")
right = pytest.mark.outcome("right result")


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Scale(torch.nn.Module):
    def forward(self, x, s):
        return x * s


class Keys(torch.nn.Module):
    def forward(self, d):
        return d["a"] + d["b"]


class Gather(torch.nn.Module):
    def forward(self, x, i):
        return torch.gather(x, 0, i)


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(4, 2)

    def forward(self, i):
        return self.embedding(i)


def _compiled(module, *args, **kwargs):
    model = poptorch.inferenceModel(module, _opts())
    torch.testing.assert_close(model(*args, **kwargs), module(*args, **kwargs))
    return model


def _still_runs(model, module, *args):
    torch.testing.assert_close(model(*args), module(*args))


ONES = torch.ones(2)


@error
def test_input_shape_changed_after_compile():
    model = _compiled(Add(), ONES, ONES)
    with pytest.raises(poptorch.Error, match=r"Input y: expected torch.Size\(\[2\]\) but got torch.Size\(\[3\]\)"):
        model(ONES, torch.ones(3))
    _still_runs(model, Add(), ONES, ONES)


@error
def test_input_dtype_changed_after_compile():
    model = _compiled(Add(), ONES, ONES)
    with pytest.raises(poptorch.Error, match="Input y: expected torch.float32 but got torch.int64"):
        model(ONES, torch.ones(2, dtype=torch.int64))
    _still_runs(model, Add(), ONES, ONES)


@error
def test_input_structure_changed_is_described_by_argument():
    model = _compiled(Add(), ONES, ONES)
    with pytest.raises(
        poptorch.Error,
        match=r"compiled for forward\(x=Tensor\[2\] float32, y=Tensor\[2\] float32\) and is now called with "
        r"forward\(x=\(Tensor\[2\] float32,\), y=Tensor\[2\] float32\)",
    ):
        model((ONES,), ONES)
    _still_runs(model, Add(), ONES, ONES)


@right
def test_positional_argument_passed_by_keyword_after_compile():
    model = _compiled(Add(), ONES, 2 * ONES)
    torch.testing.assert_close(model(ONES, y=3 * ONES), 4 * ONES)
    torch.testing.assert_close(model(y=3 * ONES, x=ONES), 4 * ONES)


@right
def test_keyword_argument_passed_by_position_after_compile():
    model = _compiled(Add(), x=ONES, y=2 * ONES)
    torch.testing.assert_close(model(ONES, 5 * ONES), 6 * ONES)


@error
def test_tensor_where_a_number_was_compiled_in():
    model = _compiled(Scale(), ONES, 2.0)
    with pytest.raises(poptorch.Error, match=r"Argument s was 2.0 when the model was compiled.*got a tensor.*destroy"):
        model(ONES, torch.tensor(2.0))
    _still_runs(model, Scale(), ONES, 2.0)


@error
def test_another_number_than_the_compiled_one():
    model = _compiled(Scale(), ONES, 2.0)
    with pytest.raises(poptorch.Error, match="Argument s.*compiled into the model.*2.0.*3.0"):
        model(ONES, 3.0)


@error
def test_none_for_a_tensor_argument():
    model = _compiled(Add(), ONES, ONES)
    with pytest.raises(poptorch.Error, match=r"Input y was a tensor \(\[2\], torch.float32\).*got None"):
        model(ONES, None)
    _still_runs(model, Add(), ONES, ONES)


@error
def test_dict_input_missing_a_key():
    model = _compiled(Keys(), {"a": ONES, "b": ONES})
    with pytest.raises(poptorch.Error, match="Missing arguments: b."):
        model({"a": ONES})


@error
def test_dict_input_with_an_extra_key():
    model = _compiled(Keys(), {"a": ONES, "b": ONES})
    with pytest.raises(poptorch.Error, match="Unexpected arguments: c."):
        model({"a": ONES, "b": ONES, "c": ONES})


@error
def test_unknown_keyword_argument():
    with pytest.raises(poptorch.Error, match="Unexpected arguments: z."):
        poptorch.inferenceModel(Add(), _opts())(ONES, ONES, z=ONES)


@error
def test_too_many_positional_arguments():
    with pytest.raises(poptorch.Error, match="Too many positional arguments: forward takes 2, got 3"):
        poptorch.inferenceModel(Add(), _opts())(ONES, ONES, ONES)


@error
def test_missing_argument():
    with pytest.raises(poptorch.Error, match="Missing arguments: y."):
        poptorch.inferenceModel(Add(), _opts())(ONES)


@error
def test_input_that_requires_grad():
    with pytest.raises(poptorch.Error, match="Input x requires grad.*detach"):
        poptorch.inferenceModel(Add(), _opts())(torch.ones(2, requires_grad=True), ONES)


@error
def test_zero_sized_input():
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[0, 2\]\)"):
        poptorch.inferenceModel(Add(), _opts())(torch.ones(0, 2), torch.ones(0, 2))


@error
def test_batch_not_a_multiple_of_device_iterations():
    model = poptorch.inferenceModel(Add(), _opts().deviceIterations(2))
    with pytest.raises(poptorch.Error, match=r"Invalid batch dimension: In the input x, the batch dimension \(3\)"):
        model(torch.ones(3, 2), torch.ones(3, 2))


@error
def test_input_larger_than_the_ipu_is_refused_before_capture():
    # 2.56 GB that is never touched: torch.empty only reserves it.
    huge = torch.empty(80_000_000, 8)
    with pytest.raises(poptorch.Error, match=r"Input x: one micro-batch of shape \[80000000, 8\] takes 2,560,000,000"):
        poptorch.inferenceModel(Add(), _opts())(huge, huge)


@error
@pytest.mark.parametrize("returned", [None, "text", (1, None)], ids=["None", "str", "tuple_with_None"])
def test_model_returning_a_non_tensor(returned):
    class Returns(torch.nn.Module):
        def forward(self, x):
            return returned if returned != (1, None) else (x, None)

    with pytest.raises(poptorch.Error, match=r"The model's output \d is .*a PopTorch model returns tensors"):
        poptorch.inferenceModel(Returns(), _opts())(ONES)


@error
def test_gather_index_out_of_range_names_the_op_and_input():
    x, good = torch.arange(4.0), torch.tensor([1, 3])
    model = _compiled(Gather(), x, good)
    with pytest.raises(poptorch.Error, match=r"(?s)index\(es\) out of range.*take_along_axis.*\[1, 7\].*from input i"):
        model(x, torch.tensor([1, 7]))
    _still_runs(model, Gather(), x, good)


@error
def test_embedding_index_out_of_range_names_the_op():
    torch.manual_seed(0)
    module = Embed()
    model = _compiled(module, torch.tensor([0, 3]))
    with pytest.raises(poptorch.Error, match=r"(?s)out of range.*gather.*size 4: \[1, 9\].*from input i"):
        model(torch.tensor([1, 9]))
    _still_runs(model, module, torch.tensor([0, 3]))


@right
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_flow_as_in_eager(value):
    x = torch.tensor([value, 1.0])
    out = poptorch.inferenceModel(Add(), _opts())(x, ONES)
    torch.testing.assert_close(out, x + ONES, equal_nan=True)


@right
def test_non_contiguous_input():
    x = torch.arange(6.0).reshape(2, 3).t()
    assert not x.is_contiguous()
    _compiled(Add(), x, torch.ones(3, 2))


@right
def test_float64_input_runs_in_float32():
    x = torch.linspace(0, 1, 4, dtype=torch.float64)
    out = poptorch.inferenceModel(Add(), _opts())(x, x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (x + x).float())


@error
def test_unsupported_op_names_the_source_line():
    class Fft(torch.nn.Module):
        def forward(self, x):
            return torch.fft.fft(x).real

    with pytest.raises(
        poptorch.UnsupportedOpError,
        match=r"(?s)2 unsupported operation.*_fft_r2c at .*test_reliability_poptorch_calls.py:\d+",
    ):
        poptorch.inferenceModel(Fft(), _opts())(torch.ones(4))


@error
def test_an_exception_inside_forward_names_the_users_line():
    class Raises(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad sample")

    with pytest.raises((poptorch.Error, ValueError), match="bad sample"):
        poptorch.inferenceModel(Raises(), _opts())(ONES)


@error
def test_detach_twice_and_attach_twice():
    model = _compiled(Add(), ONES, ONES)
    model.detachFromDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        model.detachFromDevice()
    model.attachToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        model.attachToDevice()
    _still_runs(model, Add(), ONES, ONES)


@error
def test_cycle_count_without_logging():
    model = _compiled(Add(), ONES, ONES)
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        model.cycleCount()


@right
def test_destroy_then_a_new_shape_recompiles():
    model = _compiled(Add(), ONES, ONES)
    model.destroy()
    torch.testing.assert_close(model(torch.ones(3), torch.ones(3)), 2 * torch.ones(3))


@error
def test_backward_on_an_output():
    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x):
            return poptorch.identity_loss(self.linear(x).sum(), "sum")

    out = poptorch.trainingModel(Loss(), _opts())(torch.ones(1, 2))
    with pytest.raises(RuntimeError, match=r"backward\(\) cannot be called explicitly on outputs of a PopTorch model"):
        out.backward()
