"""What the per-call fast path relies on: records, signatures and dtypes looked up once, feeds that view the
user's tensors, outputs that are not copied again. Every call must still see host edits, refuse changed or
out-of-range inputs with the same errors, and give identical results and cycles when repeated."""

import copy

import pytest
import torch
from regressor import Regressor
from regressor import quiet_options as _opts
from regressor import regression_data as _data
from sgd_step import eager_step

import poptorch


class _Classifier(torch.nn.Module):
    def __init__(self, ignore_index=-100):
        super().__init__()
        self.fc = torch.nn.Linear(4, 5)
        self.loss = torch.nn.CrossEntropyLoss(ignore_index=ignore_index)

    def forward(self, x, labels):
        out = self.fc(x)
        return out, self.loss(out, labels)


def _run_timelines(executor):
    return [program["run_timeline"] for program in executor.profile.programs.values() if "run_timeline" in program]


def test_repeated_calls_give_identical_results_and_cycles():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    inference = poptorch.inferenceModel(model, _opts().logCycleCount(True))
    x = torch.randn(6, 4)
    runs = [(inference(x), inference.cycleCount()) for _ in range(3)]
    for out, cycles in runs[1:]:
        assert torch.equal(out, runs[0][0]) and cycles == runs[0][1]
    torch.testing.assert_close(runs[0][0], model(x), rtol=1e-5, atol=1e-5)


def test_outputs_of_earlier_calls_keep_their_values():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inference = poptorch.inferenceModel(model, _opts())
    x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
    first = inference(x1)
    kept = first.clone()
    second = inference(x2)
    assert torch.equal(first, kept)
    torch.testing.assert_close(second, model(x2), rtol=1e-5, atol=1e-5)


def test_an_input_edited_in_place_between_calls_is_read_again():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inference = poptorch.inferenceModel(model, _opts())
    x = torch.randn(2, 4)
    inference(x)
    with torch.no_grad():
        x.mul_(3)
    torch.testing.assert_close(inference(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit", ["in_place", "new_storage"])
def test_a_host_weight_edit_after_several_calls_is_uploaded(edit):
    model = Regressor()
    eager = copy.deepcopy(model)
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    x, y = _data()
    for _ in range(3):
        training(x, y)
        eager_step(eager, eager_optimizer, x, y)
    with torch.no_grad():
        for net in (model, eager):  # reading the wrapped model's weight copies the device's back first
            if edit == "in_place":
                net.fc.weight.add_(0.5)
            else:
                net.fc.weight.data = net.fc.weight.detach() * 2
    out, loss = training(x, y)
    eager_out, eager_loss = eager(x, y)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)


def test_a_changed_input_shape_or_dtype_still_raises_after_calls():
    model = Regressor()
    training = poptorch.trainingModel(model, _opts(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    training(x, y)
    training(x, y)
    with pytest.raises(poptorch.Error, match=r"Input x: expected torch.Size\(\[4, 4\]\) but got"):
        training(torch.randn(8, 4), y)
    with pytest.raises(poptorch.Error, match="Input x: expected torch.float32 but got torch.float64"):
        training(x.double(), y)
    with pytest.raises(poptorch.Error, match="Too many positional arguments"):
        training(x, y, y)


def test_labels_are_checked_on_every_call():
    torch.manual_seed(0)
    model = _Classifier()
    eager = copy.deepcopy(model)
    inference = poptorch.inferenceModel(model, _opts())
    x = torch.randn(4, 4)
    inference(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(poptorch.Error, match="holds the index 5, out of range"):
        inference(x, torch.tensor([0, 5, 2, 3]))
    with pytest.raises(poptorch.Error, match="holds the index -1, out of range"):
        inference(x, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(poptorch.Error, match="does not fit the IPU's 32-bit integers"):
        inference(x, torch.tensor([0, 2**31, 2, 3]))
    labels = torch.tensor([4, -100, 0, 3])  # the ignore_index lies outside the class range but is allowed
    _, loss = inference(x, labels)
    torch.testing.assert_close(loss, eager(x, labels)[1], rtol=1e-5, atol=1e-5)


def test_cycles_of_a_call_after_set_optimizer_count_its_host_writes_once():
    model = Regressor()
    options = _opts().logCycleCount(True)
    training = poptorch.trainingModel(model, options, poptorch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    training(x, y)
    plain = training.cycleCount()
    timeline = _run_timelines(training)
    training(x, y)
    assert training.cycleCount() == plain
    training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.05))
    training(x, y)
    assert training.cycleCount() > plain  # the new learning rate's host write
    training(x, y)
    assert training.cycleCount() == plain
    assert _run_timelines(training) == timeline


def test_arguments_by_position_keyword_or_default_are_one_call():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, scale=None, *, shift=0.0):
            out = self.fc(x) + shift
            return out if scale is None else out * scale

    torch.manual_seed(0)
    model = Scaled()
    inference = poptorch.inferenceModel(model, _opts())
    x, scale = torch.randn(2, 4), torch.full((2, 3), 2.0)
    expected = model(x, scale)
    for call in (
        lambda: inference(x, scale),
        lambda: inference(x, scale=scale),
        lambda: inference(x, scale, shift=0.0),
    ):
        torch.testing.assert_close(call(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(poptorch.Error, match="Input scale was a tensor"):
        inference(x)
