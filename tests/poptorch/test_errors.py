"""Every bad input to a wrapped model raises a clear poptorch.Error (texts as PopTorch's)."""

import pytest
import torch

import poptorch


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x)


class DictInput(torch.nn.Module):
    def forward(self, inputs):
        return inputs["x"] * 2 + inputs["y"]


def test_shape_and_dtype_changes_after_compilation():
    model = poptorch.inferenceModel(Linear(), _opts())
    model(torch.ones(1, 2))
    with pytest.raises(poptorch.Error, match=r"expected torch.Size\(\[1, 2\]\) but got torch.Size\(\[2, 2\]\)"):
        model(torch.ones(2, 2))
    with pytest.raises(poptorch.Error, match="expected torch.float32 but got torch.float16"):
        model(torch.ones(1, 2, dtype=torch.half))
    model.destroy()
    assert model(torch.ones(2, 2)).shape == (2, 2)


def test_int64_input_dtype_change():
    class Index(torch.nn.Module):
        def forward(self, i):
            return i + 1

    model = poptorch.inferenceModel(Index(), _opts())
    assert model(torch.tensor([1, 2])).dtype == torch.int32
    with pytest.raises(poptorch.Error, match="expected torch.int64 but got torch.int32"):
        model(torch.tensor([1, 2], dtype=torch.int32))


def test_missing_and_unexpected_arguments():
    class TwoInputs(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    model = poptorch.inferenceModel(TwoInputs(), _opts())
    with pytest.raises(poptorch.Error, match=r"^Missing arguments: y\.$"):
        model(x=torch.ones(2))
    with pytest.raises(poptorch.Error, match=r"^Unexpected arguments: z\.$"):
        model(torch.ones(2), torch.ones(2), z=torch.ones(2))


def test_dict_input_keys():
    model = poptorch.inferenceModel(DictInput(), _opts())
    x = torch.ones(2)
    assert torch.equal(model({"x": x, "y": x}), torch.full((2,), 3.0))
    with pytest.raises(poptorch.Error, match=r"^Missing arguments: y\.$"):
        model({"x": x})
    with pytest.raises(poptorch.Error, match=r"^Unexpected arguments: z\.$"):
        model({"x": x, "y": x, "z": x})


def test_zero_sized_and_requires_grad_inputs():
    model = poptorch.inferenceModel(Linear(), _opts())
    with pytest.raises(poptorch.Error, match=r"^Zero-sized tensors are unsupported \(Got shape \[0, 2, 5, 5\]\)$"):
        model(torch.ones(0, 2, 5, 5))
    with pytest.raises(poptorch.Error, match="requires grad"):
        model(torch.ones(1, 2, requires_grad=True))


def test_inference_with_gradient_accumulation_rejected():
    opts = _opts()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradient accumulation"):
        poptorch.inferenceModel(Linear(), opts)


def test_every_n_period_must_divide_iterations():
    opts = _opts().deviceIterations(3).outputMode(poptorch.OutputMode.EveryN, 2)
    with pytest.raises(poptorch.Error, match="EveryN"):
        poptorch.inferenceModel(Linear(), opts)


def test_set_optimizer_on_inference_model():
    with pytest.raises(poptorch.Error, match="trainingModel"):
        poptorch.inferenceModel(Linear(), _opts()).setOptimizer(torch.optim.SGD(Linear().parameters(), lr=0.1))


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.fc(x)
        return out, self.loss(out, labels)


def test_a_class_label_out_of_range_is_an_error():
    model = Classifier()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    training(x, torch.tensor([0, 2]))
    with pytest.raises(poptorch.Error, match="out of range"):
        training(x, torch.tensor([0, 3]))


def test_an_engine_fault_is_unrecoverable_as_in_poptorch():
    model = poptorch.inferenceModel(torch.nn.Linear(4, 3), _opts())
    x = torch.randn(2, 4)
    model(x)
    flat = model._exe._programs[model._programs.micro_batch][0]
    table = flat.instructions.copy()
    table[:, 1] = 10_000  # sub-ops no codelet implements: the corruption a bad executable would bring
    flat.instructions = table
    with pytest.raises(poptorch.UnrecoverableError, match="unrecoverable fault.*trapped instruction row") as caught:
        model(x)
    assert caught.value.type == "poplar_unrecoverable_runtime_error"
    assert not isinstance(caught.value, poptorch.RecoverableError)


def test_poptorch_wait_for_ipu_is_read(monkeypatch, caplog):
    monkeypatch.setenv("POPTORCH_WAIT_FOR_IPU", "1")
    with caplog.at_level("DEBUG", logger="poptorch"):
        poptorch.Options()
    assert "POPTORCH_WAIT_FOR_IPU is set: a simulated IPU is always free" in caplog.text
    monkeypatch.setenv("POPTORCH_WAIT_FOR_IPU", "soon")
    with pytest.raises(poptorch.Error, match="POPTORCH_WAIT_FOR_IPU must be 1 or 0"):
        poptorch.Options()
